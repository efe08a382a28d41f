"""kvlens' bottom layer: the closed vocabulary (``semconv``, ``words``), trace
ids (``ids``), options and the kvlens home (``config``), log-once
(``logutil``), the hot-path :class:`~kvrecord.recorder.Recorder` and
per-thread CPU accounting (``procstats``).

Everything else in kvlens imports from here; this package imports nothing
of kvlens' (``tools/check_layout.py`` checks it).
"""

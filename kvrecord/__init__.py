"""kvlens' bottom layer: the closed vocabulary (``semconv``, ``words``), trace
ids (``ids``), options and the kvlens home (``config``), log-once
(``logutil``), the hot-path :class:`~kvrecord.recorder.Recorder`,
per-thread CPU accounting (``procstats``), the child processes kvlens starts
(``children``, under the parent-death ``guard``) and free ports (``ports``).

Everything else in kvlens imports from here; this package imports nothing
of kvlens' (``tools/check_layout.py`` checks it).
"""

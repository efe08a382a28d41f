"""A real P/D stack (two vLLM servers plus the kvlens router), in one-job modules:

* :mod:`~kvlens.stack.supervise`  child processes: start, health-wait, stop whole process groups
* :mod:`~kvlens.stack.ports`      a stack's ports checked and completed
* :mod:`~kvlens.stack.pinning`    CPU pinning of vLLM's workers (CPU hosts)
* :mod:`~kvlens.stack.commands`   command lines, environments, ``kv_transfer_config``
* :mod:`~kvlens.stack.spec`       a stack's configuration, checked and normalized
* :mod:`~kvlens.stack.children`   a stack's supervised children, started and stopped
* :mod:`~kvlens.stack.netstack`   a ``--hosts`` stack's namespaces, links and delayers
* :mod:`~kvlens.stack.roles`      each child's command line, environment and log
* :mod:`~kvlens.stack.launch`     :class:`~kvlens.stack.launch.Stack`, which puts them together

``kvlens up`` (:mod:`kvlens.up`) is the command line on top; the bench, the
demo and the tests use :class:`~kvlens.stack.launch.Stack` directly.
"""

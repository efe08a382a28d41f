"""A real P/D stack (two vLLM servers plus the kvlens router), in one-job modules:

* :mod:`~kvlens.stack.supervise`  child processes: start, health-wait, stop whole process groups
* :mod:`~kvlens.stack.ports`      free ports and port checks
* :mod:`~kvlens.stack.pinning`    CPU pinning of vLLM's workers (CPU hosts)
* :mod:`~kvlens.stack.commands`   command lines, environments, ``kv_transfer_config``
* :mod:`~kvlens.stack.launch`     :class:`Stack`, which puts them together

``kvlens up`` (:mod:`kvlens.up`) is the command line on top; the bench, the
demo and the tests use :class:`Stack` directly.
"""

from kvlens.stack.errors import StackError
from kvlens.stack.launch import Stack

__all__ = ["Stack", "StackError"]

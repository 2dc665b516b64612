"""A managed worker's threads' stacks on demand (protocol/constants.py, STACK_SIGNAL_OFFSET): its agent sends the
signal before it kills a worker that did not acknowledge a quiesce, so the job log says where it was blocked
instead of only that it was. faulthandler writes from its C signal handler, so a training thread stuck inside a
gloo or NCCL call is shown too."""
from __future__ import annotations

import faulthandler
import signal
import sys

from phoenixrun.protocol.constants import stack_signal


def install() -> bool:
    """Have faulthandler print every thread's stack to stderr on the stack signal, unless the script already
    handles that signal. True if installed."""
    sig = stack_signal()
    if signal.getsignal(sig) not in (signal.SIG_DFL, None):
        return False
    faulthandler.register(sig, file=sys.stderr, all_threads=True, chain=False)
    return True

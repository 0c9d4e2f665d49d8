"""Processes that end with the one that started them: what every launcher and server here shares."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sent: int = signal.SIGKILL) -> None:
    """Have this process sent `sent` when the process (on Linux, the thread) that started it ends, and
    end now if that one is already gone. Called first in a child (`preexec_fn`, or a rank's main).
    Elsewhere than on Linux, nothing."""
    if sys.platform != "linux":
        return
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sent, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent ended before the call above: no signal will come
        os.kill(os.getpid(), sent)

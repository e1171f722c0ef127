"""What a platform process that holds other tenants' memory does to itself at start: it makes itself not dumpable
(`prctl(PR_SET_DUMPABLE, 0)`), so that another process of the same uid without CAP_SYS_PTRACE can neither ptrace it
nor open anything through its `/proc/PID/fd`, `/proc/PID/mem` or `/proc/PID/map_files` (the kernel's
`ptrace_may_access` refuses a non-dumpable target to all but a holder of CAP_SYS_PTRACE: root is not stopped). The
backbone daemon (its base pass maps every member's buffer) and every function worker (its buffer, its adapter, its
KV cache) call it; a fork inherits the flag, an exec of a set-uid program aside it is never set back."""

from __future__ import annotations

import ctypes

PR_SET_DUMPABLE = 4  # linux/prctl.h
PR_GET_DUMPABLE = 3


def _prctl(option: int, arg: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if result < 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")
    return result


def forbid_dumping() -> None:
    """This process is not dumpable from now on (nor are the children it forks)."""
    _prctl(PR_SET_DUMPABLE, 0)


def is_dumpable() -> bool:
    return _prctl(PR_GET_DUMPABLE) != 0

"""Names the processes a server spawns, as `ps -o comm`, top and /proc/PID/comm show them: `shardserve-r1` for
rank 1, `shardserve-api0` for the first API server (Linux keeps 15 characters; elsewhere nothing changes)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15


def name_this_process(name: str) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except OSError:
        pass  # only a name: never a reason to fail

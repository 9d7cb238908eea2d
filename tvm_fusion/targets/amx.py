"""Linux's permission for AMX tiles, which a process must request before its first tile
instruction (else the kernel kills it with SIGILL): ``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``, once per process.

An exported library built for an AMX target requests it itself when it is loaded, by any
runtime (``amx_permission.cc``, linked in by ``platforms.export_options``); the compiling
process requests it here before it runs an AMX kernel (compile's verification, benchmarks).
"""

from __future__ import annotations

import ctypes
import functools
import platform
from pathlib import Path

# The C++ source linked into model.so for an AMX target: a constructor that requests the permission.
PERMISSION_SOURCE = Path(__file__).with_name("amx_permission.cc")
_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@functools.cache
def request_amx_permission() -> bool:
    """Ask Linux for the AMX tile state for this process; True when granted. False elsewhere
    (another OS or CPU, a kernel before 5.16, a CPU without AMX), where no AMX kernel can run."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0

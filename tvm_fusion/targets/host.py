"""This machine: its CPU features, whether it has a GPU, and how it can run an artifact."""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Mapping
from pathlib import Path

import tvm

from .emulation import aarch64_runtime_dir
from .platforms import platform_of
from .toolchain import AARCH64_GXX, QEMU_AARCH64, SETUP_SCRIPT


@dataclasses.dataclass(frozen=True)
class Execution:
    """How this machine can run an artifact: "native", "qemu" or None; ``reason`` says why not natively."""

    how: str | None
    reason: str = ""


def host_cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def cuda_available() -> bool:
    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # no CUDA runtime in this TVM build, or no driver
        return False


def execution_here(target: Mapping) -> Execution:
    """Whether (and how) an artifact for ``target`` runs on this machine, and if not, why."""
    plat = platform_of(target)
    machine = platform.machine()
    if plat.device == "cuda" and not cuda_available():
        return Execution(None, f"it needs a CUDA GPU ({plat.arch}) and this machine has none "
                               "(tvm.cuda(0) does not exist)")
    if plat.cpu == machine or (plat.cpu == "x86_64" and machine == "AMD64"):
        missing = [flag for flag in plat.cpu_flags if flag not in host_cpu_flags()]
        if missing:
            return Execution(None, f"its code uses {', '.join(missing)}, which this CPU lacks")
        return Execution("native")
    if plat.cpu == "aarch64" and plat.device is None:
        missing = [tool for tool in (QEMU_AARCH64, AARCH64_GXX) if tool.path() is None]
        if not aarch64_runtime_dir().joinpath("libtvm_runtime.so").is_file():
            return Execution(None, f"it is an aarch64 library; emulation needs the aarch64 TVM runtime "
                                   f"in {aarch64_runtime_dir()} (run {SETUP_SCRIPT} aarch64)")
        if missing:
            return Execution(None, "it is an aarch64 library; emulation needs "
                                   + ", ".join(f"{t.command} (apt-get install -y {t.package})" for t in missing))
        return Execution("qemu", f"it is an aarch64 library and this machine is {machine}")
    return Execution(None, f"it is a {plat.cpu} library and this machine is {machine}")

"""What a target builds for (CPU, arch, device) and how ``export_library`` must link for it."""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Mapping

from tvm.support import cc
from tvm.target import Target

from ..kernels.cpu_features import has_amx_bf16, has_amx_int8, has_avx512_bf16, has_vnni
from .amx import PERMISSION_SOURCE
from .cuda import cuda_fatbin_packer
from .target_info import simd_bits
from .toolchain import AARCH64_GCC, GCC, NVCC, Tool, tool_version

# x86 CPU flags (/proc/cpuinfo names) the code for a vector width needs.
X86_REQUIRED_FLAGS = {512: ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"),
                      256: ("avx2", "fma"), 128: ()}


@dataclasses.dataclass(frozen=True)
class Platform:
    """What an artifact built for a target needs from the machine that runs it."""

    cpu: str                      # ELF machine of the host code: "x86_64" or "aarch64"
    arch: str                     # LLVM mcpu (or "generic"), or the CUDA arch "sm_90"
    cpu_flags: tuple[str, ...]    # x86 features the code uses (/proc/cpuinfo names)
    device: str | None            # "cuda" when kernels run on a GPU
    linker: Tool                  # links model.so
    device_compiler: Tool | None  # compiles device code into the library

    def to_json(self) -> dict:
        return {"cpu": self.cpu, "arch": self.arch, "requires_cpu_flags": list(self.cpu_flags),
                "device": self.device}


def platform_of(target: Mapping) -> Platform:
    """The platform a TVM target dict (as in a config or metadata.json) builds for."""
    kind = target.get("kind")
    if kind == "cuda":
        host = dict(target.get("host") or {"kind": "llvm"})
        host_platform = platform_of(host)
        return dataclasses.replace(host_platform, arch=str(target["arch"]), device="cuda",
                                   device_compiler=NVCC)
    triple = str(target.get("mtriple", "")) or platform.machine()
    cpu = "aarch64" if triple.startswith(("aarch64", "arm64")) else "x86_64"
    arch = str(target.get("mcpu", "generic"))
    if cpu == "aarch64":
        linker = GCC if platform.machine() == "aarch64" else AARCH64_GCC
        return Platform(cpu, arch, (), None, linker, None)
    host_target = Target({k: v for k, v in target.items() if k != "host"})
    # The int8 matmul kernels of a VNNI target (frontend/integer_matmul.py) run vpdpbusd.
    vnni = ("avx512_vnni",) if has_vnni(host_target) else ()
    # ... and its bf16 kernels without AMX vdpbf16ps (schedules/cpu/bf16_matmul_avx512.py).
    vnni += ("avx512_bf16",) if has_avx512_bf16(host_target) else ()
    # ... and those of an AMX target AMX tiles (schedules/cpu/int8_matmul_amx.py), as do its bf16
    # matmul kernels (schedules/cpu/bf16_matmul_amx.py).
    amx = (("amx_int8",) if has_amx_int8(host_target) else ()) + (("amx_bf16",) if has_amx_bf16(host_target) else ())
    amx += ("amx_tile",) if amx else ()
    return Platform(cpu, arch, X86_REQUIRED_FLAGS[simd_bits(host_target)] + vnni + amx, None, GCC, None)


def check_toolchain(target_name: str, target: Mapping) -> dict[str, str]:
    """Raise ToolchainError (naming the package) unless every build tool is here; else their versions."""
    plat = platform_of(target)
    tools = [plat.linker] + ([plat.device_compiler] if plat.device_compiler else [])
    return {tool.command: tool_version(tool.require(target_name)) for tool in tools}


def export_options(target_name: str, target: Mapping, device_code: dict | None = None) -> dict:
    """Keyword arguments for ``export_library`` that link (and device-compile) for ``target``.

    ``device_code``, when given, receives what was embedded for a CUDA target (see
    ``cuda_fatbin_packer``). For a CPU with AMX tiles, the library gets a constructor that asks
    Linux for the tile state when it is loaded (``amx.PERMISSION_SOURCE``): any runtime that
    loads it, plain TVM included, may then run its AMX kernels.
    """
    plat = platform_of(target)
    options: dict = {}
    if "amx_tile" in plat.cpu_flags:
        options["addons"] = [str(PERMISSION_SOURCE)]  # a new list: export_library appends to it
    if plat.linker.command != "gcc":
        options["fcompile"] = cc.cross_compiler(plat.linker.require(target_name))
    if plat.device == "cuda":
        options["fpack_imports"] = cuda_fatbin_packer(plat.arch, plat.device_compiler.require(target_name),
                                                      device_code if device_code is not None else {})
    return options

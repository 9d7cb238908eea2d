"""Per-target toolchains: what links an artifact, what compiles its device code, where it runs.

One model goes to several machines (x86-64 with AVX-512 or AVX2, aarch64, CUDA GPUs). For each
target this package knows which compilers the build needs and which Debian package brings each
(``toolchain``), what the target builds for and how ``export_library`` must link for it
(``platforms``: a cross compiler for aarch64, an nvcc fatbin for CUDA, from ``cuda``), what an
LLVM target's CPU offers (``target_info``: SIMD width, vector registers, cores), how to
inspect the result (``elf``; ``cuda`` for the embedded device code) and whether, and how, an
artifact can run on this machine (``host``): natively, under qemu-user (``emulation``), or not
at all.

The modules depend downward only: toolchain <- cuda <- platforms <- host,
target_info <- platforms, and toolchain <- emulation <- host; elf depends on none of them.
"""

from ..errors import ArtifactError, ToolchainError
from .cuda import FATBIN_MAGIC, cuda_fatbin_packer, embedded_cuda_modules, fatbin_archs, unscheduled_gpu_kernels
from .elf import ELF_MACHINES, elf_machine, exported_symbols
from .emulation import VM_RUNNER_SOURCE, aarch64_runner, aarch64_runtime_dir, run_emulated
from .host import Execution, cuda_available, execution_here, host_cpu_flags
from .platforms import X86_REQUIRED_FLAGS, Platform, check_toolchain, export_options, platform_of
from .toolchain import (AARCH64_GCC, AARCH64_GXX, CUOBJDUMP, GCC, NVCC, QEMU_AARCH64, SETUP_SCRIPT, Tool,
                        tool_version)

__all__ = [
    "AARCH64_GCC", "AARCH64_GXX", "CUOBJDUMP", "ELF_MACHINES", "FATBIN_MAGIC", "GCC", "NVCC", "QEMU_AARCH64",
    "SETUP_SCRIPT", "VM_RUNNER_SOURCE", "X86_REQUIRED_FLAGS", "ArtifactError", "Execution", "Platform",
    "Tool", "ToolchainError", "aarch64_runner", "aarch64_runtime_dir", "check_toolchain",
    "cuda_available", "cuda_fatbin_packer", "elf_machine", "embedded_cuda_modules", "execution_here",
    "export_options", "exported_symbols", "fatbin_archs", "host_cpu_flags", "platform_of", "run_emulated",
    "tool_version", "unscheduled_gpu_kernels",
]

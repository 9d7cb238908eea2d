"""What an LLVM target's CPU offers the code built for it: SIMD width, vector registers, cores.

The CPU schedule rules size their tiles by it, the pipeline its blocked layout, ``platforms``
the CPU flags an artifact requires.
"""

import tvm
from tvm.target import Target


def simd_bits(target: Target) -> int:
    """Width in bits of the widest vector register the target's code may use.

    Asked of LLVM for the target's own CPU and attributes (not the compiling host's), so a CPU
    name this file has never heard of (a new Zen or Xeon) still gets its real width.
    """
    triple = str(target.attrs.get("mtriple", ""))
    if triple.startswith(("aarch64", "arm")) or "arm_cpu" in target.keys:
        return 128
    if not (target.attrs.get("mcpu") or target.attrs.get("mattr")):
        # No CPU named: LLVM then compiles for the host, so ask LLVM about the host.
        return max(tvm.target.codegen.llvm_get_vector_width(target), 128)
    has = tvm.target.codegen.llvm_cpu_has_features
    if has(["avx512f"], target):
        return 512
    if has(["avx2"], target):
        return 256
    return 128


def vector_registers(target: Target) -> int:
    """Architectural vector registers: 32 on AVX-512 and AArch64, 16 on AVX2 and SSE."""
    triple = str(target.attrs.get("mtriple", ""))
    arm = triple.startswith(("aarch64", "arm")) or "arm_cpu" in target.keys
    return 32 if arm or simd_bits(target) == 512 else 16


def spills_unrolled_loads(target: Target) -> bool:
    """Whether LLVM's instruction scheduling for the target's CPU moves the loads of a fully
    unrolled loop of many FMAs ahead of them, past what the registers hold, and spills them: its
    AVX-512 Zen models do (a 1x1 conv's 16 unrolled input channels: 40-42 zmm spills and as many
    reloads), its Intel and generic x86-64 models do not, nor its AVX2 Zen ones on 8-channel
    blocks. Rules unroll less for such a CPU."""
    return str(target.attrs.get("mcpu", "")).startswith("znver") and simd_bits(target) == 512


def vector_lanes(target: Target, dtype: str) -> int:
    """How many elements of `dtype` fit in one vector register."""
    return max(simd_bits(target) // tvm.DataType(dtype).bits, 1)


def num_cores(target: Target) -> int:
    """Cores the target says it may use; 1 when it does not say."""
    return int(target.attrs.get("num-cores", 1) or 1)

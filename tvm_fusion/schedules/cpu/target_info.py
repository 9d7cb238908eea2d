"""What the CPU schedule rules need to know about an LLVM target: SIMD width and core count."""

import tvm
from tvm.target import Target

# LLVM's own query answers for the host, not for the named CPU, so read the target instead.
_AVX512_CPUS = {
    "skylake-avx512", "cascadelake", "cooperlake", "cannonlake", "icelake-client",
    "icelake-server", "tigerlake", "rocketlake", "sapphirerapids", "emeraldrapids",
    "graniterapids", "graniterapids-d", "diamondrapids", "znver4", "znver5", "x86-64-v4",
}
_AVX2_CPUS = {
    "haswell", "broadwell", "skylake", "alderlake", "raptorlake", "meteorlake", "arrowlake",
    "lunarlake", "gracemont", "znver1", "znver2", "znver3", "x86-64-v3", "core-avx2",
}


def simd_bits(target: Target) -> int:
    """Width in bits of the widest vector register the target's code may use."""
    mattr = [str(attr) for attr in target.attrs.get("mattr", [])]
    mcpu = str(target.attrs.get("mcpu", ""))
    triple = str(target.attrs.get("mtriple", ""))
    if triple.startswith(("aarch64", "arm")) or "arm_cpu" in target.keys:
        return 128
    if "+avx512f" in mattr or mcpu in _AVX512_CPUS:
        return 512
    if "+avx2" in mattr or mcpu in _AVX2_CPUS:
        return 256
    if mcpu or mattr:
        return 128
    # No CPU named: LLVM then compiles for the host, so ask LLVM about the host.
    return max(tvm.target.codegen.llvm_get_vector_width(target), 128)


def vector_registers(target: Target) -> int:
    """Architectural vector registers: 32 on AVX-512 and AArch64, 16 on AVX2 and SSE."""
    triple = str(target.attrs.get("mtriple", ""))
    arm = triple.startswith(("aarch64", "arm")) or "arm_cpu" in target.keys
    return 32 if arm or simd_bits(target) == 512 else 16


def vector_lanes(target: Target, dtype: str) -> int:
    """How many elements of `dtype` fit in one vector register."""
    return max(simd_bits(target) // tvm.DataType(dtype).bits, 1)


def num_cores(target: Target) -> int:
    """Cores the target says it may use; 1 when it does not say."""
    return int(target.attrs.get("num-cores", 1) or 1)

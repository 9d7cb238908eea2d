"""The x86 instructions an int8 or bf16 kernel may use on a target's CPU (its ``mcpu``/``mattr``, not
the compiling host's): the import picks the int8 matmul kernel by them, the schedule rules
tensorize with them, and ``targets/platforms`` requires them of the machine that runs it."""

import tvm
from tvm.target import Target


def has_vnni(target: Target) -> bool:
    """AVX512-VNNI (``vpdpbusd``)."""
    return target.kind.name == "llvm" and bool(tvm.target.codegen.llvm_cpu_has_features(["avx512vnni"], target))


def has_amx_int8(target: Target) -> bool:
    """AMX tiles with int8 products (Sapphire and Emerald Rapids on)."""
    return target.kind.name == "llvm" and bool(
        tvm.target.codegen.llvm_cpu_has_features(["amx-int8", "amx-tile"], target))


def has_avx512_bf16(target: Target) -> bool:
    """AVX512_BF16 (``vdpbf16ps``, ``vcvtne2ps2bf16``: Cooper Lake, Sapphire Rapids on, Zen 4 on)."""
    return target.kind.name == "llvm" and bool(tvm.target.codegen.llvm_cpu_has_features(["avx512bf16"], target))


def has_amx_bf16(target: Target) -> bool:
    """AMX tiles with bf16 products (``tdpbf16ps``: Sapphire and Emerald Rapids on)."""
    return target.kind.name == "llvm" and bool(
        tvm.target.codegen.llvm_cpu_has_features(["amx-bf16", "amx-tile"], target))


def has_bf16_kernels(target: Target) -> bool:
    """A bf16 matmul kernel computes fast here: on AMX tiles (``Bf16MatmulAmx``) or on
    AVX512_BF16's ``vdpbf16ps`` registers (``Bf16MatmulAvx512``)."""
    return has_amx_bf16(target) or has_avx512_bf16(target)

"""uint8 x int8 -> int32 matmul (``frontend/integer_matmul.py``) on AVX512-VNNI's ``vpdpbusd``.

The kernel's weight is packed ``[N/16, K/4, 16, 4]``: one 64-byte load holds 16 output columns
by 4 k, and one ``vpdpbusd`` adds the 4 products of each column (the activation's 4 bytes
broadcast) into 16 int32 lanes, exactly (no intermediate saturation, unlike ``vpmaddubsw``).
The register tiles are ``register_tiles.py``'s (shared with ``Bf16MatmulAvx512``); the epilogue
(zero-point corrections, the conversion to float, a requantization) runs on each finished tile.
A quantized conv's kernel (``frontend/int8_conv.py``) is the same sum over its input's patches:
the patch rows built per tile of rows, under the register tiles that read them (on a CPU with
AVX512-VNNI and no AMX-INT8, ``passes/int8_convs.py``).

The tensor intrinsic is registered here, not taken from ``tvm.s_tir.tensor_intrin.x86``: that
package parses every target's intrinsics on import (~20 s), and its ``dot_16x4_vnni`` passes
``vpdpbusd`` the i32 operand types of older LLVMs, which the LLVM in TVM 0.27 rejects
("Call parameter type does not match function signature": the intrinsic now takes <64 x i8>).
"""

from functools import partial

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.script import tirx as T
from tvm.target import Target

from ...frontend.int8_conv import INT8_PATCHES
from ...frontend.integer_matmul import DEPTH_BLOCK
from ...kernels.blocks import is_cpu_kernel, only_reduction
from ...kernels.cpu_features import has_vnni
from .int8_sum import is_int8_sum
from .patch_prologue import schedule_with_operand
from .register_tiles import RegisterDot, dot_intrinsic, register_tiles

VNNI_INTRIN = "tvm_fusion_dot_16x4_u8i8i32_vnni"
VNNI_DOT = RegisterDot(VNNI_INTRIN, DEPTH_BLOCK)

# 16 int32 lanes, each plus 4 uint8 x int8 products
s_tir.TensorIntrin.register(VNNI_INTRIN, *dot_intrinsic(
    ("uint8", "int8"), "int32", DEPTH_BLOCK, lambda a, b: T.cast(a, "int32") * T.cast(b, "int32"),
    lambda sums, words, panel: T.call_llvm_pure_intrin(
        T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"), sums, T.reinterpret(words, dtype="int8x64"), panel,
        dtype="int32x16")), override=True)


class Int8MatmulVnni(ScheduleRule):
    """C[m, n] = sum_k u8(A[m, k]) * s8(W[n/16, k/4, n%16, k%4]) as ``vpdpbusd`` register tiles,
    its element-wise epilogue computed per tile; a conv's patch rows per tile of rows. Declines
    on a target without AVX512-VNNI (the import and ``Int8Convs`` emit the kernels only for one)
    and for any other kernel."""

    runs_before = ("MatmulEpilogue", "MatmulMultiOutput", "Attention")

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not is_cpu_kernel(func, target) or not has_vnni(target):
            return None
        kernel = only_reduction(s_tir.Schedule(func))
        if kernel is None or not is_int8_sum(kernel.stmt):
            return None
        return schedule_with_operand(kernel, INT8_PATCHES, partial(register_tiles, dot=VNNI_DOT))


"""bf16 x bf16 -> float32 matmul (``frontend/bf16_matmul.py``) on AVX512_BF16's ``vdpbf16ps``:
the bf16 kernel of a CPU without AMX (Zen 4 and later, Cooper Lake).

``vdpbf16ps`` adds, to each of 16 float32 lanes, the 2 products of a pair of consecutive k: the
kernel's packed weight ``[N/16, K/2, 16, 2]`` is one 64-byte load per pair of k, the
activation's pair one 32-bit broadcast. That is 32 multiply-adds an instruction, twice a float32
FMA's, from half the bytes. The register tiles are ``register_tiles.py``'s (shared with
``Int8MatmulVnni``); the float32 epilogue runs on each finished tile, a conv's patch rows are
built per tile of rows (``patch_prologue.py``).

TVM 0.27 cannot pass the instruction its bf16 operands: the intrinsic's implementation calls it
through ``kernels/avx512_bf16.py``, whose LLVM IR the kernel imports. Declines on a target
without AVX512_BF16, and for any other kernel. Where AMX-BF16 is there too, ``Bf16MatmulAmx`` is
asked first, and this rule takes what the tiles decline (a batch of items of a prime row count
past 16).
"""

from functools import partial

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.script import tirx as T
from tvm.target import Target

from ...frontend.bf16_conv import BF16_PATCHES
from ...frontend.bf16_matmul import DEPTH_BLOCK, bf16_value
from ...kernels.blocks import is_cpu_kernel, only_reduction
from ...kernels.avx512_bf16 import DPBF16PS_LLVM, dpbf16ps
from ...kernels.cpu_features import has_avx512_bf16
from .int8_sum import is_bf16_sum
from .patch_prologue import schedule_with_operand
from .register_tiles import RegisterDot, dot_intrinsic, register_tiles

DPBF16PS_INTRIN = "tvm_fusion_dot_16x2_bf16f32_avx512"
# Up to 6 column blocks: 24 accumulators, 6 weight loads and a broadcast fill 31 of the 32
# registers. Faster than 4 where K is short (a CTC head's K of 120: each tile's write-back and
# epilogue are then a large share), as fast at BERT's widths.
DPBF16PS_DOT = RegisterDot(DPBF16PS_INTRIN, DEPTH_BLOCK, max_column_blocks=6, import_llvm=DPBF16PS_LLVM)

# 16 float32 lanes, each plus 2 products of bf16 bits widened to float32
s_tir.TensorIntrin.register(DPBF16PS_INTRIN, *dot_intrinsic(
    ("uint16", "uint16"), "float32", DEPTH_BLOCK, lambda a, b: bf16_value(a) * bf16_value(b),
    lambda sums, words, panel: dpbf16ps(sums, words, T.reinterpret(panel, dtype="int32x16"))), override=True)


class Bf16MatmulAvx512(ScheduleRule):
    """C[m, n] = sum_k f32(A[m, k]) * f32(W[n/16, k/2, n%16, k%2]), bf16 operands, as
    ``vdpbf16ps`` register tiles, its element-wise epilogue computed per tile; a conv's patch
    rows per tile of rows. Declines on a target without AVX512_BF16 and for any other kernel."""

    runs_after = ("Bf16MatmulAmx",)
    runs_before = ("MatmulEpilogue", "MatmulMultiOutput", "Attention")

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not is_cpu_kernel(func, target) or not has_avx512_bf16(target):
            return None
        kernel = only_reduction(s_tir.Schedule(func))
        if kernel is None or not is_bf16_sum(kernel.stmt):
            return None
        return schedule_with_operand(kernel, BF16_PATCHES, partial(register_tiles, dot=DPBF16PS_DOT))

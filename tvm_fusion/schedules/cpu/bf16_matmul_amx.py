"""bf16 x bf16 -> float32 matmul (``frontend/bf16_matmul.py``) on AMX tiles (``tdpbf16ps``).

``tdpbf16ps C, A, B`` adds, to each float32 of a 16 x 16 C tile, the 2 bf16 products of 16
pairs of consecutive k (32 k per 64-byte tile row): the kernel's packed weight
``[N/16, K/2, 16, 2]`` is its B tile as it is, and the kernel's prologue (the float32
activation rounded to bf16, K padded to even) writes the A rows. One ``tdpbf16ps`` is
16 x 16 x 32 multiply-adds, 16 times a ``vdpbf16ps`` and 32 times a float32 FMA on AVX-512.
The tiles, their configuration and the row tiling are ``amx_tiles``'s, shared with
``Int8MatmulAmx``; the float32 epilogue (bias, activation, residual add) runs on each tile.

A conv's kernel (``frontend/bf16_conv.py``) is the same sum over its input's patches, its
prologue and output placed as ``patch_prologue.py`` places them.

Any row count from 1 takes tiles: a one-row tile still does 512 multiply-adds per
instruction, 16 times a ``vdpbf16ps``. Declines on a target without AMX-BF16, for a symbolic
row count, for a batched sum with a prime M past 16 (``amx_tiles``) and for a recurrent step's
small sum, which costs more in tile setup than in work: ``Bf16MatmulAvx512`` then puts the
kernel on ``vdpbf16ps`` registers (one core for the small sum) where the target has AVX512_BF16
(every AMX-BF16 CPU does).
"""

from functools import partial

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...frontend.bf16_conv import BF16_PATCHES
from ...frontend.bf16_matmul import DEPTH_BLOCK, bf16_value
from ...kernels.blocks import is_cpu_kernel, only_reduction
from ...kernels.cpu_features import has_amx_bf16, has_avx512_bf16
from .amx_tiles import TileProduct, schedule_tiles
from .int8_sum import is_bf16_sum
from .patch_prologue import schedule_with_operand
from .small_extent import is_small_static_sum

# The operands are bf16 bits in uint16 tensors (frontend/bf16_matmul.py says why).
BF16_TILES = TileProduct("bf16f32", "llvm.x86.tdpbf16ps", ("uint16", "uint16"), "float32", DEPTH_BLOCK,
                         lambda a, b: bf16_value(a) * bf16_value(b), min_rows=1)


class Bf16MatmulAmx(ScheduleRule):
    """C[m, n] = sum_k f32(A[m, k]) * f32(W[n/16, k/2, n%16, k%2]), bf16 operands, as AMX tiles
    (``tdpbf16ps``), its element-wise epilogue computed per tile. Declines on a target without
    AMX-BF16, for a symbolic row count, for a sum small enough for one core
    (``small_extent.is_small_static_sum``) where the target has AVX512_BF16, and for any other
    kernel."""

    runs_before = ("MatmulEpilogue", "MatmulMultiOutput", "Attention")

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not is_cpu_kernel(func, target) or not has_amx_bf16(target):
            return None
        kernel = only_reduction(s_tir.Schedule(func))
        if kernel is None or not is_bf16_sum(kernel.stmt):
            return None
        if is_small_static_sum(kernel.stmt) and has_avx512_bf16(target):
            return None  # a recurrent step's: Bf16MatmulAvx512 runs it on one core, without tile setup
        return schedule_with_operand(kernel, BF16_PATCHES, partial(schedule_tiles, spec=BF16_TILES))

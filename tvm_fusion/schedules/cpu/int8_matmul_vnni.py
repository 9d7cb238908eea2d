"""uint8 x int8 -> int32 matmul (``frontend/integer_matmul.py``) on AVX512-VNNI's ``vpdpbusd``.

The kernel's weight is packed ``[N/16, K/4, 16, 4]``: one 64-byte load holds 16 output columns
by 4 k, and one ``vpdpbusd`` adds the 4 products of each column (the activation's 4 bytes
broadcast) into 16 int32 lanes, exactly (no intermediate saturation, unlike ``vpmaddubsw``).
A tile of ``rows x 16*column_blocks`` accumulators stays in registers over all of K; the
epilogue (zero-point corrections, the conversion to float, a requantization FuseOps put in the
kernel) runs on each finished tile. A quantized conv's kernel (``frontend/int8_conv.py``) is the
same sum over its input's patches, its prologue and output placed as ``patch_prologue.py``
places them for AMX tiles: the patch rows built per tile of rows, under the register tiles that
read them (on a CPU with AVX512-VNNI and no AMX-INT8, ``passes/int8_convs.py``).

The tensor intrinsic is registered here, not taken from ``tvm.s_tir.tensor_intrin.x86``: that
package parses every target's intrinsics on import (~20 s), and its ``dot_16x4_vnni`` passes
``vpdpbusd`` the i32 operand types of older LLVMs, which the LLVM in TVM 0.27 rejects
("Call parameter type does not match function signature": the intrinsic now takes <64 x i8>).
"""

from math import prod

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.script import tirx as T
from tvm.target import Target

from ...frontend.int8_conv import INT8_PATCHES
from ...frontend.integer_matmul import COLUMN_BLOCK, DEPTH_BLOCK
from ...kernels.blocks import OneReduction, is_cpu_kernel, only_reduction
from ...kernels.cpu_features import has_vnni
from .helpers import extent_of, largest_divisor
from .int8_sum import is_int8_sum, operand_block, place_prologue, with_epilogue_per_tile, write_back_tiles
from .patch_prologue import schedule_with_operand

VNNI_INTRIN = "tvm_fusion_dot_16x4_u8i8i32_vnni"
# Register tile: rows x column blocks of 16 int32 accumulators (16 of AVX-512's 32 registers),
# each weight load used by every row, each broadcast activation by every column block.
MAX_TILE_ROWS, MAX_TILE_COLUMN_BLOCKS = 4, 4
# A conv's rows are an output row's pixels (conv_patches.py), and a MobileNet's last maps are 7
# and 14 wide: divisors up to 4 leave tiles of 1 or 2 rows, too few accumulators to hide
# vpdpbusd's latency. Such a conv takes up to this many rows, with fewer column blocks, at most
# MAX_TILE_ACCUMULATORS registers in all.
MAX_CONV_TILE_ROWS, MAX_TILE_ACCUMULATORS = 8, 24
# A weight larger than this is swept once per tile of columns, all rows under it, instead of
# once per tile of rows: it no longer stays in L2 between row tiles (faster for the larger
# weights of benchmarks/bench_int8.py; at 1 MB and below the two orders tie).
COLUMNS_OUTER_WEIGHT_BYTES = 1 << 20


def _dot_16x4_vnni():
    """The intrinsic's description (16 int32 lanes, each += 4 uint8 x int8 products, the
    accumulator in registers) and its ``vpdpbusd`` implementation."""

    @T.prim_func(s_tir=True)
    def desc(a: T.Buffer((4,), "uint8", offset_factor=1), b: T.Buffer((16, 4), "int8", offset_factor=1),
             c: T.Buffer((16,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:16], a[0:4], b[0:16, 0:4])
            T.writes(c[0:16])
            for i in T.serial(0, 16):
                for k in T.serial(0, 4):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + T.cast(a[vk], "int32") * T.cast(b[vi, vk], "int32")

    @T.prim_func(s_tir=True)
    def impl(a: T.Buffer((4,), "uint8", offset_factor=1), b: T.Buffer((16, 4), "int8", offset_factor=1),
             c: T.Buffer((16,), "int32", offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:16], a[0:4], b[0:16, 0:4])
            T.writes(c[0:16])
            a_quad = T.reinterpret(a.vload([0], "uint8x4"), dtype="int32")
            c[T.ramp(T.int32(0), 1, 16)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"), c.vload([0], dtype="int32x16"),
                T.reinterpret(T.broadcast(a_quad, 16), dtype="int8x64"), b.vload([0, 0], dtype="int8x64"),
                dtype="int32x16")

    return desc, impl


s_tir.TensorIntrin.register(VNNI_INTRIN, *_dot_16x4_vnni(), override=True)


class Int8MatmulVnni(ScheduleRule):
    """C[m, n] = sum_k u8(A[m, k]) * s8(W[n/16, k/4, n%16, k%4]) as ``vpdpbusd`` register tiles,
    its element-wise epilogue computed per tile; a conv's patch rows per tile of rows. Declines
    on a target without AVX512-VNNI (the import and ``Int8Convs`` emit the kernels only for one)
    and for any other kernel."""

    runs_before = ("MatmulEpilogue", "MatmulMultiOutput", "Attention")

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not is_cpu_kernel(func, target) or not has_vnni(target):
            return None
        kernel = only_reduction(s_tir.Schedule(func))
        if kernel is None or not is_int8_sum(kernel.stmt):
            return None
        return schedule_with_operand(kernel, INT8_PATCHES, _register_tiles)


def _register_tiles(kernel: OneReduction, per_tile: bool = True,
                    operand_per_row_tile: bool = False) -> s_tir.Schedule | None:
    """The sum as ``vpdpbusd`` register tiles, the epilogue per tile where it can follow one
    (never without ``per_tile``); with ``operand_per_row_tile`` the prologue block that writes
    the A operand (a conv's patch rows) computed per tile of rows (``int8_sum.operand_block``)."""
    *batch, m, n, _ = kernel.stmt.iter_vars
    operand = None
    if operand_per_row_tile:  # a conv's: static shapes
        rows = extent_of(m.dom.extent)
        tile_rows, _ = _tile_shape(rows, extent_of(n.dom.extent) // COLUMN_BLOCK, conv=True)
        operand = operand_block(kernel, rows // tile_rows * prod(extent_of(iv.dom.extent) for iv in batch))
    place_prologue(kernel.sch, kernel)
    # A symbolic row count keeps its tiles parallel: serial_when_small's serial copy would
    # define the tensorized blocks' match_buffer offsets twice (ill-formed TIR).
    return with_epilogue_per_tile(kernel.sch, lambda sch, epilogue_per_tile: _schedule(
        sch, kernel.block, kernel.epilogue, epilogue_per_tile, operand_per_row_tile, operand), per_tile)


def _tile_shape(rows, column_blocks: int, conv: bool) -> tuple[int, int]:
    """(rows, column blocks) of a register tile: divisors of the sum's, up to ``MAX_TILE_ROWS``
    x ``MAX_TILE_COLUMN_BLOCKS``; a ``conv``'s rows up to ``MAX_CONV_TILE_ROWS`` where that
    leaves fewer than ``MAX_TILE_ROWS`` (one row for a symbolic count)."""
    if not isinstance(rows, int):
        return 1, largest_divisor(column_blocks, MAX_TILE_COLUMN_BLOCKS)
    tile_rows = largest_divisor(rows, MAX_TILE_ROWS)
    if conv and tile_rows < MAX_TILE_ROWS:
        tile_rows = largest_divisor(rows, MAX_CONV_TILE_ROWS)
    blocks = largest_divisor(column_blocks, min(MAX_TILE_COLUMN_BLOCKS, MAX_TILE_ACCUMULATORS // tile_rows))
    return tile_rows, blocks


def _schedule(sch: s_tir.Schedule, block, epilogue: list, per_tile: bool, conv: bool = False, operand=None) -> None:
    """Register tiles of ``vpdpbusd`` (``_tile_shape``'s, a ``conv``'s); the epilogue computed
    per tile, or (``per_tile`` False) after the whole sum, across cores; the ``operand`` block
    (None: left as it is) computed per tile of rows, the column tiles under it."""
    *batch, m, n, k = sch.get_loops(block)  # rows tiled per batch item: a fused row index would
    # reach the tensorized block through a division, which blockize cannot take
    rows, columns = extent_of(sch.get(m).extent), extent_of(sch.get(n).extent)
    tile_rows, blocks = _tile_shape(rows, columns // COLUMN_BLOCK, conv)
    m_outer, m_inner = sch.split(m, [None, tile_rows])
    n_outer, n_block, n_lane = sch.split(n, [None, blocks, COLUMN_BLOCK])
    k_outer, k_inner = sch.split(k, [None, DEPTH_BLOCK])
    weight_bytes = columns * extent_of(sch.get(block).iter_vars[-1].dom.extent)
    columns_outer = operand is None and weight_bytes > COLUMNS_OUTER_WEIGHT_BYTES
    outer = (n_outer, m_outer) if columns_outer else (m_outer, n_outer)
    sch.reorder(*outer, k_outer, m_inner, n_block, n_lane, k_inner)
    write_back_tiles(sch, block, batch, outer, epilogue, per_tile, operand)
    init = sch.decompose_reduction(block, k_outer)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.unroll(m_inner)
    sch.unroll(n_block)
    sch.tensorize(n_lane, VNNI_INTRIN)


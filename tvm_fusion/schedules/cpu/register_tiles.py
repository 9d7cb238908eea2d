"""Register tiles of a packed-weight matmul kernel (``int8_sum.is_packed_sum``'s) on an AVX-512
dot-product instruction: ``vpdpbusd`` for int8 (``Int8MatmulVnni``), ``vdpbf16ps`` for bf16
(``Bf16MatmulAvx512``).

Both instructions add, to each of 16 lanes, the products of ``depth_block`` consecutive k of
one output column: the weight's packed ``[N/16, K/d, 16, d]`` panel is one 64-byte load, the
activation's d values one broadcast. A tile of ``rows x 16*column_blocks`` accumulators stays in
registers over all of K; the epilogue (bias, activation, a requantization FuseOps put in the
kernel) runs on each finished tile. A conv's kernel is the same sum over its input's patches,
its prologue and output placed as ``patch_prologue.py`` places them. A static sum of at most
``MAX_SERIAL_STATIC_WORK`` multiply-adds (a recurrent step's) runs on one core, as
``MatmulEpilogue`` runs one: waking the other core costs more than it would save.
"""

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

from tvm import s_tir
from tvm.script import tirx as T

from ...frontend.integer_matmul import COLUMN_BLOCK
from ...frontend.packed_weights import REGISTER_TILE_ROWS
from ...kernels.avx512_bf16 import IMPORT_ANNOTATION
from ...kernels.blocks import OneReduction
from .helpers import extent_of, largest_divisor
from .int8_sum import operand_block, place_prologue, with_epilogue_per_tile, write_back_tiles
from .small_extent import is_small_static_sum

# Register tile: rows x column blocks of 16 accumulators (16 to 24 of AVX-512's 32 registers),
# each weight load used by every row, each broadcast activation by every column block.
MAX_TILE_ROWS = REGISTER_TILE_ROWS
# A conv's rows are an output row's pixels (conv_patches.py), and a MobileNet's last maps are 7
# and 14 wide: divisors up to 4 leave tiles of 1 or 2 rows, too few accumulators to hide the
# instruction's latency. Such a conv takes up to this many rows, with fewer column blocks, at
# most MAX_TILE_ACCUMULATORS registers in all.
MAX_CONV_TILE_ROWS, MAX_TILE_ACCUMULATORS = 8, 24
# A weight larger than this is swept once per tile of columns, all rows under it, instead of
# once per tile of rows: it no longer stays in L2 between row tiles (faster for the larger
# weights of benchmarks/bench_int8.py; at 1 MB and below the two orders tie).
COLUMNS_OUTER_WEIGHT_BYTES = 1 << 20


LANES = 16  # sums per instruction: one AVX-512 register of 32-bit lanes


def dot_intrinsic(operand_dtypes: tuple[str, str], sum_dtype: str, depth: int, product: Callable, instruction: Callable):
    """A register dot product's tensor intrinsic (description, implementation): ``LANES``
    ``sum_dtype`` sums held in registers, each plus ``depth`` products ``product(a, b)`` of the
    activation's ``depth`` values and its column's ``depth`` weights. The implementation is
    ``instruction(sums, words, panel)``: the activation's values as one 32-bit word broadcast to
    every lane (int32 x 16), the weights as one 64-byte load of ``operand_dtypes[1]``."""
    a_dtype, b_dtype = operand_dtypes
    a_word, panel, sums = f"{a_dtype}x{depth}", f"{b_dtype}x{LANES * depth}", f"{sum_dtype}x{LANES}"

    @T.prim_func(s_tir=True)
    def desc(a: T.Buffer((depth,), a_dtype, offset_factor=1), b: T.Buffer((LANES, depth), b_dtype, offset_factor=1),
             c: T.Buffer((LANES,), sum_dtype, offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:LANES], a[0:depth], b[0:LANES, 0:depth])
            T.writes(c[0:LANES])
            for i in T.serial(0, LANES):
                for k in T.serial(0, depth):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        c[vi] = c[vi] + product(a[vk], b[vi, vk])

    @T.prim_func(s_tir=True)
    def impl(a: T.Buffer((depth,), a_dtype, offset_factor=1), b: T.Buffer((LANES, depth), b_dtype, offset_factor=1),
             c: T.Buffer((LANES,), sum_dtype, offset_factor=1, scope="local")) -> None:
        with T.sblock("root"):
            T.reads(c[0:LANES], a[0:depth], b[0:LANES, 0:depth])
            T.writes(c[0:LANES])
            word = T.reinterpret(a.vload([0], a_word), dtype="int32")
            c[T.ramp(T.int32(0), 1, LANES)] = instruction(c.vload([0], dtype=sums), T.broadcast(word, LANES),
                                                          b.vload([0, 0], dtype=panel))

    return desc, impl


@dataclass(frozen=True)
class RegisterDot:
    """A dot-product instruction as a registered tensor intrinsic: its name (16 lanes, each +=
    ``depth_block`` products), the most column blocks a tile of ``MAX_TILE_ROWS`` takes, and
    LLVM IR its implementation calls (None: none), linked into the kernel's module
    (``kernels/avx512_bf16.py``)."""

    intrin: str
    depth_block: int
    max_column_blocks: int = 4
    import_llvm: str | None = None


def register_tiles(kernel: OneReduction, dot: RegisterDot, operand_per_row_tile: bool = False
                   ) -> s_tir.Schedule | None:
    """The sum as register tiles of ``dot``, the epilogue per tile where it can follow one; with
    ``operand_per_row_tile`` the prologue block that writes the A operand (a conv's patch rows)
    computed per tile of rows (``int8_sum.operand_block``)."""
    *batch, m, n, _ = kernel.stmt.iter_vars
    operand = None
    if operand_per_row_tile:  # a conv's: static shapes
        rows = extent_of(m.dom.extent)
        tile_rows, _ = tile_shape(rows, extent_of(n.dom.extent) // COLUMN_BLOCK, conv=True,
                                  max_column_blocks=dot.max_column_blocks)
        operand = operand_block(kernel, rows // tile_rows * prod(extent_of(iv.dom.extent) for iv in batch))
    # A symbolic row count keeps its tiles parallel: serial_when_small's serial copy would
    # define the tensorized blocks' match_buffer offsets twice (ill-formed TIR).
    parallel = not is_small_static_sum(kernel.stmt)
    place_prologue(kernel.sch, kernel, parallel)
    return with_epilogue_per_tile(kernel.sch, lambda sch, epilogue_per_tile: _schedule(
        sch, kernel.block, dot, kernel.epilogue, epilogue_per_tile, operand_per_row_tile, operand, parallel))


def tile_shape(rows, column_blocks: int, conv: bool, max_column_blocks: int = 4) -> tuple[int, int]:
    """(rows, column blocks) of a register tile: divisors of the sum's, up to ``MAX_TILE_ROWS``
    x ``max_column_blocks`` (``RegisterDot``'s); a ``conv``'s rows up to ``MAX_CONV_TILE_ROWS``
    where that leaves fewer than ``MAX_TILE_ROWS`` (one row for a symbolic count)."""
    if not isinstance(rows, int):
        return 1, largest_divisor(column_blocks, max_column_blocks)
    tile_rows = largest_divisor(rows, MAX_TILE_ROWS)
    if conv and tile_rows < MAX_TILE_ROWS:
        tile_rows = largest_divisor(rows, MAX_CONV_TILE_ROWS)
    blocks = largest_divisor(column_blocks, min(max_column_blocks, MAX_TILE_ACCUMULATORS // tile_rows))
    return tile_rows, blocks


def _schedule(sch: s_tir.Schedule, block, dot: RegisterDot, epilogue: list, per_tile: bool, conv: bool = False,
              operand=None, parallel: bool = True) -> None:
    """Register tiles of ``dot`` (``tile_shape``'s, a ``conv``'s), across cores where
    ``parallel``; the epilogue computed per tile, or (``per_tile`` False) after the whole sum;
    the ``operand`` block (None: left as it is) computed per tile of rows, the column tiles under it."""
    *batch, m, n, k = sch.get_loops(block)  # rows tiled per batch item: a fused row index would
    # reach the tensorized block through a division, which blockize cannot take
    rows, columns = extent_of(sch.get(m).extent), extent_of(sch.get(n).extent)
    tile_rows, blocks = tile_shape(rows, columns // COLUMN_BLOCK, conv, dot.max_column_blocks)
    m_outer, m_inner = sch.split(m, [None, tile_rows])
    n_outer, n_block, n_lane = sch.split(n, [None, blocks, COLUMN_BLOCK])
    k_outer, k_inner = sch.split(k, [None, dot.depth_block])
    weight = sch.get(block).reads[1].source
    weight_bytes = columns * extent_of(sch.get(block).iter_vars[-1].dom.extent) * weight.dtype.bits // 8
    columns_outer = operand is None and weight_bytes > COLUMNS_OUTER_WEIGHT_BYTES
    outer = (n_outer, m_outer) if columns_outer else (m_outer, n_outer)
    sch.reorder(*outer, k_outer, m_inner, n_block, n_lane, k_inner)
    write_back_tiles(sch, block, batch, outer, epilogue, per_tile, operand, parallel)
    init = sch.decompose_reduction(block, k_outer)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.unroll(m_inner)
    sch.unroll(n_block)
    sch.tensorize(n_lane, dot.intrin)
    if dot.import_llvm is not None:
        sch.annotate(k_outer, IMPORT_ANNOTATION, dot.import_llvm)

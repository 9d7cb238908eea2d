"""AMX tile kernels for the packed-weight matmuls: shared by ``Int8MatmulAmx`` (``tdpbusd``,
uint8 x int8 -> int32) and ``Bf16MatmulAmx`` (``tdpbf16ps``, bf16 x bf16 -> float32).

An AMX tile is up to 16 rows of 64 bytes. One product instruction adds, to each 4-byte
accumulator of a 16 x 16 C tile, the products of 16 groups of ``depth_block`` consecutive k
(4 int8, 2 bf16): A holds 16 rows x 64 bytes of the activation (row-major, as it is in
memory), B 16 groups x 16 columns, which is the kernel's packed weight ``[N/16, K/d, 16, d]``
as it is (``W[j, 16q:16q+16]`` is 16 rows of 64 contiguous bytes).

Each output tile of ``rows x 16*blocks`` (``blocks`` C tiles side by side, sharing each A tile)
is one call of a tensor intrinsic that covers the whole of K: it configures the tiles
(``ldtilecfg``; rows below 16 and a K that does not fill the last tile are shapes of the
configuration, no padding), zeroes the C tiles, runs the K loop and stores them into a local
accumulator; the epilogue then runs on the tile. The intrinsic is registered per (rows,
blocks, K): all three are shapes in its configuration.

Linux hands a process the AMX state only on request (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``, one permission for every AMX product), else the first tile instruction
kills it (SIGILL): an exported library requests it when loaded (``targets/amx_permission.cc``),
and ``schedule_tiles`` requests it for the compiling process (``targets.amx.request_amx_permission``).

Rows are tiled by the largest divisor of M up to 16; where M is past 16 and that is below
``MIN_TILE_ROWS`` (a prime M such as 197) the sum is computed as copies (``loop_partition``):
tiles of 16 rows, then one tile of the rest, the epilogue after the whole sum.
``schedule_tiles`` declines for a symbolic row count, below the product's ``min_rows`` (int8:
``MIN_TILE_ROWS``, as a tile costs more than it computes against ``vpdpbusd`` there; bf16: 1,
as it has no register kernel), and for a batched sum with such a prime M (TVM's blockize binds
the batch loop outside the copies as 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tvm import s_tir, tirx
from tvm.script import tirx as T

from ...frontend.packed_weights import COLUMN_BLOCK
from ...kernels.blocks import OneReduction
from ...targets.amx import request_amx_permission
from .amx_copies import normalized_copies
from .helpers import extent_of, largest_divisor
from .int8_sum import place_prologue, write_back_tiles

TILE_ROWS, TILE_BYTES = 16, 64  # an AMX tile: 16 rows of 64 bytes; a C tile row is one COLUMN_BLOCK
# C tiles side by side per call (of the 8 tile registers: C tiles, A, B, and A, B for K's tail).
MAX_BLOCKS = 4
# Rows of a tile at least past 16 rows (a divisor of M, else tiles of 16 and a tail); the int8
# tiles' min_rows: below it the VNNI kernel was the faster one (a tile's configuration and loads
# cost more than a few rows gain).
MIN_TILE_ROWS = 5
# A weight larger than this is swept once per tile of columns, all rows under it, instead of
# once per tile of rows: it no longer stays in L2 between row tiles.
COLUMNS_OUTER_WEIGHT_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class TileProduct:
    """One AMX product instruction as the kernel's sum reads it: ``c += product(a, b)`` over
    ``depth_block`` consecutive k per 4-byte group, operands of ``operand_dtypes``."""

    name: str  # in the registered intrinsics' names
    instruction: str  # the LLVM intrinsic: llvm.x86.tdpbusd, llvm.x86.tdpbf16ps
    operand_dtypes: tuple[str, str]
    accumulator_dtype: str
    depth_block: int
    product: Callable  # (a element, b element) -> the accumulated term, as the kernel writes it
    min_rows: int  # rows below which the tiles do not pay against the ISA's register kernel

    @property
    def depth_per_tile(self) -> int:
        """k per full A tile row (64 bytes)."""
        return TILE_ROWS * self.depth_block

    @property
    def operand_bytes(self) -> int:
        return 4 // self.depth_block


def tile_config(spec: TileProduct, rows: int, blocks: int, depth: int) -> list[int]:
    """``ldtilecfg``'s 64 bytes as 8 little-endian uint64 words: palette 1; tiles 0..blocks-1 the
    accumulators (rows x 16 of 4 bytes), 4 and 5 a full A and B, 6 and 7 K's tail."""
    tail = depth % spec.depth_per_tile
    config = bytearray(64)
    config[0] = 1
    shapes = {j: (rows, TILE_BYTES) for j in range(blocks)}
    shapes[4], shapes[5] = (rows, TILE_BYTES), (TILE_ROWS, TILE_BYTES)
    if tail:
        shapes[6], shapes[7] = (rows, tail * spec.operand_bytes), (tail // spec.depth_block, TILE_BYTES)
    for tile, (tile_rows, colsb) in shapes.items():
        config[16 + 2 * tile:18 + 2 * tile] = colsb.to_bytes(2, "little")
        config[48 + tile] = tile_rows
    return [int.from_bytes(config[8 * i:8 * i + 8], "little") for i in range(8)]


@T.macro
def _tile_zero(tile: int):
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilezero", T.int8(tile)))


@T.macro
def _tile_load(tile: int, address, stride):
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(tile), address, stride))


@T.macro
def _tile_store(tile: int, address, stride):
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.int8(tile), address, stride))


@T.macro
def _tile_product(instruction: str, b, c_tile: int, a_tile: int, b_tile: int, k_group):
    """C tile ``c_tile`` += A tile x column block ``c_tile`` of the weight from k group ``k_group``."""
    _tile_load(b_tile, T.address_of(b[c_tile, k_group, 0, 0]), T.int64(TILE_BYTES))
    T.evaluate(T.call_llvm_intrin("void", instruction, T.int8(c_tile), T.int8(a_tile), T.int8(b_tile)))


def _amx_intrin(spec: TileProduct, rows: int, blocks: int, depth: int, scope: str):
    """Description: ``c[i, j] += product(a[i, k], b[j/16, k/d, j%16, k%d])`` over all of K, for
    an accumulator of ``rows x 16*blocks`` in a buffer of ``scope`` (one row: ``c[0, j]``, the
    form a unit row loop leaves); implementation:
    ``ldtilecfg``, the C tiles zeroed (the init before it is a no-op: ``_zeroed_by_the_product``),
    the K loop, the C tiles stored, ``tilerelease``. Tile ids are immediates, so the column
    blocks are spelled out (``blocks > j`` is read when parsed). Several row tiles per call, one
    ``ldtilecfg`` for them, ran slower at 128 x 256 x 1024: the larger accumulator left L1."""
    columns, block = blocks * COLUMN_BLOCK, spec.depth_block
    full, tail = divmod(depth, spec.depth_per_tile)
    a_dtype, b_dtype = spec.operand_dtypes
    c_dtype, product, instruction = spec.accumulator_dtype, spec.product, spec.instruction
    a_stride = T.int64(depth * spec.operand_bytes)
    words = tile_config(spec, rows, blocks, depth)

    @T.prim_func(s_tir=True)
    def desc(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        c_stride = T.int32()
        a = T.match_buffer(a_handle, (rows, depth), a_dtype, offset_factor=1)
        b = T.match_buffer(b_handle, (blocks, depth // block, COLUMN_BLOCK, block), b_dtype, offset_factor=1)
        c = T.match_buffer(c_handle, (rows, columns), c_dtype, offset_factor=1, strides=[c_stride, 1], scope=scope)
        with T.sblock("root"):
            T.reads(c[0:rows, 0:columns], a[0:rows, 0:depth], b[0:blocks, 0:depth // block, 0:COLUMN_BLOCK, 0:block])
            T.writes(c[0:rows, 0:columns])
            for i, j, k in T.grid(rows, columns, depth):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    c[vi, vj] = c[vi, vj] + product(
                        a[vi, vk], b[vj // COLUMN_BLOCK, vk // block, vj % COLUMN_BLOCK, vk % block])

    @T.prim_func(s_tir=True)
    def one_row_desc(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        c_stride = T.int32()
        a = T.match_buffer(a_handle, (rows, depth), a_dtype, offset_factor=1)
        b = T.match_buffer(b_handle, (blocks, depth // block, COLUMN_BLOCK, block), b_dtype, offset_factor=1)
        c = T.match_buffer(c_handle, (rows, columns), c_dtype, offset_factor=1, strides=[c_stride, 1], scope=scope)
        with T.sblock("root"):
            T.reads(c[0:rows, 0:columns], a[0:rows, 0:depth], b[0:blocks, 0:depth // block, 0:COLUMN_BLOCK, 0:block])
            T.writes(c[0:rows, 0:columns])
            for j, k in T.grid(columns, depth):
                with T.sblock("update"):
                    vj, vk = T.axis.remap("SR", [j, k])
                    c[0, vj] = c[0, vj] + product(
                        a[0, vk], b[vj // COLUMN_BLOCK, vk // block, vj % COLUMN_BLOCK, vk % block])

    @T.prim_func(s_tir=True)
    def impl(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        c_stride = T.int32()
        a = T.match_buffer(a_handle, (rows, depth), a_dtype, offset_factor=1)
        b = T.match_buffer(b_handle, (blocks, depth // block, COLUMN_BLOCK, block), b_dtype, offset_factor=1)
        c = T.match_buffer(c_handle, (rows, columns), c_dtype, offset_factor=1, strides=[c_stride, 1], scope=scope)
        with T.sblock("root"):
            T.reads(c[0:rows, 0:columns], a[0:rows, 0:depth], b[0:blocks, 0:depth // block, 0:COLUMN_BLOCK, 0:block])
            T.writes(c[0:rows, 0:columns])
            # On the stack: a local buffer in a parallel loop's body is a workspace allocation per call
            config = T.decl_buffer((8,), "int64", data=T.tvm_stack_alloca("shape", 8))
            config[0] = T.int64(words[0])
            config[1] = T.int64(words[1])
            config[2] = T.int64(words[2])
            config[3] = T.int64(words[3])
            config[4] = T.int64(words[4])
            config[5] = T.int64(words[5])
            config[6] = T.int64(words[6])
            config[7] = T.int64(words[7])
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(config[0])))
            _tile_zero(0)
            if blocks > 1:
                _tile_zero(1)
            if blocks > 2:
                _tile_zero(2)
            if blocks > 3:
                _tile_zero(3)
            for q in range(full):  # tiles 4 (A) and 5 (B): one full tile of k
                _tile_load(4, T.address_of(a[0, q * spec.depth_per_tile]), a_stride)
                _tile_product(instruction, b, 0, 4, 5, q * TILE_ROWS)
                if blocks > 1:
                    _tile_product(instruction, b, 1, 4, 5, q * TILE_ROWS)
                if blocks > 2:
                    _tile_product(instruction, b, 2, 4, 5, q * TILE_ROWS)
                if blocks > 3:
                    _tile_product(instruction, b, 3, 4, 5, q * TILE_ROWS)
            if tail > 0:  # tiles 6 (A) and 7 (B): the last k
                _tile_load(6, T.address_of(a[0, full * spec.depth_per_tile]), a_stride)
                _tile_product(instruction, b, 0, 6, 7, full * TILE_ROWS)
                if blocks > 1:
                    _tile_product(instruction, b, 1, 6, 7, full * TILE_ROWS)
                if blocks > 2:
                    _tile_product(instruction, b, 2, 6, 7, full * TILE_ROWS)
                if blocks > 3:
                    _tile_product(instruction, b, 3, 6, 7, full * TILE_ROWS)
            _tile_store(0, T.address_of(c[0, 0]), T.Cast("int64", c_stride * 4))
            if blocks > 1:
                _tile_store(1, T.address_of(c[0, COLUMN_BLOCK]), T.Cast("int64", c_stride * 4))
            if blocks > 2:
                _tile_store(2, T.address_of(c[0, 2 * COLUMN_BLOCK]), T.Cast("int64", c_stride * 4))
            if blocks > 3:
                _tile_store(3, T.address_of(c[0, 3 * COLUMN_BLOCK]), T.Cast("int64", c_stride * 4))
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    return (one_row_desc if rows == 1 else desc), impl


def _zeroed_by_the_product(dtype: str, rows: int, columns: int, scope: str):
    """Description: the accumulator's init, ``c[i, j] = 0`` (one row: ``c[0, j]``, the form a
    unit row loop leaves); implementation: nothing, as the AMX
    intrinsic, which always follows it (the rule tensorizes the init and the product together),
    starts from zeroed C tiles (``tilezero``) instead of loading ``c``: no pass that writes
    zeros to memory for the tiles to load them again."""

    zero = tirx.const(0, dtype)

    @T.prim_func(s_tir=True)
    def desc(c_handle: T.handle) -> None:
        c_stride = T.int32()
        c = T.match_buffer(c_handle, (rows, columns), dtype, offset_factor=1, strides=[c_stride, 1], scope=scope)
        with T.sblock("root"):
            T.reads()
            T.writes(c[0:rows, 0:columns])
            for i, j in T.grid(rows, columns):
                with T.sblock("init"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    c[vi, vj] = zero

    @T.prim_func(s_tir=True)
    def one_row_desc(c_handle: T.handle) -> None:
        c_stride = T.int32()
        c = T.match_buffer(c_handle, (rows, columns), dtype, offset_factor=1, strides=[c_stride, 1], scope=scope)
        with T.sblock("root"):
            T.reads()
            T.writes(c[0:rows, 0:columns])
            for j in range(columns):
                with T.sblock("init"):
                    vj = T.axis.spatial(columns, j)
                    c[0, vj] = zero

    @T.prim_func(s_tir=True)
    def impl(c_handle: T.handle) -> None:
        c_stride = T.int32()
        c = T.match_buffer(c_handle, (rows, columns), dtype, offset_factor=1, strides=[c_stride, 1], scope=scope)
        with T.sblock("root"):
            T.reads()
            T.writes(c[0:rows, 0:columns])
            T.evaluate(0)

    return (one_row_desc if rows == 1 else desc), impl


def register_amx_intrins(spec: TileProduct, rows: int, blocks: int, depth: int,
                         scope: str = "local") -> tuple[str, str]:
    """(the init's, the product's) tensor intrinsics for a tile's shapes and its accumulator's
    scope (a local tile, or the whole sum in memory), registered."""
    name = f"tvm_fusion_amx_{spec.name}_{rows}x{blocks * COLUMN_BLOCK}x{depth}_{scope}"
    s_tir.TensorIntrin.register(name, *_amx_intrin(spec, rows, blocks, depth, scope), override=True)
    s_tir.TensorIntrin.register(
        f"{name}_init", *_zeroed_by_the_product(spec.accumulator_dtype, rows, blocks * COLUMN_BLOCK, scope),
        override=True)
    return f"{name}_init", name


def schedule_tiles(kernel: OneReduction, spec: TileProduct) -> s_tir.Schedule | None:
    """``kernel`` (a packed-weight sum of ``spec``'s form) as AMX tiles, its element-wise
    epilogue per tile where it can follow one; None where tiles do not pay or cannot be formed."""
    *batch, m, _, _ = kernel.stmt.iter_vars
    rows = extent_of(m.dom.extent)
    if not isinstance(rows, int) or rows < spec.min_rows:
        return None
    tile_rows = largest_divisor(rows, TILE_ROWS)
    partitioned = tile_rows < MIN_TILE_ROWS and rows > TILE_ROWS
    if partitioned and batch:
        return None  # blockize binds a batch loop outside loop_partition's copies as 0: wrong sums
    sch = kernel.sch
    place_prologue(sch, kernel)
    if partitioned:  # 197 rows: 12 tiles of 16, one of 5
        try:
            scheduled = _schedule_with_row_tail(sch, kernel.block, kernel.epilogue, spec)
        except s_tir.ScheduleError:
            return None
        request_amx_permission()
        return scheduled
    for per_tile in (True, False):
        attempt = sch.copy()
        try:
            _schedule(attempt, kernel.block, kernel.epilogue, tile_rows, per_tile, spec)
        except s_tir.ScheduleError:
            continue  # an epilogue that cannot follow the tile (one that reads across tiles)
        request_amx_permission()  # this process may run the kernel (compile's verification)
        return attempt
    return None


def _columns_outer(spec: TileProduct, columns: int, depth: int) -> bool:
    return columns * depth * spec.operand_bytes > COLUMNS_OUTER_WEIGHT_BYTES


def _schedule(sch: s_tir.Schedule, block, epilogue: list, tile_rows: int, per_tile: bool, spec: TileProduct) -> None:
    """One AMX call per output tile of ``tile_rows`` (a divisor of M) x up to 64 columns; the
    epilogue computed per tile, or (``per_tile`` False) after the whole sum, across cores."""
    *batch, m, n, k = sch.get_loops(block)
    columns, depth = extent_of(sch.get(n).extent), extent_of(sch.get(k).extent)
    blocks = largest_divisor(columns // COLUMN_BLOCK, MAX_BLOCKS)
    m_outer, m_inner = sch.split(m, [None, tile_rows])
    n_outer, n_inner = sch.split(n, [None, blocks * COLUMN_BLOCK])
    outer = (n_outer, m_outer) if _columns_outer(spec, columns, depth) else (m_outer, n_outer)
    sch.reorder(*outer, m_inner, n_inner, k)
    write_back_tiles(sch, block, batch, outer, epilogue, per_tile)
    init = sch.decompose_reduction(block, m_inner)
    init_intrin, intrin = register_amx_intrins(spec, tile_rows, blocks, depth)
    if tile_rows == 1:  # a unit row loop leaves no row axis in the blocks: the tile starts at the columns
        sch.tensorize(sch.get_loops(init)[-1], init_intrin)
        sch.tensorize(n_inner, intrin)
    else:
        sch.tensorize(sch.get_loops(init)[-2], init_intrin)
        sch.tensorize(m_inner, intrin)


def row_partitions(rows: int) -> list[tuple[int, int]]:
    """(rows, tile rows) of each copy of the sum: tiles of 16, then one tile of the rest; a
    rest of 1 row (which blockize does not take as a tile) joins the last 16 as tiles of 8 and 9."""
    tail = rows % TILE_ROWS
    if tail != 1:
        return [(rows - tail, TILE_ROWS), (tail, tail)]
    return ([(rows - 17, TILE_ROWS)] if rows > 17 else []) + [(8, 8), (9, 9)]


def _schedule_with_row_tail(sch: s_tir.Schedule, block, epilogue: list, spec: TileProduct) -> s_tir.Schedule:
    """M with no divisor that fills a tile (a prime M past 16): the sum as copies
    (``loop_partition``, ``row_partitions``), tiles of 16 rows over the first ``M - M % 16``
    rows and one tile of the rest, written whole into memory; then the epilogue in one pass
    over it, across cores. (The per-tile epilogue of ``_schedule`` would need one tile loop
    for all copies.)"""
    *_, m, n, k = sch.get_loops(block)
    rows, columns, depth = (extent_of(sch.get(loop).extent) for loop in (m, n, k))
    blocks = largest_divisor(columns // COLUMN_BLOCK, MAX_BLOCKS)
    partitions = row_partitions(rows)
    epilogue_names = [sch.get(block_rv).name_hint for block_rv in epilogue]
    parts = sch.loop_partition(m, [extent for extent, _ in partitions[:-1]] + [None])
    copies = [sch.get(sch.get_child_blocks(part)[0]).name_hint for part in parts]
    sch = s_tir.Schedule(normalized_copies(sch.mod["main"], copies))
    for name, (extent, tile_rows) in zip(copies, partitions):
        copy = sch.get_sblock(name)
        m_part, n_part, k_part = sch.get_loops(copy)[-3:]
        n_outer, n_inner = sch.split(n_part, [None, blocks * COLUMN_BLOCK])
        if extent > tile_rows:
            m_outer, m_inner = sch.split(m_part, [None, tile_rows])
            outer = (n_outer, m_outer) if _columns_outer(spec, columns, depth) else (m_outer, n_outer)
            sch.reorder(*outer, m_inner, n_inner, k_part)
            sch.parallel(sch.fuse(*outer))
        else:  # one tile
            m_inner = m_part
            sch.reorder(n_outer, m_inner, n_inner, k_part)
            sch.parallel(n_outer)
        init = sch.decompose_reduction(copy, m_inner)
        init_intrin, intrin = register_amx_intrins(spec, tile_rows, blocks, depth, "global")
        sch.tensorize(sch.get_loops(init)[-2], init_intrin)
        sch.tensorize(m_inner, intrin)
    if epilogue_names:  # all but the last epilogue block inlined into the last
        *inlined, output = [sch.get_sblock(name) for name in epilogue_names]
        for block_rv in inlined:
            sch.compute_inline(block_rv)
        *outer, inner = sch.get_loops(output)
        if outer:
            sch.parallel(sch.fuse(*outer))
        sch.vectorize(inner)
    return sch

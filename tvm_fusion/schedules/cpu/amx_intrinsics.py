"""The AMX tensor intrinsics the packed-weight sums are tensorized with (``amx_tiles.py``
schedules them): one call computes an output tile over the whole of K.

Three shapes of call. 1 x 4: one A tile of up to 16 rows meets up to 4 column blocks (C tiles
side by side), with tiles 6 and 7 for a K tail (or, without one, as more B tiles). 2 x 2: two A
tiles meet two column blocks, each tile loaded serving two products. R x 1 (R up to 4): R A
tiles meet the one column block of a narrow sum, each B tile loaded serving R products. The C tiles start at zero
(``tilezero``) and are stored once at the end; ``ldtilecfg`` sets the calls' shapes (rows below
16 and a K tail are shapes of the configuration, no padding), once for all the calls of a kernel
that one thread runs (``_configure``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tvm import s_tir, tirx
from tvm.script import tirx as T

from ...frontend.packed_weights import COLUMN_BLOCK

TILE_ROWS, TILE_BYTES = 16, 64  # an AMX tile: 16 rows of 64 bytes; a C tile row is one COLUMN_BLOCK


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
    """``ldtilecfg``'s words for a 1 x 4 call: tiles 0..blocks-1 the accumulators (rows x 16 of 4
    bytes), 4 and 5 a full A and B, 6 and 7 K's tail (without one, more B tiles: ``_one_by_four_impl``)."""
    tail = depth % spec.depth_per_tile
    shapes = {j: (rows, TILE_BYTES) for j in range(blocks)}
    shapes[4], shapes[5] = (rows, TILE_BYTES), (TILE_ROWS, TILE_BYTES)
    if tail:
        shapes[6], shapes[7] = (rows, tail * spec.operand_bytes), (tail // spec.depth_block, TILE_BYTES)
    else:
        shapes[6] = shapes[7] = (TILE_ROWS, TILE_BYTES)
    return _config_words(shapes)


def square_config(rows: int) -> list[int]:
    """``ldtilecfg``'s words for a 2 x 2 call: tiles 0..3 the accumulators (``rows`` each), 4 and
    5 the two A tiles, 6 and 7 the two B tiles."""
    shapes = {j: (rows, TILE_BYTES) for j in range(6)}
    shapes[6] = shapes[7] = (TILE_ROWS, TILE_BYTES)
    return _config_words(shapes)


def tall_config(rows: int, row_tiles: int) -> list[int]:
    """``ldtilecfg``'s words for an R x 1 call: tiles 0..R-1 the accumulators (``rows`` each), 4
    and 5 the A tiles (taken in turn), 6 and 7 the B tiles (one per k step, in turn)."""
    shapes = {j: (rows, TILE_BYTES) for j in (*range(row_tiles), 4, 5)}
    shapes[6] = shapes[7] = (TILE_ROWS, TILE_BYTES)
    return _config_words(shapes)


def _config_words(shapes: dict[int, tuple[int, int]]) -> list[int]:
    """``ldtilecfg``'s 64 bytes, palette 1 and each tile's (rows, bytes per row), as 8
    little-endian uint64 words."""
    config = bytearray(64)
    config[0] = 1
    for tile, (tile_rows, colsb) in shapes.items():
        config[16 + 2 * tile:18 + 2 * tile] = colsb.to_bytes(2, "little")
        config[48 + tile] = tile_rows
    return [int.from_bytes(config[8 * i:8 * i + 8], "little") for i in range(8)]


@T.macro
def _configure(words):
    """``ldtilecfg`` of ``words`` unless the tiles hold that configuration already (``sttilecfg``
    reads it: another call's of the same shapes, else another kernel's, another library's, or none).
    ``ldtilecfg`` costs as much as a small call's products, and the calls of a kernel share one
    shape, so a call leaves its tiles configured (no ``tilerelease``) for the next. Both buffers
    are on the stack: a local buffer in a parallel loop's body is a workspace allocation per call."""
    config = T.decl_buffer((8,), "int64", data=T.tvm_stack_alloca("shape", 8))
    current = T.decl_buffer((8,), "int64", data=T.tvm_stack_alloca("shape", 8))
    config[0] = T.int64(words[0])
    config[1] = T.int64(words[1])
    config[2] = T.int64(words[2])
    config[3] = T.int64(words[3])
    config[4] = T.int64(words[4])
    config[5] = T.int64(words[5])
    config[6] = T.int64(words[6])
    config[7] = T.int64(words[7])
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.sttilecfg", T.address_of(current[0])))
    if (current[0] != config[0] or current[1] != config[1] or current[2] != config[2] or current[3] != config[3]
            or current[4] != config[4] or current[5] != config[5] or current[6] != config[6]
            or current[7] != config[7]):
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(config[0])))


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


def _description(spec: TileProduct, rows: int, blocks: int, depth: int, scope: str):
    """What a call computes: ``c[i, j] += product(a[i, k], b[j/16, k/d, j%16, k%d])`` over all of
    K, for an accumulator of ``rows x 16*blocks`` in a buffer of ``scope`` (one row: ``c[0, j]``,
    the form a unit row loop leaves; ``rows == 1`` is read when parsed)."""
    columns, block = blocks * COLUMN_BLOCK, spec.depth_block
    a_dtype, b_dtype = spec.operand_dtypes
    c_dtype, product = spec.accumulator_dtype, spec.product

    @T.prim_func(s_tir=True)
    def desc(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        c_stride = T.int32()
        a = T.match_buffer(a_handle, (rows, depth), a_dtype, offset_factor=1)
        b = T.match_buffer(b_handle, (blocks, depth // block, COLUMN_BLOCK, block), b_dtype, offset_factor=1)
        c = T.match_buffer(c_handle, (rows, columns), c_dtype, offset_factor=1, strides=[c_stride, 1], scope=scope)
        with T.sblock("root"):
            T.reads(c[0:rows, 0:columns], a[0:rows, 0:depth], b[0:blocks, 0:depth // block, 0:COLUMN_BLOCK, 0:block])
            T.writes(c[0:rows, 0:columns])
            if rows == 1:
                for j, k in T.grid(columns, depth):
                    with T.sblock("update"):
                        vj, vk = T.axis.remap("SR", [j, k])
                        c[0, vj] = c[0, vj] + product(
                            a[0, vk], b[vj // COLUMN_BLOCK, vk // block, vj % COLUMN_BLOCK, vk % block])
            else:
                for i, j, k in T.grid(rows, columns, depth):
                    with T.sblock("update"):
                        vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                        c[vi, vj] = c[vi, vj] + product(
                            a[vi, vk], b[vj // COLUMN_BLOCK, vk // block, vj % COLUMN_BLOCK, vk % block])

    return desc


def _one_by_four_impl(spec: TileProduct, rows: int, blocks: int, depth: int, scope: str):
    """A 1 x 4 call: the tiles configured (``_configure``), the C tiles zeroed (the init before
    it is a no-op: ``_zeroed_by_the_product``), the K loop, the C tiles stored. Tile ids are
    immediates, so the column blocks are spelled out (``blocks > j`` is read when parsed).
    Several row tiles per call, one ``ldtilecfg`` for them, ran slower at 128 x 256 x 1024: the
    larger accumulator left L1."""
    columns, block = blocks * COLUMN_BLOCK, spec.depth_block
    full, tail = divmod(depth, spec.depth_per_tile)
    a_dtype, b_dtype = spec.operand_dtypes
    c_dtype, instruction = spec.accumulator_dtype, spec.instruction
    a_stride = T.int64(depth * spec.operand_bytes)
    words = tile_config(spec, rows, blocks, depth)
    # Without a K tail, tiles 6 and 7 hold B too: the next column block's B loads while the last
    # product still reads its own (one B tile would make each load wait for the product before).
    second_b, third_b = (5, 5) if tail else (6, 7)

    @T.prim_func(s_tir=True)
    def impl(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        c_stride = T.int32()
        a = T.match_buffer(a_handle, (rows, depth), a_dtype, offset_factor=1)
        b = T.match_buffer(b_handle, (blocks, depth // block, COLUMN_BLOCK, block), b_dtype, offset_factor=1)
        c = T.match_buffer(c_handle, (rows, columns), c_dtype, offset_factor=1, strides=[c_stride, 1], scope=scope)
        with T.sblock("root"):
            T.reads(c[0:rows, 0:columns], a[0:rows, 0:depth], b[0:blocks, 0:depth // block, 0:COLUMN_BLOCK, 0:block])
            T.writes(c[0:rows, 0:columns])
            _configure(words)
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
                    _tile_product(instruction, b, 1, 4, second_b, q * TILE_ROWS)
                if blocks > 2:
                    _tile_product(instruction, b, 2, 4, third_b, q * TILE_ROWS)
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

    return impl


def _square_impl(spec: TileProduct, rows: int, depth: int, scope: str):
    """A 2 x 2 call (``rows`` = 2 row tiles of ``rows / 2``, 32 columns): each A tile meets both
    B tiles and each B tile both A tiles, so a column block's weight, read from L2, serves twice
    the rows a 1 x 4 call's does (the weight's L2 traffic is what bounds a call). Needs K in whole
    tiles (``depth_per_tile``): its 8 tile registers leave none for a K tail."""
    half, full = rows // 2, depth // spec.depth_per_tile
    a_dtype, b_dtype = spec.operand_dtypes
    c_dtype, instruction, block = spec.accumulator_dtype, spec.instruction, spec.depth_block
    a_stride = T.int64(depth * spec.operand_bytes)
    words = square_config(half)

    @T.prim_func(s_tir=True)
    def impl(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        c_stride = T.int32()
        a = T.match_buffer(a_handle, (rows, depth), a_dtype, offset_factor=1)
        b = T.match_buffer(b_handle, (2, depth // block, COLUMN_BLOCK, block), b_dtype, offset_factor=1)
        c = T.match_buffer(c_handle, (rows, 2 * COLUMN_BLOCK), c_dtype, offset_factor=1, strides=[c_stride, 1],
                           scope=scope)
        with T.sblock("root"):
            T.reads(c[0:rows, 0:2 * COLUMN_BLOCK], a[0:rows, 0:depth], b[0:2, 0:depth // block, 0:COLUMN_BLOCK, 0:block])
            T.writes(c[0:rows, 0:2 * COLUMN_BLOCK])
            _configure(words)
            _tile_zero(0)
            _tile_zero(1)
            _tile_zero(2)
            _tile_zero(3)
            for q in range(full):
                _tile_load(4, T.address_of(a[0, q * spec.depth_per_tile]), a_stride)
                _tile_load(5, T.address_of(a[half, q * spec.depth_per_tile]), a_stride)
                _tile_load(6, T.address_of(b[0, q * TILE_ROWS, 0, 0]), T.int64(TILE_BYTES))
                _tile_load(7, T.address_of(b[1, q * TILE_ROWS, 0, 0]), T.int64(TILE_BYTES))
                T.evaluate(T.call_llvm_intrin("void", instruction, T.int8(0), T.int8(4), T.int8(6)))
                T.evaluate(T.call_llvm_intrin("void", instruction, T.int8(1), T.int8(4), T.int8(7)))
                T.evaluate(T.call_llvm_intrin("void", instruction, T.int8(2), T.int8(5), T.int8(6)))
                T.evaluate(T.call_llvm_intrin("void", instruction, T.int8(3), T.int8(5), T.int8(7)))
            _tile_store(0, T.address_of(c[0, 0]), T.Cast("int64", c_stride * 4))
            _tile_store(1, T.address_of(c[0, COLUMN_BLOCK]), T.Cast("int64", c_stride * 4))
            _tile_store(2, T.address_of(c[half, 0]), T.Cast("int64", c_stride * 4))
            _tile_store(3, T.address_of(c[half, COLUMN_BLOCK]), T.Cast("int64", c_stride * 4))

    return impl


def _tall_impl(spec: TileProduct, rows: int, row_tiles: int, depth: int, scope: str):
    """An R x 1 call (``rows`` = R row tiles of ``rows / R``, one column block of 16): a narrow
    sum (8 or 16 output channels) has one B tile per k step, which a 1 x 1 call reloads with
    every A tile (two loads per product); here each B tile serves R products. The A tiles take
    tiles 4 and 5 in turn, the B tiles 6 and 7 (k steps in pairs), so a load need not wait for
    the product that reads the tile before. Needs K in whole tiles, as the 2 x 2 call does."""
    height, full = rows // row_tiles, depth // spec.depth_per_tile
    a_dtype, b_dtype = spec.operand_dtypes
    c_dtype, instruction, block = spec.accumulator_dtype, spec.instruction, spec.depth_block
    a_stride = T.int64(depth * spec.operand_bytes)
    words = tall_config(height, row_tiles)

    @T.macro
    def step(a, b, q, b_tile: int):
        """One k step: its B tile, then each row tile's A tile and product."""
        _tile_load(b_tile, T.address_of(b[0, q * TILE_ROWS, 0, 0]), T.int64(TILE_BYTES))
        _tile_load(4, T.address_of(a[0, q * spec.depth_per_tile]), a_stride)
        T.evaluate(T.call_llvm_intrin("void", instruction, T.int8(0), T.int8(4), T.int8(b_tile)))
        _tile_load(5, T.address_of(a[height, q * spec.depth_per_tile]), a_stride)
        T.evaluate(T.call_llvm_intrin("void", instruction, T.int8(1), T.int8(5), T.int8(b_tile)))
        if row_tiles > 2:
            _tile_load(4, T.address_of(a[2 * height, q * spec.depth_per_tile]), a_stride)
            T.evaluate(T.call_llvm_intrin("void", instruction, T.int8(2), T.int8(4), T.int8(b_tile)))
        if row_tiles > 3:
            _tile_load(5, T.address_of(a[3 * height, q * spec.depth_per_tile]), a_stride)
            T.evaluate(T.call_llvm_intrin("void", instruction, T.int8(3), T.int8(5), T.int8(b_tile)))

    @T.prim_func(s_tir=True)
    def impl(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        c_stride = T.int32()
        a = T.match_buffer(a_handle, (rows, depth), a_dtype, offset_factor=1)
        b = T.match_buffer(b_handle, (1, depth // block, COLUMN_BLOCK, block), b_dtype, offset_factor=1)
        c = T.match_buffer(c_handle, (rows, COLUMN_BLOCK), c_dtype, offset_factor=1, strides=[c_stride, 1],
                           scope=scope)
        with T.sblock("root"):
            T.reads(c[0:rows, 0:COLUMN_BLOCK], a[0:rows, 0:depth], b[0:1, 0:depth // block, 0:COLUMN_BLOCK, 0:block])
            T.writes(c[0:rows, 0:COLUMN_BLOCK])
            _configure(words)
            _tile_zero(0)
            _tile_zero(1)
            if row_tiles > 2:
                _tile_zero(2)
            if row_tiles > 3:
                _tile_zero(3)
            for pair in range(full // 2):
                step(a, b, 2 * pair, 6)
                step(a, b, 2 * pair + 1, 7)
            if full % 2 == 1:
                step(a, b, full - 1, 6)
            _tile_store(0, T.address_of(c[0, 0]), T.Cast("int64", c_stride * 4))
            _tile_store(1, T.address_of(c[height, 0]), T.Cast("int64", c_stride * 4))
            if row_tiles > 2:
                _tile_store(2, T.address_of(c[2 * height, 0]), T.Cast("int64", c_stride * 4))
            if row_tiles > 3:
                _tile_store(3, T.address_of(c[3 * height, 0]), T.Cast("int64", c_stride * 4))

    return impl


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
            if rows == 1:
                for j in range(columns):
                    with T.sblock("init"):
                        vj = T.axis.spatial(columns, j)
                        c[0, vj] = zero
            else:
                for i, j in T.grid(rows, columns):
                    with T.sblock("init"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        c[vi, vj] = zero

    @T.prim_func(s_tir=True)
    def impl(c_handle: T.handle) -> None:
        c_stride = T.int32()
        c = T.match_buffer(c_handle, (rows, columns), dtype, offset_factor=1, strides=[c_stride, 1], scope=scope)
        with T.sblock("root"):
            T.reads()
            T.writes(c[0:rows, 0:columns])
            T.evaluate(0)

    return desc, impl


def register_amx_intrins(spec: TileProduct, rows: int, blocks: int, depth: int,
                         scope: str = "local", square: bool = False, row_tiles: int = 1) -> tuple[str, str]:
    """(the init's, the product's) tensor intrinsics for a call's shapes and its accumulator's
    scope (a local tile, or the whole sum in memory), registered; ``square``: a 2 x 2 call of
    ``rows`` = two row tiles by ``blocks`` = 2 (``_square_impl``); ``row_tiles`` R past 1: an R x 1
    call of ``rows`` = R row tiles by one block (``_tall_impl``); else one row tile by ``blocks``."""
    shape = "2x2" if square else f"{row_tiles}x1" if row_tiles > 1 else "1x4"
    name = f"tvm_fusion_amx_{spec.name}_{shape}_{rows}x{blocks * COLUMN_BLOCK}x{depth}_{scope}"
    if square:
        impl = _square_impl(spec, rows, depth, scope)
    elif row_tiles > 1:
        impl = _tall_impl(spec, rows, row_tiles, depth, scope)
    else:
        impl = _one_by_four_impl(spec, rows, blocks, depth, scope)
    s_tir.TensorIntrin.register(name, _description(spec, rows, blocks, depth, scope), impl, override=True)
    s_tir.TensorIntrin.register(
        f"{name}_init", *_zeroed_by_the_product(spec.accumulator_dtype, rows, blocks * COLUMN_BLOCK, scope),
        override=True)
    return f"{name}_init", name

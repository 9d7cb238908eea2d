"""uint8 x int8 -> int32 matmul (``frontend/integer_matmul.py``) on AMX tiles (``tdpbusd``).

An AMX tile is up to 16 rows of 64 bytes. ``tdpbusd C, A, B`` adds, to each int32 of a 16 x 16
C tile, the 4 uint8 x int8 products of 16 groups of 4 consecutive k: A holds 16 rows x 64 k of
the activation (row-major, as it is in memory), B 16 groups of 4 k x 16 columns, which is the
kernel's packed weight ``[N/16, K/4, 16, 4]`` as it is (``W[j, 16q:16q+16]`` is 16 rows of 64
contiguous bytes). One ``tdpbusd`` is 16 x 16 x 64 exact products (no intermediate
saturation, as ``vpdpbusd``), 16 times the work of a ``vpdpbusd`` on AVX-512.

Each output tile of ``rows x 16*blocks`` int32 (``blocks`` C tiles side by side, sharing each
A tile) is one call of a tensor intrinsic that covers the whole of K: it configures the tiles
(``ldtilecfg``; rows below 16 and a K that is not a multiple of 64 are shapes of the
configuration, no padding), zeroes the C tiles, runs the K loop and stores them into a local
accumulator; the epilogue (zero-point corrections, the conversion, a requantization) then runs
on the tile, as in ``Int8MatmulVnni``. The intrinsic is registered per (rows, blocks, K): all
three are shapes in its configuration.

Linux hands a process the AMX state only on request (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``), else the first tile instruction kills it (SIGILL): an exported library
requests it when loaded (``targets/amx_permission.cc``, linked in by ``export_options``), and
this rule requests it for the compiling process (``targets.amx.request_amx_permission``).

Rows are tiled by the largest divisor of M up to 16; where that is below ``MIN_TILE_ROWS`` (a
prime M such as 197) the sum is computed as copies (``loop_partition``): tiles of 16 rows, then
one tile of the rest, the epilogue after the whole sum. Declines (and ``Int8MatmulVnni`` takes
the kernel) on a target without AMX-INT8, for a symbolic row count, below ``MIN_TILE_ROWS``
rows (M=1: a matrix-vector product, where a tile costs more than it computes), and for a
batched sum with a prime M (TVM's blockize binds the batch loop outside the copies as 0).
"""

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym import Analyzer
from tvm.s_tir.analysis import get_sblock_read_write_region
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.script import tirx as T
from tvm.target import Target

from ...frontend.integer_matmul import COLUMN_BLOCK, DEPTH_BLOCK
from ...kernels.blocks import is_cpu_kernel, is_static, only_reduction
from ...targets.amx import request_amx_permission
from ...kernels.cpu_features import has_amx_int8
from .helpers import extent_of, largest_divisor
from .int8_sum import is_int8_sum, place_prologue, write_back_tiles

TILE_ROWS, TILE_BYTES = 16, 64  # an AMX tile: 16 rows of 64 bytes
# C tiles side by side per call (of the 8 tile registers: C tiles, A, B, and A, B for K's tail).
MAX_BLOCKS = 4
# Off: the VNNI rule takes every int8 kernel, AMX or not (benchmarks compare the two).
AMX_TILES = True
# Rows of a tile at least (a divisor of M, else tiles of 16 and a tail): below it the VNNI
# kernel was the faster one (a tile's configuration and loads cost more than a few rows gain).
MIN_TILE_ROWS = 5
# A weight larger than this is swept once per tile of columns, all rows under it (as in
# Int8MatmulVnni), instead of once per tile of rows: it no longer stays in L2 between row tiles.
COLUMNS_OUTER_WEIGHT_BYTES = 1 << 20


def amx_intrin_name(rows: int, blocks: int, depth: int, scope: str) -> str:
    return f"tvm_fusion_amx_u8i8i32_{rows}x{blocks * COLUMN_BLOCK}x{depth}_{scope}"


def _tile_config(rows: int, blocks: int, depth: int) -> list[int]:
    """``ldtilecfg``'s 64 bytes as 8 little-endian uint64 words: palette 1; tiles 0..blocks-1 the
    accumulators (rows x 16 int32), 4 and 5 a full A and B (64 k), 6 and 7 K's tail."""
    tail = depth % TILE_BYTES
    config = bytearray(64)
    config[0] = 1
    shapes = {j: (rows, TILE_BYTES) for j in range(blocks)}
    shapes[4], shapes[5] = (rows, TILE_BYTES), (TILE_BYTES // DEPTH_BLOCK, TILE_BYTES)
    if tail:
        shapes[6], shapes[7] = (rows, tail), (tail // DEPTH_BLOCK, TILE_BYTES)
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
def _tile_product(b, c_tile: int, a_tile: int, b_tile: int, k_group):
    """C tile ``c_tile`` += A tile x column block ``c_tile`` of the weight from k group ``k_group``."""
    _tile_load(b_tile, T.address_of(b[c_tile, k_group, 0, 0]), T.int64(TILE_BYTES))
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tdpbusd", T.int8(c_tile), T.int8(a_tile), T.int8(b_tile)))


def _amx_intrin(rows: int, blocks: int, depth: int, scope: str):
    """Description: ``c[i, j] += a[i, k] * b[j/16, k/4, j%16, k%4]`` over all of K, for an
    accumulator of ``rows x 16*blocks`` in a buffer of ``scope``; implementation: ``ldtilecfg``, the C
    tiles zeroed (the init before it is a no-op: ``_zeroed_by_the_product``), the K loop, the C
    tiles stored, ``tilerelease``. Tile ids are immediates, so the column blocks are spelled out
    (``blocks > j`` is read when parsed). Several row tiles per call, one ``ldtilecfg`` for
    them, ran slower at 128 x 256 x 1024: the larger accumulator left L1."""
    columns = blocks * COLUMN_BLOCK
    full, tail = divmod(depth, TILE_BYTES)
    groups = TILE_BYTES // DEPTH_BLOCK  # k groups of 4 per full tile: the B tile's rows
    words = _tile_config(rows, blocks, depth)

    @T.prim_func(s_tir=True)
    def desc(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        c_stride = T.int32()
        a = T.match_buffer(a_handle, (rows, depth), "uint8", offset_factor=1)
        b = T.match_buffer(b_handle, (blocks, depth // DEPTH_BLOCK, COLUMN_BLOCK, DEPTH_BLOCK), "int8",
                           offset_factor=1)
        c = T.match_buffer(c_handle, (rows, columns), "int32", offset_factor=1, strides=[c_stride, 1],
                           scope=scope)
        with T.sblock("root"):
            T.reads(c[0:rows, 0:columns], a[0:rows, 0:depth],
                    b[0:blocks, 0:depth // DEPTH_BLOCK, 0:COLUMN_BLOCK, 0:DEPTH_BLOCK])
            T.writes(c[0:rows, 0:columns])
            for i, j, k in T.grid(rows, columns, depth):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    c[vi, vj] = c[vi, vj] + T.cast(a[vi, vk], "int32") * T.cast(
                        b[vj // COLUMN_BLOCK, vk // DEPTH_BLOCK, vj % COLUMN_BLOCK, vk % DEPTH_BLOCK], "int32")

    @T.prim_func(s_tir=True)
    def impl(a_handle: T.handle, b_handle: T.handle, c_handle: T.handle) -> None:
        c_stride = T.int32()
        a = T.match_buffer(a_handle, (rows, depth), "uint8", offset_factor=1)
        b = T.match_buffer(b_handle, (blocks, depth // DEPTH_BLOCK, COLUMN_BLOCK, DEPTH_BLOCK), "int8",
                           offset_factor=1)
        c = T.match_buffer(c_handle, (rows, columns), "int32", offset_factor=1, strides=[c_stride, 1],
                           scope=scope)
        with T.sblock("root"):
            T.reads(c[0:rows, 0:columns], a[0:rows, 0:depth],
                    b[0:blocks, 0:depth // DEPTH_BLOCK, 0:COLUMN_BLOCK, 0:DEPTH_BLOCK])
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
            for q in range(full):  # tiles 4 (A) and 5 (B): 64 k
                _tile_load(4, T.address_of(a[0, q * TILE_BYTES]), T.int64(depth))
                _tile_product(b, 0, 4, 5, q * groups)
                if blocks > 1:
                    _tile_product(b, 1, 4, 5, q * groups)
                if blocks > 2:
                    _tile_product(b, 2, 4, 5, q * groups)
                if blocks > 3:
                    _tile_product(b, 3, 4, 5, q * groups)
            if tail > 0:  # tiles 6 (A) and 7 (B): the last depth % 64 k
                _tile_load(6, T.address_of(a[0, full * TILE_BYTES]), T.int64(depth))
                _tile_product(b, 0, 6, 7, full * groups)
                if blocks > 1:
                    _tile_product(b, 1, 6, 7, full * groups)
                if blocks > 2:
                    _tile_product(b, 2, 6, 7, full * groups)
                if blocks > 3:
                    _tile_product(b, 3, 6, 7, full * groups)
            _tile_store(0, T.address_of(c[0, 0]), T.Cast("int64", c_stride * 4))
            if blocks > 1:
                _tile_store(1, T.address_of(c[0, COLUMN_BLOCK]), T.Cast("int64", c_stride * 4))
            if blocks > 2:
                _tile_store(2, T.address_of(c[0, 2 * COLUMN_BLOCK]), T.Cast("int64", c_stride * 4))
            if blocks > 3:
                _tile_store(3, T.address_of(c[0, 3 * COLUMN_BLOCK]), T.Cast("int64", c_stride * 4))
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    return desc, impl


def _zeroed_by_the_product(rows: int, columns: int, scope: str):
    """Description: the accumulator's init, ``c[i, j] = 0``; implementation: nothing, as the AMX
    intrinsic, which always follows it (the rule tensorizes the init and the product together),
    starts from zeroed C tiles (``tilezero``) instead of loading ``c``: no pass that writes
    zeros to memory for the tiles to load them again."""

    @T.prim_func(s_tir=True)
    def desc(c_handle: T.handle) -> None:
        c_stride = T.int32()
        c = T.match_buffer(c_handle, (rows, columns), "int32", offset_factor=1, strides=[c_stride, 1],
                           scope=scope)
        with T.sblock("root"):
            T.reads()
            T.writes(c[0:rows, 0:columns])
            for i, j in T.grid(rows, columns):
                with T.sblock("init"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    c[vi, vj] = 0

    @T.prim_func(s_tir=True)
    def impl(c_handle: T.handle) -> None:
        c_stride = T.int32()
        c = T.match_buffer(c_handle, (rows, columns), "int32", offset_factor=1, strides=[c_stride, 1],
                           scope=scope)
        with T.sblock("root"):
            T.reads()
            T.writes(c[0:rows, 0:columns])
            T.evaluate(0)

    return desc, impl


def register_amx_intrins(rows: int, blocks: int, depth: int, scope: str = "local") -> tuple[str, str]:
    """(the init's, the product's) tensor intrinsics for a tile's shapes and its accumulator's
    scope (a local tile, or the whole sum in memory), registered."""
    name = amx_intrin_name(rows, blocks, depth, scope)
    s_tir.TensorIntrin.register(name, *_amx_intrin(rows, blocks, depth, scope), override=True)
    s_tir.TensorIntrin.register(f"{name}_init", *_zeroed_by_the_product(rows, blocks * COLUMN_BLOCK, scope),
                                override=True)
    return f"{name}_init", name


class Int8MatmulAmx(ScheduleRule):
    """C[m, n] = sum_k u8(A[m, k]) * s8(W[n/16, k/4, n%16, k%4]) as AMX tiles (``tdpbusd``), its
    element-wise epilogue computed per tile. Declines on a target without AMX-INT8, for a
    symbolic row count or fewer than ``MIN_TILE_ROWS`` rows, and for any other kernel."""

    runs_before = ("Int8MatmulVnni", "MatmulEpilogue", "MatmulMultiOutput", "Attention")

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not AMX_TILES or not is_cpu_kernel(func, target) or not has_amx_int8(target):
            return None
        kernel = only_reduction(s_tir.Schedule(func))
        if kernel is None or not is_int8_sum(kernel.stmt):
            return None
        *batch, m, _, _ = kernel.stmt.iter_vars
        rows = extent_of(m.dom.extent)
        if not isinstance(rows, int) or rows < MIN_TILE_ROWS:
            return None
        tile_rows = largest_divisor(rows, TILE_ROWS)
        if tile_rows < MIN_TILE_ROWS and batch:
            # blockize binds a batch loop outside loop_partition's copies as 0: wrong sums
            return None
        sch = kernel.sch
        place_prologue(sch, kernel)
        if tile_rows < MIN_TILE_ROWS:  # 197 rows: 12 tiles of 16, one of 5
            try:
                scheduled = _schedule_with_row_tail(sch, kernel.block, kernel.epilogue)
            except s_tir.ScheduleError:
                return None
            request_amx_permission()
            return scheduled
        for per_tile in (True, False):
            attempt = sch.copy()
            try:
                _schedule(attempt, kernel.block, kernel.epilogue, tile_rows, per_tile)
            except s_tir.ScheduleError:
                continue  # an epilogue that cannot follow the tile (one that reads across tiles)
            request_amx_permission()  # this process may run the kernel (compile's verification)
            return attempt
        return None


def _schedule(sch: s_tir.Schedule, block, epilogue: list, tile_rows: int, per_tile: bool) -> None:
    """One AMX call per output tile of ``tile_rows`` (a divisor of M) x up to 64 columns; the
    epilogue computed per tile, or (``per_tile`` False) after the whole sum, across cores."""
    *batch, m, n, k = sch.get_loops(block)
    columns, depth = extent_of(sch.get(n).extent), extent_of(sch.get(k).extent)
    blocks = largest_divisor(columns // COLUMN_BLOCK, MAX_BLOCKS)
    m_outer, m_inner = sch.split(m, [None, tile_rows])
    n_outer, n_inner = sch.split(n, [None, blocks * COLUMN_BLOCK])
    outer = (n_outer, m_outer) if columns * depth > COLUMNS_OUTER_WEIGHT_BYTES else (m_outer, n_outer)
    sch.reorder(*outer, m_inner, n_inner, k)
    write_back_tiles(sch, block, batch, outer, epilogue, per_tile)
    init = sch.decompose_reduction(block, m_inner)
    init_intrin, intrin = register_amx_intrins(tile_rows, blocks, depth)
    sch.tensorize(sch.get_loops(init)[-2], init_intrin)
    sch.tensorize(m_inner, intrin)


def _row_partitions(rows: int) -> list[tuple[int, int]]:
    """(rows, tile rows) of each copy of the sum: tiles of 16, then one tile of the rest; a
    rest of 1 row (which blockize does not take as a tile) joins the last 16 as tiles of 8 and 9."""
    tail = rows % TILE_ROWS
    if tail != 1:
        return [(rows - tail, TILE_ROWS), (tail, tail)]
    return ([(rows - 17, TILE_ROWS)] if rows > 17 else []) + [(8, 8), (9, 9)]


def _schedule_with_row_tail(sch: s_tir.Schedule, block, epilogue: list) -> s_tir.Schedule:
    """M with no divisor that fills a tile (a prime M past 16): the sum as copies
    (``loop_partition``, ``_row_partitions``), tiles of 16 rows over the first ``M - M % 16``
    rows and one tile of the rest, written whole into memory; then the epilogue in one pass
    over it, across cores. (The per-tile epilogue of ``_schedule`` would need one tile loop
    for all copies.)"""
    *_, m, n, k = sch.get_loops(block)
    rows, columns, depth = (extent_of(sch.get(loop).extent) for loop in (m, n, k))
    blocks = largest_divisor(columns // COLUMN_BLOCK, MAX_BLOCKS)
    partitions = _row_partitions(rows)
    epilogue_names = [sch.get(block_rv).name_hint for block_rv in epilogue]
    parts = sch.loop_partition(m, [extent for extent, _ in partitions[:-1]] + [None])
    copies = [sch.get(sch.get_child_blocks(part)[0]).name_hint for part in parts]
    sch = s_tir.Schedule(_normalized_copies(sch.mod["main"], copies))
    for name, (extent, tile_rows) in zip(copies, partitions):
        copy = sch.get_sblock(name)
        m_part, n_part, k_part = sch.get_loops(copy)[-3:]
        n_outer, n_inner = sch.split(n_part, [None, blocks * COLUMN_BLOCK])
        if extent > tile_rows:
            m_outer, m_inner = sch.split(m_part, [None, tile_rows])
            outer = (n_outer, m_outer) if columns * depth > COLUMNS_OUTER_WEIGHT_BYTES else (m_outer, n_outer)
            sch.reorder(*outer, m_inner, n_inner, k_part)
            sch.parallel(sch.fuse(*outer))
        else:  # one tile
            m_inner = m_part
            sch.reorder(n_outer, m_inner, n_inner, k_part)
            sch.parallel(n_outer)
        init = sch.decompose_reduction(copy, m_inner)
        init_intrin, intrin = register_amx_intrins(tile_rows, blocks, depth, "global")
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


def _normalized_copies(func: tirx.PrimFunc, names: list[str]) -> tirx.PrimFunc:
    """``func`` after ``loop_partition`` made schedulable again for the copies ``names``: a
    partition that starts past 0 (rows 192..196) made to start at 0, its loop and its block's
    row axis, the offset moved into the block's body (blockize and tensorize take no other);
    and each copy's read and write regions detected again from its body (each declares the
    region of its whole partition, which tensorize would compare with the intrinsic's tile)."""
    buffers = {param: param for param in func.params}
    tvm_ffi.structural_walk(func.body, [(s_tir.SBlock, lambda b: buffers.update({x: x for x in b.alloc_buffers}))])
    analyzer = Analyzer()

    def shifted(stmt, var, start):
        return tvm_ffi.structural_map(stmt, [(tirx.Var, lambda v: v + start if v.same_as(var) else v)])

    def realize(node: s_tir.SBlockRealize) -> s_tir.SBlockRealize:
        block = node.block
        if block.name_hint not in names:
            return node
        iter_vars, values, body, init = [], [], block.body, block.init
        for iter_var, value in zip(block.iter_vars, node.iter_values):
            start = iter_var.dom.min
            if not (is_static(start) and int(start) == 0):
                zero = tirx.IntImm(start.ty.dtype, 0)
                iter_var = tirx.IterVar(tvm.ir.Range.from_min_extent(zero, iter_var.dom.extent), iter_var.var,
                                        iter_var.iter_type)
                body = shifted(body, iter_var.var, start)
                init = shifted(init, iter_var.var, start) if init is not None else None
                value = analyzer.simplify(value - start)
            iter_vars.append(iter_var)
            values.append(value)
        block = s_tir.SBlock(iter_vars, [], [], block.name_hint, body, init, block.alloc_buffers,
                             block.match_buffers, block.annotations)
        reads, writes = get_sblock_read_write_region(block, buffers)
        block = s_tir.SBlock(iter_vars, reads, writes, block.name_hint, body, init, block.alloc_buffers,
                             block.match_buffers, block.annotations)
        return s_tir.SBlockRealize(values, node.predicate, block)

    def from_zero(loop: tirx.For) -> tirx.For:
        if is_static(loop.min) and int(loop.min) == 0:
            return loop
        return tirx.For(loop.loop_var, tirx.IntImm(loop.min.ty.dtype, 0), loop.extent, loop.kind,
                        shifted(loop.body, loop.loop_var, loop.min), loop.thread_binding, loop.annotations)

    body = tvm_ffi.structural_map(func.body, [(tirx.For, from_zero)])
    return func.with_body(tvm_ffi.structural_map(body, [(s_tir.SBlockRealize, realize)]))

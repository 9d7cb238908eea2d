"""CPU schedule rules on kernels with symbolic extents (a sequence length compiled once for a range).

Each kernel is lowered with ``n = tirx.Var("n")`` in its shapes, scheduled by the rule (which
must answer), built once, and run at several sizes -- 1, sizes that are not a multiple of any
tile, and a large one -- against the unscheduled kernel; the loop structure is checked for what
the rule promises (rows across cores, vectors of the target's width, full register tiles).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from loop_structure import float_lanes, matmul_tile_rows
from machine import host_target
from tvm import relax, s_tir, tirx
from tvm.relax.dpl import is_const, is_op, wildcard
from tvm.relax.op import add, matmul, nn
from tvm.sym.analyzer import Analyzer
from tvm.tirx import ForKind

from tvm_fusion.passes import FusePatterns
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.schedules.cpu import (Attention, Fallback, Injective, MatmulEpilogue, Reduction,
                                      SkipNorm, Softmax)

TARGET = tvm.target.Target(host_target())
LANES = float_lanes(TARGET)
SIZES = [1, 13, 100]  # one row, a size no tile divides, a large one
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def _relax_module(fn, shapes: dict) -> tvm.IRModule:
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in shapes.items()]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(fn(*params))
        bb.emit_func_output(out)
    return bb.get()


def _lowered(fn, **shapes) -> tvm.IRModule:
    return relax.get_pipeline("zero")(_relax_module(fn, shapes))


def _kernel(mod: tvm.IRModule, name_part: str = "") -> tvm.ir.GlobalVar:
    (gvar,) = [gv for gv, f in mod.functions_items()
               if isinstance(f, tirx.PrimFunc) and name_part in gv.name_hint]
    return gvar


def _schedule(rule, mod: tvm.IRModule, gvar) -> tuple[tvm.IRModule, tirx.PrimFunc]:
    sch = rule.apply(mod[gvar], TARGET, False)
    assert sch is not None, f"{type(rule).__name__} declined the symbolic kernel"
    scheduled = mod.clone()
    scheduled[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    return scheduled, sch.mod["main"]


def _assert_same_numbers(mod, scheduled, shapes_at, sizes=SIZES, tolerance=TOLERANCE):
    """Build both modules once and compare them at each size; ``shapes_at(size)`` gives the inputs' shapes."""
    dev = tvm.cpu()
    vms = [relax.VirtualMachine(tvm.compile(m, target=TARGET), dev) for m in (mod, scheduled)]
    rng = np.random.default_rng(0)
    for size in sizes:
        inputs = [rng.standard_normal(shape).astype("float32") for shape in shapes_at(size)]
        expected, actual = (_numpy(vm["main"](*[tvm.runtime.tensor(x, dev) for x in inputs])) for vm in vms)
        for e, a in zip(expected, actual):
            np.testing.assert_allclose(a, e, **tolerance, err_msg=f"at size {size}")


def _numpy(result) -> list[np.ndarray]:
    return [result.numpy()] if hasattr(result, "numpy") else [r.numpy() for r in result]


def _loops(func: tirx.PrimFunc, kind: ForKind) -> list:
    """Extents of the loops of ``kind``, in walk order: an int when static, None when symbolic."""
    found = []

    def visit(loop: tirx.For) -> None:
        if loop.kind == kind:
            found.append(int(loop.extent) if isinstance(loop.extent, tirx.IntImm) else None)

    tvm_ffi.structural_walk(func.body, (tirx.For, visit))
    return found


def _predicated_blocks(func: tirx.PrimFunc) -> set[str]:
    """Names of the blocks that carry a predicate (``T.where``)."""
    names = set()

    def visit(realize: s_tir.SBlockRealize) -> None:
        if not (isinstance(realize.predicate, tirx.IntImm) and int(realize.predicate) == 1):
            names.add(realize.block.name_hint)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlockRealize, visit))
    return names


def _blocks_under_parallel_loops(func: tirx.PrimFunc) -> set[str]:
    names = set()

    def visit(loop: tirx.For) -> None:
        if loop.kind == ForKind.PARALLEL:
            tvm_ffi.structural_walk(loop.body, (s_tir.SBlockRealize, lambda r: names.add(r.block.name_hint)))

    tvm_ffi.structural_walk(func.body, (tirx.For, visit))
    return names


def _symbolic():
    return tirx.Var("n", "int64")


# --- MatmulEpilogue ------------------------------------------------------------------------

def test_matmul_epilogue_symbolic_rows_full_register_tiles():
    n = _symbolic()
    mod = _lowered(lambda x, w, b: nn.gelu(add(matmul(x, w), b)), x=(n, 64), w=(64, 96), b=(96,))
    scheduled, func = _schedule(MatmulEpilogue(), mod, _kernel(mod))
    # One parallel loop over (column panel, row tile), its extent symbolic; the 8 rows (6 on
    # AVX2) of a tile unrolled, 2 vectors of columns (96 = 3 x 32 on AVX-512 -> one vector; 4 x 24
    # on AVX2 -> 2).
    assert _loops(func, ForKind.PARALLEL) == [None]
    assert matmul_tile_rows(LANES) in _loops(func, ForKind.UNROLLED)
    cols = next(v * LANES for v in (2, 1) if 96 % (v * LANES) == 0)
    assert set(_loops(func, ForKind.VECTORIZED)) >= {cols}
    # Rows are padded to whole tiles: the matmul update runs unpredicated, only the store is tested.
    predicated = _predicated_blocks(func)
    assert not any(name.startswith("matmul") for name in predicated), predicated
    # A's padded rows are copied once, outside the parallel tiles (not again per column panel).
    in_tiles = _blocks_under_parallel_loops(func)
    assert "matmul_update" in in_tiles and not any(name.endswith("_pad") for name in in_tiles), in_tiles
    _assert_same_numbers(mod, scheduled, lambda s: [(s, 64), (64, 96), (96,)], sizes=[1, 7, 8, 13, 100])


def test_matmul_epilogue_symbolic_batch_and_rows():
    n = _symbolic()
    mod = _lowered(lambda x, w: matmul(x, w), x=(2, n, 32), w=(32, 48))
    scheduled, func = _schedule(MatmulEpilogue(), mod, _kernel(mod))
    assert _loops(func, ForKind.PARALLEL) == [None]
    _assert_same_numbers(mod, scheduled, lambda s: [(2, s, 32), (32, 48)])


def test_matmul_epilogue_symbolic_reduction_length():
    """probs·V with symbolic keys: K is not unrolled, rows are padded as above."""
    n = _symbolic()
    mod = _lowered(lambda p, v: matmul(p, v), p=(4, n, n), v=(4, n, 32))
    scheduled, func = _schedule(MatmulEpilogue(), mod, _kernel(mod))
    assert _loops(func, ForKind.PARALLEL) == [None]
    _assert_same_numbers(mod, scheduled, lambda s: [(4, s, s), (4, s, 32)])


def test_matmul_epilogue_declines_symbolic_columns():
    n = _symbolic()
    mod = _lowered(lambda x, w: matmul(x, w), x=(16, 32), w=(32, n))
    assert MatmulEpilogue().apply(mod[_kernel(mod)], TARGET, False) is None


# --- Attention -----------------------------------------------------------------------------

def _attention_kernel(seq, heads: int, dim: int, mask=None) -> tvm.IRModule:
    """Self-attention on [1, seq, heads, dim] inputs (plus an additive mask of shape ``mask``),
    fused into one kernel by a plain dpl pattern (the project's attention pattern wants static
    shapes) and lowered like the pipeline does."""
    params = [relax.Var(name, relax.TensorType((1, seq, heads, dim), "float32")) for name in "qkv"]
    if mask is not None:
        params.append(relax.Var("mask", relax.TensorType(mask, "float32")))
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            q, k, v = params[:3]
            scores = matmul(relax.op.permute_dims(q, [0, 2, 1, 3]), relax.op.permute_dims(k, [0, 2, 3, 1]))
            logits = relax.op.divide(scores, relax.const(np.sqrt(dim), "float32"))
            if mask is not None:
                logits = add(logits, params[3])
            context = matmul(nn.softmax(logits, axis=-1), relax.op.permute_dims(v, [0, 2, 1, 3]))
            out = bb.emit_output(relax.op.permute_dims(context, [0, 2, 1, 3]))
        bb.emit_func_output(out)
    head = lambda: is_op("relax.permute_dims")(wildcard())  # noqa: E731
    logits = is_op("relax.divide")(is_op("relax.matmul")(head(), head()), is_const())
    if mask is not None:
        logits = is_op("relax.add")(logits, wildcard())
    root = is_op("relax.permute_dims")(is_op("relax.matmul")(is_op("relax.nn.softmax")(logits), head()))
    fused = relax.transform.FuseOpsByPattern([("test.attention", root)], bind_constants=False)(bb.get())
    return tvm.transform.Sequential(lowering_passes())(fused)


def _predicated_vector_loops(func: tirx.PrimFunc) -> list[str]:
    """Blocks inside a vectorized loop whose predicate depends on that loop's variable (which
    makes the vectorizer fall back to scalar code)."""
    found = []

    def visit(loop: tirx.For) -> None:
        if loop.kind != ForKind.VECTORIZED:
            return

        def check(realize: s_tir.SBlockRealize) -> None:
            uses = []
            tvm_ffi.structural_walk(realize.predicate,
                                    (tirx.Var, lambda v: uses.append(v.same_as(loop.loop_var))))
            if any(uses):
                found.append(realize.block.name_hint)

        tvm_ffi.structural_walk(loop.body, (s_tir.SBlockRealize, check))

    tvm_ffi.structural_walk(func.body, (tirx.For, visit))
    return found


ATTENTION_SIZES = [1, 7, 13, 40, 128, 300]  # one row, tails of a row tile and a key tile, large


def test_attention_symbolic_queries_and_keys_full_tiles():
    n = _symbolic()
    mod = _attention_kernel(n, 2, 16)
    scheduled, func = _schedule(Attention(), mod, _kernel(mod, "softmax"))
    # One parallel loop over (head, row tile), the tile's steps on vectors of rows.
    assert _loops(func, ForKind.PARALLEL) == [None]
    assert {2 * LANES, 16} <= set(_loops(func, ForKind.VECTORIZED))
    assert 8 in _loops(func, ForKind.UNROLLED)  # the Q·Kᵀ register tile's 8 keys
    # Rows and keys are padded to whole tiles: no vector step is predicated, and only the head
    # merge (the output store) checks which rows exist.
    assert _predicated_vector_loops(func) == []
    assert _predicated_blocks(func) == {"T_transpose3"}
    _assert_same_numbers(mod, scheduled, lambda s: [(1, s, 2, 16)] * 3, sizes=ATTENTION_SIZES,
                         tolerance={"rtol": 1e-5, "atol": 1e-6})


def test_attention_symbolic_with_a_row_wise_mask():
    """A [1, 1, n, n] mask: its rows are read for the padding rows too (clamped to the last row),
    and its -inf-like entries must give the unscheduled kernel's numbers."""
    n = _symbolic()
    mod = _attention_kernel(n, 2, 16, mask=(1, 1, n, n))
    scheduled, func = _schedule(Attention(), mod, _kernel(mod, "softmax"))
    assert _predicated_vector_loops(func) == []
    dev = tvm.cpu()
    vms = [relax.VirtualMachine(tvm.compile(m, target=TARGET), dev) for m in (mod, scheduled)]
    rng = np.random.default_rng(0)
    for size in ATTENTION_SIZES:
        q, k, v = (rng.standard_normal((1, size, 2, 16)).astype("float32") for _ in range(3))
        mask = np.where(np.tril(np.ones((size, size), bool)), 0.0, np.finfo(np.float32).min)
        inputs = [q, k, v, mask.reshape(1, 1, size, size).astype("float32")]
        expected, actual = (vm["main"](*[tvm.runtime.tensor(x, dev) for x in inputs]).numpy() for vm in vms)
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6, err_msg=f"at size {size}")


# --- Softmax, Reduction, SkipNorm ----------------------------------------------------------

@pytest.mark.parametrize("shape_of", [lambda n: (n, 64), lambda n: (2, n, 48)])
def test_softmax_symbolic_rows(shape_of):
    n = _symbolic()
    mod = _lowered(lambda x: nn.softmax(x, axis=-1), x=shape_of(n))
    scheduled, func = _schedule(Softmax(), mod, _kernel(mod))
    # Rows in parallel (symbolic count); the static row length still on vectors and rfactored.
    assert _loops(func, ForKind.PARALLEL) == [None]
    assert set(_loops(func, ForKind.VECTORIZED)) == {LANES}
    _assert_same_numbers(mod, scheduled, lambda s: [shape_of(s)])


def test_softmax_symbolic_row_length():
    """Attention scores [heads, n, n]: rows and the reduced axis both symbolic."""
    n = _symbolic()
    mod = _lowered(lambda x: nn.softmax(x, axis=-1), x=(2, n, n))
    scheduled, func = _schedule(Softmax(), mod, _kernel(mod))
    assert _loops(func, ForKind.PARALLEL) == [None]
    _assert_same_numbers(mod, scheduled, lambda s: [(2, s, s)])


def test_reduction_layer_norm_symbolic_rows():
    n = _symbolic()
    mod = _lowered(lambda x, g, b: nn.layer_norm(x, g, b, axes=[-1]), x=(1, n, 64), g=(64,), b=(64,))
    scheduled, func = _schedule(Reduction(), mod, _kernel(mod))
    assert _loops(func, ForKind.PARALLEL) == [None]
    assert LANES in _loops(func, ForKind.VECTORIZED)
    _assert_same_numbers(mod, scheduled, lambda s: [(1, s, 64), (64,), (64,)])


@pytest.mark.parametrize("sum_output", [False, True])
def test_skip_norm_symbolic_rows(sum_output):
    n = _symbolic()
    params = [("x", (n, 64)), ("bias", (64,)), ("skip", (n, 64)), ("gamma", (64,)), ("beta", (64,))]
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in params]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            summed = bb.emit(add(bb.emit(add(params[0], params[1])), params[2]))
            normed = nn.layer_norm(summed, params[3], params[4], axes=[-1])
            out = bb.emit_output(relax.Tuple([normed, summed]) if sum_output else normed)
        bb.emit_func_output(out)
    report = PatternReport()
    fused = FusePatterns([get_pattern("skip_layernorm")], report)(bb.get())
    if not report.fired.get("skip_layernorm"):
        pytest.skip("the skip_layernorm pattern does not take symbolic shapes yet")
    mod = tvm.transform.Sequential(lowering_passes())(fused)
    scheduled, func = _schedule(SkipNorm(), mod, _kernel(mod))
    assert _loops(func, ForKind.PARALLEL) == [None]
    assert LANES in _loops(func, ForKind.VECTORIZED)
    _assert_same_numbers(mod, scheduled, lambda s: [(s, 64), (64,), (s, 64), (64,), (64,)])


# --- Injective, Fallback -------------------------------------------------------------------

def test_injective_symbolic_rows_static_hidden():
    n = _symbolic()
    mod = _lowered(lambda x, b: nn.gelu(add(x, b)), x=(1, n, 64), b=(64,))
    scheduled, func = _schedule(Injective(), mod, _kernel(mod))
    # Per block (the erf is kept apart), outer loops and the hidden size's whole vectors across
    # cores, vectors over the hidden size.
    parallel, vectorized = _loops(func, ForKind.PARALLEL), _loops(func, ForKind.VECTORIZED)
    assert parallel and set(parallel) == {None}
    # (twice: each nest also has a serial copy for a few rows, see the small-extent tests below)
    assert len(vectorized) == 2 * len(parallel) and set(vectorized) == {LANES}
    _assert_same_numbers(mod, scheduled, lambda s: [(1, s, 64), (64,)])


def test_injective_symbolic_innermost_runs_in_parallel_unvectorized():
    n = _symbolic()
    mod = _lowered(lambda x, y: add(x, y), x=(n, 3), y=(n, 3))  # 3 holds no whole vector
    scheduled, func = _schedule(Injective(), mod, _kernel(mod))
    assert _loops(func, ForKind.PARALLEL) == [None]
    assert _loops(func, ForKind.VECTORIZED) == []
    _assert_same_numbers(mod, scheduled, lambda s: [(s, 3), (s, 3)])


def test_fallback_parallelizes_symbolic_leading_loops():
    n = _symbolic()
    mod = _lowered(lambda x, w: matmul(x, w), x=(n, 16), w=(16, 8))
    scheduled, func = _schedule(Fallback(), mod, _kernel(mod))
    assert _loops(func, ForKind.PARALLEL) == [None]  # rows x columns fused, the reduction left inside
    _assert_same_numbers(mod, scheduled, lambda s: [(s, 16), (16, 8)])


# --- Small symbolic extents: serial below the work threshold, parallel above ----------------

def _small_extent_branches(func: tirx.PrimFunc) -> list[tirx.IfThenElse]:
    """The run-time branches ``serial_when_small`` adds: ``if work(n) < threshold: serial copy
    of the nest else: the parallel nest``."""
    found = []

    def visit(branch: tirx.IfThenElse) -> None:
        nest = branch.else_case
        if isinstance(nest, tirx.For) and nest.kind == ForKind.PARALLEL:
            found.append(branch)

    tvm_ffi.structural_walk(func.body, (tirx.IfThenElse, visit))
    return found


def _kinds(stmt) -> list:
    kinds = []
    tvm_ffi.structural_walk(stmt, (tirx.For, lambda loop: kinds.append(loop.kind)), order="pre")
    return kinds


def _serial_at(condition: tirx.Expr, size: int) -> bool:
    """The branch condition evaluated with the symbolic extent ``n`` bound to ``size``."""
    bound = tvm_ffi.structural_map(
        condition, (tirx.Var, lambda v: tirx.IntImm(v.ty.dtype, size) if v.name == "n" else v))
    return bool(int(Analyzer().simplify(bound)))


def _assert_serial_and_parallel_paths(func: tirx.PrimFunc, sizes: list[int]) -> None:
    """Every parallel nest of symbolic extent sits behind a branch on ``n`` whose other side is the
    same nest with no parallel loop, and ``sizes`` take both sides."""
    branches = _small_extent_branches(func)
    assert branches, "no run-time branch between a serial and a parallel nest"
    assert _loops(func, ForKind.PARALLEL) == [None] * len(branches), "a parallel loop outside the branches"
    for branch in branches:
        serial, parallel = _kinds(branch.then_case), _kinds(branch.else_case)
        assert ForKind.PARALLEL not in serial
        assert parallel[0] == ForKind.PARALLEL and not isinstance(branch.else_case.extent, tirx.IntImm)
        # The same nest: same loops, the outer one serial, the same vectors and unrolling.
        assert serial == [ForKind.SERIAL] + parallel[1:]
        assert {_serial_at(branch.condition, size) for size in sizes} == {True, False}, \
            f"sizes {sizes} do not take both paths of {branch.condition}"


def _skip_norm_kernel(n) -> tvm.IRModule:
    params = [("x", (n, 64)), ("bias", (64,)), ("skip", (n, 64)), ("gamma", (64,)), ("beta", (64,))]
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in params]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            summed = bb.emit(add(bb.emit(add(params[0], params[1])), params[2]))
            out = bb.emit_output(nn.layer_norm(summed, params[3], params[4], axes=[-1]))
        bb.emit_func_output(out)
    report = PatternReport()
    fused = FusePatterns([get_pattern("skip_layernorm")], report)(bb.get())
    if not report.fired.get("skip_layernorm"):
        pytest.skip("the skip_layernorm pattern does not take symbolic shapes yet")
    return tvm.transform.Sequential(lowering_passes())(fused)


# rule, symbolic kernel, input shapes at a size, sizes on both sides of the rule's threshold
# (MIN_PARALLEL_ELEMENTS block iterations, or MIN_PARALLEL_TILE_WORK for the register tiles).
SMALL_EXTENT_CASES = {
    # n x 64 elements: serial below n = 64.
    "injective": (Injective(), lambda n: _lowered(lambda x, y: add(x, y), x=(1, n, 64), y=(1, n, 64)),
                  lambda s: [(1, s, 64), (1, s, 64)], [1, 8, 63, 64, 100]),
    # n x 8 x 16 multiply-adds: serial below n = 32.
    "fallback": (Fallback(), lambda n: _lowered(lambda x, w: matmul(x, w), x=(n, 16), w=(16, 8)),
                 lambda s: [(s, 16), (16, 8)], [1, 8, 31, 32, 100]),
    # three passes over a 64-wide row: serial below n = 22.
    "reduction": (Reduction(), lambda n: _lowered(lambda x, g, b: nn.layer_norm(x, g, b, axes=[-1]),
                                                  x=(1, n, 64), g=(64,), b=(64,)),
                  lambda s: [(1, s, 64), (64,), (64,)], [1, 8, 21, 22, 100]),
    "skip_norm": (SkipNorm(), _skip_norm_kernel, lambda s: [(s, 64), (64,), (s, 64), (64,), (64,)],
                  [1, 8, 100]),
    "softmax": (Softmax(), lambda n: _lowered(lambda x: nn.softmax(x, axis=-1), x=(n, 64)),
                lambda s: [(s, 64)], [1, 8, 100]),
    "softmax_scores": (Softmax(), lambda n: _lowered(lambda x: nn.softmax(x, axis=-1), x=(2, n, n)),
                       lambda s: [(2, s, s)], [1, 8, 13, 100]),
    # 8-row tiles x 96 x 64: serial up to 40 rows.
    "matmul_epilogue": (MatmulEpilogue(),
                        lambda n: _lowered(lambda x, w, b: nn.gelu(add(matmul(x, w), b)),
                                           x=(n, 64), w=(64, 96), b=(96,)),
                        lambda s: [(s, 64), (64, 96), (96,)], [1, 7, 13, 40, 41, 100]),
}


@pytest.mark.parametrize("case", sorted(SMALL_EXTENT_CASES))
def test_small_symbolic_extents_run_serially(case):
    rule, kernel, shapes_at, sizes = SMALL_EXTENT_CASES[case]
    mod = kernel(_symbolic())
    scheduled, func = _schedule(rule, mod, _kernel(mod))
    _assert_serial_and_parallel_paths(func, sizes)
    _assert_same_numbers(mod, scheduled, shapes_at, sizes=sizes)


def test_attention_short_sequences_run_serially():
    mod = _attention_kernel(_symbolic(), 2, 16)
    scheduled, func = _schedule(Attention(), mod, _kernel(mod, "softmax"))
    _assert_serial_and_parallel_paths(func, ATTENTION_SIZES)
    # Both copies keep whole tiles: no predicated vector step in either.
    assert _predicated_vector_loops(func) == []
    _assert_same_numbers(mod, scheduled, lambda s: [(1, s, 2, 16)] * 3, sizes=ATTENTION_SIZES,
                         tolerance={"rtol": 1e-5, "atol": 1e-6})


def test_static_kernels_keep_no_branch():
    """A static kernel is decided when scheduled: no run-time branch, no serial copy."""
    mod = _lowered(lambda x, g, b: nn.layer_norm(x, g, b, axes=[-1]), x=(1, 8, 64), g=(64,), b=(64,))
    _, func = _schedule(Reduction(), mod, _kernel(mod))
    assert _small_extent_branches(func) == [] and _loops(func, ForKind.PARALLEL) == [8]


def test_kernel_never_small_keeps_only_the_parallel_nest():
    """One 8-row tile of a 256 x 256 matmul is already above the threshold: no branch (its serial
    side could only run for n = 0, and the simplifier would fold a modulo by a zero tile count)."""
    n = _symbolic()
    mod = _lowered(lambda x, w: matmul(x, w), x=(n, 256), w=(256, 256))
    scheduled, func = _schedule(MatmulEpilogue(), mod, _kernel(mod))
    assert _small_extent_branches(func) == [] and _loops(func, ForKind.PARALLEL) == [None]
    _assert_same_numbers(mod, scheduled, lambda s: [(s, 256), (256, 256)], sizes=[1, 9])

"""Panel prefetch: each task of a packed-weight matmul first asks for its share of the next
column panel, and the tasks of one panel together ask for every line of the next."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.expr import Call
from tvm.sym.analyzer import Analyzer
from tvm.relax.op import add, matmul

from tvm_fusion.passes.pack_matmul_weights import PackMatmulWeights, pack_columns
from tvm_fusion.schedules.cpu import MatmulEpilogue
from tvm_fusion.schedules.cpu.matchers import matmul_tile_rows
from tvm_fusion.schedules.cpu.panel_prefetch import CACHE_LINE_BYTES

K, PANELS = 96, 3


def _packed_matmul(target, lanes, rows, weight):
    """``x @ w + b`` with ``w`` constant (packed in panels of 2 vectors), or a parameter."""
    n = PANELS * 2 * lanes
    params = [relax.Var("x", relax.TensorType((1, rows, K), "float32")), relax.Var("b", relax.TensorType((n,), "float32"))]
    if weight is None:
        params.append(relax.Var("w", relax.TensorType((K, n), "float32")))
    builder = relax.BlockBuilder()
    with builder.function("main", params):
        with builder.dataflow():
            out = builder.emit_output(add(matmul(params[0], params[2] if weight is None else relax.const(weight)), params[1]))
        builder.emit_func_output(out)
    mod = PackMatmulWeights(target)(relax.get_pipeline("zero")(builder.get()))
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    sch = MatmulEpilogue().apply(func, target, False)
    assert sch is not None
    return sch.mod["main"]


def _prefetch_bursts(func) -> list:
    """(loop, weight load) of every serial loop whose body is one llvm.prefetch of a load's address."""
    found = []

    def visit(loop: tirx.For):
        call = loop.body.value if isinstance(loop.body, tirx.Evaluate) else None
        if call is not None and "llvm.prefetch" in str(call):
            (load,) = [arg.args[0] for arg in call.args if isinstance(arg, Call) and arg.op.name == "tirx.address_of"]
            found.append((loop, load))

    tvm_ffi.structural_walk(func.body, (tirx.For, visit))
    return found


def test_tasks_of_a_panel_prefetch_every_line_of_the_next(target, lanes):
    rows = 8 * matmul_tile_rows(target)  # 8 row tiles a panel
    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, PANELS * 2 * lanes)).astype("float32")
    func = _packed_matmul(target, lanes, rows, w)
    ((loop, load),) = _prefetch_bursts(func)
    task = _task_var(func)
    analyzer = Analyzer()
    columns = 2 * lanes
    per_line = CACHE_LINE_BYTES // 4
    for panel in range(PANELS):
        asked = set()
        for row_tile in range(8):
            for line in range(int(loop.extent)):
                values = {task: tirx.IntImm(task.ty.dtype, panel * 8 + row_tile),
                          loop.loop_var: tirx.IntImm(loop.loop_var.ty.dtype, line)}
                p, k, c = (int(analyzer.simplify(tvm_ffi.structural_map(i, [(tirx.Var, lambda v: values.get(v, v))])))
                           for i in load.indices)
                asked.add((p, (k * columns + c) // per_line))
        following = min(panel + 1, PANELS - 1)
        assert asked == {(following, line) for line in range(K * columns // per_line)}

    # Only hints: the results are the matmul's; on x86 the hint is prefetcht1 (into L2).
    x = rng.standard_normal((1, rows, K)).astype("float32")
    b = rng.standard_normal(PANELS * 2 * lanes).astype("float32")
    result = tvm.runtime.tensor(np.zeros((1, rows, PANELS * 2 * lanes), "float32"))
    kernel = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    kernel["main"](*[tvm.runtime.tensor(a) for a in (x, pack_columns(w, 2 * lanes), b)], result)
    np.testing.assert_allclose(result.numpy(), x @ w + b, rtol=1e-4, atol=1e-4)
    x86 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    assembly = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=x86).mod
    assert "prefetcht1" in assembly.inspect_source("s")


def _task_var(func):
    """The parallel tile loop's variable."""
    loops = []
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda loop: loops.append(loop)))
    (parallel,) = [loop for loop in loops if loop.kind == tirx.ForKind.PARALLEL]
    return parallel.loop_var


@pytest.mark.parametrize("rows_in_tiles, packed", [(2, True), (8, False)],
                         ids=["two row tiles a panel", "weight not in panels"])
def test_no_prefetch(target, lanes, rows_in_tiles, packed):
    """Few row tiles a panel (each weight line feeds few FMAs: memory-bound anyway), or a weight
    computed at run time (not in panels): no prefetches."""
    rows = rows_in_tiles * matmul_tile_rows(target)
    w = np.ones((K, PANELS * 2 * lanes), "float32") if packed else None
    assert _prefetch_bursts(_packed_matmul(target, lanes, rows, w)) == []

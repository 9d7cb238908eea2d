"""SkipNorm: residual sum + row statistics + normalized row per task, with or without the sum output."""

import numpy as np
import pytest
import tvm
from loop_structure import loop_kinds, root_loop_nests
from tvm import relax
from tvm.relax.op import add, nn

from tvm_fusion.passes import FusePatterns
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.schedules.cpu import SkipNorm

TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}  # float32; partial sums add in another order


def fused_kernel(norm, rows: int, cols: int, sum_output: bool) -> tvm.IRModule:
    """``norm(x + bias + skip)`` [and the sum] through skip_layernorm/skip_rms_norm and lowering.

    TVM's own FuseOps leaves the adds in a kernel of their own; the pattern makes it one.
    """
    params = [relax.Var(n, relax.TensorType(s, "float32")) for n, s in
              [("x", (rows, cols)), ("bias", (cols,)), ("skip", (rows, cols)), ("gamma", (cols,)), ("beta", (cols,))]]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            summed = bb.emit(add(bb.emit(add(params[0], params[1])), params[2]))
            normed = norm(summed, *params[3:])
            out = bb.emit_output(relax.Tuple([normed, summed]) if sum_output else normed)
        bb.emit_func_output(out)
    mod = FusePatterns([get_pattern("skip_layernorm"), get_pattern("skip_rms_norm")], PatternReport())(bb.get())
    return tvm.transform.Sequential(lowering_passes())(mod)


def layer_norm(x, gamma, beta):
    return nn.layer_norm(x, gamma, beta, axes=[-1])


def rms_norm(x, gamma, _):
    return nn.rms_norm(x, gamma, axes=[-1])


@pytest.mark.parametrize("sum_output", [False, True])
@pytest.mark.parametrize("norm", [layer_norm, rms_norm])
# (1, 256): one token of a decoder (gpt2_tiny at 1x1), whose norms were left to Fallback: the
# sums kept their unit row through normalize_prim_func, the element-wise blocks lost it.
@pytest.mark.parametrize("rows, cols", [(128, 256), (7, 33), (3, 8), (1, 256), (1, 33)])
def test_matches_unscheduled(target, lanes, prim_funcs, norm, rows, cols, sum_output):
    mod = fused_kernel(norm, rows, cols, sum_output)
    [(name, func)] = prim_funcs(mod).items()
    sch = SkipNorm().apply(func, target, False)
    assert sch is not None
    assert_one_row_per_task(sch.mod["main"], lanes, rows, cols, reductions=2 if norm is layer_norm else 1)
    scheduled = mod.clone()
    scheduled[name] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s).astype("float32") for s in [(rows, cols), (cols,), (rows, cols), (cols,), (cols,)]]
    expected, actual = run(mod, inputs), run(scheduled, inputs)
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, **TOLERANCE)


def assert_one_row_per_task(func, lanes, rows: int, cols: int, reductions: int):
    """Rows across cores (a single row: one serial task), every block of a row in one loop nest.
    The sum and the normalized row are written in vectors (of the target's width when they
    divide the row, else one vector of the row); when the row is several whole vectors each row
    reduction keeps a vector of partial sums (its update and init vectorized)."""
    split = cols > lanes and cols % lanes == 0
    loops = loop_kinds(func)
    assert loops.parallel == ([rows] if rows > 1 else [])
    assert root_loop_nests(func) == 1
    assert loops.vectorized == [lanes if split else cols] * (2 + (2 * reductions if split else 0))


def run(mod, inputs):
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target("llvm")), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(x) for x in inputs])
    return [o.numpy() for o in out] if isinstance(out, (tvm.ir.Array, list, tuple)) else [out.numpy()]


def test_declines_plain_softmax_and_layer_norm(lowered, prim_funcs, target):
    for mod in (lowered(lambda x: nn.softmax(add(x, x), axis=-1), x=(8, 32)),
                lowered(lambda x, g, b: nn.layer_norm(x, g, b, axes=[-1]), x=(8, 32), g=(32,), b=(32,))):
        for func in prim_funcs(mod).values():
            assert SkipNorm().apply(func, target, False) is None

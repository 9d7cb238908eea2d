"""MatmulMultiOutput: a matmul whose epilogue writes values and a mask, scheduled per output tile."""

import math

import numpy as np
import pytest
import tvm
from loop_structure import largest_divisor, loop_kinds, matmul_column_tile, matmul_tile_rows
from tvm import relax

from tvm_fusion.kernels.dropout_training import emit_dropout_training
from tvm_fusion.passes import FusePatterns
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.schedules.cpu import MatmulMultiOutput


def fused_dropout_kernel(x_shape, n):
    """The one kernel FuseTIR makes of matmul + bias + gelu + training dropout."""
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    w = relax.Var("w", relax.TensorType((x_shape[-1], n), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            g = bb.emit(relax.op.nn.gelu(relax.op.add(relax.op.matmul(x, w), b)))
            out = bb.emit_output(emit_dropout_training(bb, g, relax.const(0.2, "float32"), 5))
        bb.emit_func_output(out)
    fused = FusePatterns([get_pattern("dropout_training")], PatternReport())(bb.get())
    return tvm.transform.Sequential(lowering_passes())(fused)


def run(mod, target, inputs):
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    return [t.numpy() for t in vm["main"](*[tvm.runtime.tensor(a) for a in inputs])]


@pytest.mark.parametrize("x_shape, n", [((32, 64), 96), ((2, 24, 40), 48), ((5, 16), 20), ((8, 32), 120)])
def test_equals_the_unscheduled_kernel(target, lanes, prim_funcs, x_shape, n):
    mod = fused_dropout_kernel(x_shape, n)
    (name, func), = prim_funcs(mod).items()
    sch = MatmulMultiOutput().apply(func, target, False)
    assert sch is not None
    # One parallel loop over tiles of up to 8 rows (6 on AVX2) x 2 vectors of columns (a divisor
    # when vectors do not fit): both outputs' columns, the matmul update and its init vectorized,
    # rows unrolled.
    *batch, m = x_shape[:-1]
    rows = largest_divisor(m, matmul_tile_rows(lanes))
    cols, piece = matmul_column_tile(n, lanes)
    loops = loop_kinds(sch.mod["main"])
    assert loops.parallel == [math.prod(batch) * (m // rows) * (n // cols)]
    assert sorted(loops.vectorized) == sorted([cols] * 2 + [piece] * 2)  # two outputs; the update, its init
    assert rows in loops.unrolled
    scheduled = mod.clone()
    scheduled[name] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(x_shape).astype("float32"),
              rng.standard_normal((x_shape[-1], n)).astype("float32") / 8,
              rng.standard_normal(n).astype("float32")]
    (values, mask), (expected_values, expected_mask) = run(scheduled, target, inputs), run(mod, target, inputs)
    np.testing.assert_array_equal(mask, expected_mask)
    np.testing.assert_allclose(values, expected_values, rtol=1e-5, atol=1e-5)  # summation order


def test_declines_a_single_output_epilogue(lowered, prim_funcs, target):
    mod = lowered(lambda x, w: relax.op.nn.relu(relax.op.matmul(x, w)), x=(16, 32), w=(32, 64))
    for func in prim_funcs(mod).values():
        assert MatmulMultiOutput().apply(func, target, False) is None

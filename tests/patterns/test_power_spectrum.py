"""Power spectrum: a matmul whose even and odd columns are squared and summed is one composite,
and its kernel (MatmulEpilogue) computes the values numpy does; squares of columns that are not
pairs (step 2 from 0 and from 2) are declined with the reason."""

import numpy as np
import pytest
import tvm
from tvm import relax

import helpers
from tvm_fusion.passes import FusePatterns
from tvm_fusion.patterns import PatternReport, get_pattern

# Stated tolerance: float32 sums of 64 products in another order than numpy's.
RTOL, ATOL = 1e-5, 1e-4


def _module(odd_start: int, columns: int = 64) -> tvm.IRModule:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((32, columns)).astype(np.float32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 10, 32), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            product = bb.emit(relax.op.matmul(x, relax.const(weight)))
            end = columns if odd_start < 2 else columns - 2
            even = bb.emit(relax.op.strided_slice(product, [2], [0], [end], [2]))
            odd = bb.emit(relax.op.strided_slice(product, [2], [odd_start], [columns], [2]))
            out = bb.emit_output(relax.op.add(relax.op.multiply(even, even), relax.op.multiply(odd, odd)))
        bb.emit_func_output(out)
    return bb.get()


def test_even_and_odd_columns_squared_and_summed_are_one_kernel():
    before = _module(odd_start=1)
    report = PatternReport()
    after = FusePatterns([get_pattern("power_spectrum")], report)(before)
    assert report.variants["power_spectrum.matmul_even_odd_squares"] == 1
    composites = [gvar.name_hint for gvar, func in after.functions_items()
                  if isinstance(func, relax.Function) and func.attrs and "Composite" in func.attrs]
    assert len(composites) == 1, composites
    data = np.random.default_rng(1).standard_normal((1, 10, 32)).astype(np.float32)
    weight = before["main"].body.blocks[0].bindings[0].value.args[1].value.numpy()
    product = data @ weight
    expected = product[..., 0::2] ** 2 + product[..., 1::2] ** 2
    np.testing.assert_allclose(helpers.run_lowered(after, data), expected, rtol=RTOL, atol=ATOL)


def test_must_not_fuse_squares_of_columns_that_are_not_pairs():
    before = _module(odd_start=2)
    report = PatternReport()
    after = FusePatterns([get_pattern("power_spectrum")], report)(before)
    tvm.ir.assert_structural_equal(after, before)
    assert not report.fired
    assert any("not of the product's even and odd columns" in miss.reason for miss in report.near_misses), \
        report.near_misses


@pytest.mark.parametrize("columns", [64, 514])
def test_the_kernel_is_scheduled_as_a_matmul(columns):
    """64 columns pack into whole panels (the power reads pairs across a panel's lanes: it runs
    after the tiles); 514 (openWakeWord's 2 x 257 DFT bins) pad the last panel."""
    from tvm_fusion.config import load_config
    from tvm_fusion.passes.pipeline import fusion_pipeline

    log = {}
    lowered = fusion_pipeline(load_config(), PatternReport(), phases=("fuse", "lower", "schedule"),
                              schedule_log=log)(_module(odd_start=1, columns=columns))
    (kernel,) = [name for name in log if "strided_slice" in name]
    assert log[kernel] == "MatmulEpilogue", log
    data = np.random.default_rng(1).standard_normal((1, 10, 32)).astype(np.float32)
    weight = _module(1, columns)["main"].body.blocks[0].bindings[0].value.args[1].value.numpy()
    product = data @ weight
    expected = product[..., 0::2] ** 2 + product[..., 1::2] ** 2
    vm = relax.VirtualMachine(tvm.compile(lowered, target=load_config().tvm_target()), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(data)).numpy(), expected, rtol=RTOL, atol=ATOL)

"""Gather at a constant index -> strided_slice (+ squeeze), which FuseOps can fuse (take is opaque)."""

import numpy as np
import pytest
import tvm
from onnx import helper, numpy_helper
from tvm import relax
from tvm.script import relax as R

from cnn_helpers import compile_and_compare, make_model
from rewrite_helpers import apply_rule


@tvm.script.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((2, 3, 4), "float32")) -> R.Tuple(R.Tensor((2, 4), "float32"), R.Tensor((2, 3, 1), "float32")):
        with R.dataflow():
            row = R.take(x, R.const(-2, "int64"), axis=1)
            column = R.take(x, R.const([3], "int64"), axis=2)
            out = (row, column)
            R.output(out)
        return out


@tvm.script.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((2, 3, 4), "float32")) -> R.Tuple(R.Tensor((2, 4), "float32"), R.Tensor((2, 3, 1), "float32")):
        with R.dataflow():
            row = R.squeeze(R.strided_slice(x, [1], [1], [2]), [1])
            column = R.strided_slice(x, [2], [3], [4])
            out = (row, column)
            R.output(out)
        return out


def test_constant_indices_become_slices():
    mod, report = apply_rule(Before, "gather_constant_index")
    assert report.fired["gather_constant_index"] == 2
    tvm.ir.assert_structural_equal(mod, Expected)


@tvm.script.ir_module
class RuntimeIndex:
    @R.function
    def main(x: R.Tensor((2, 3, 4), "float32"), k: R.Tensor((), "int64")) -> R.Tensor((2, 4), "float32"):
        with R.dataflow():
            row = R.take(x, k, axis=1)
            R.output(row)
        return row


@tvm.script.ir_module
class SeveralIndices:
    @R.function
    def main(x: R.Tensor((2, 3, 4), "float32")) -> R.Tensor((2, 2, 4), "float32"):
        with R.dataflow():
            rows = R.take(x, R.const([0, 2], "int64"), axis=1)
            R.output(rows)
        return rows


@pytest.mark.parametrize("module, reason", [(RuntimeIndex, None), (SeveralIndices, "not one position")])
def test_must_not_rewrite_a_runtime_or_multi_position_index(module, reason):
    mod, report = apply_rule(module, "gather_constant_index")
    assert not report.fired["gather_constant_index"]
    tvm.ir.assert_structural_equal(mod, module)
    if reason:
        assert any(reason in miss.reason for miss in report.near_misses)


def test_conv_output_gathered_matches_onnxruntime():
    """``Gather(conv(x), -1, axis=1)`` (the last channel) after a conv, end to end."""
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((6, 4, 1, 1)).astype(np.float32)}
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(-1, np.int64))),
             helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Gather", ["r", "k"], ["y"], axis=1)]
    report, lowered = compile_and_compare(make_model(nodes, {"x": (1, 4, 5, 5)}, "y", weights),
                                          ["gather_constant_index", "conv_epilogue"], rtol=1e-5, atol=1e-5)
    assert report.fired["gather_constant_index"] == 1
    assert not [gv for gv in lowered.get_global_vars() if gv.name_hint.startswith("take")]

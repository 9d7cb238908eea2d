"""Reshape -> Gemm -> Reshape (GPT-2's Conv1D export) -> matmul on the N-D input."""

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from rewrite_helpers import apply_rule
from test_gelu_erf import run


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((1, 8, 16), "float32"), w: R.Tensor((16, 32), "float32"),
             b: R.Tensor((32,), "float32")) -> R.Tensor((1, 8, 32), "float32"):
        with R.dataflow():
            lv = R.reshape(x, R.shape([8, 16]))
            lv1 = R.matmul(lv, w)
            lv2 = R.add(lv1, b)
            gv = R.reshape(lv2, R.shape([1, 8, 32]))
            R.output(gv)
        return gv


def test_reshape_gemm_reshape_becomes_batched_matmul():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 8, 16), "float32"), w: R.Tensor((16, 32), "float32"),
                 b: R.Tensor((32,), "float32")) -> R.Tensor((1, 8, 32), "float32"):
            with R.dataflow():
                lv = R.matmul(x, w)
                gv = R.add(lv, b)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "flattened_linear")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["flattened_linear"] == 1


def test_head_merge_reshape_keeps_a_view():
    """Attention output [B, S, H, D] flattened to [B*S, H*D]: matmul on the [B, S, H*D] view."""

    @I.ir_module
    class HeadsBefore:
        @R.function
        def main(x: R.Tensor((1, 8, 2, 8), "float32"), w: R.Tensor((16, 32), "float32")):
            with R.dataflow():
                lv = R.reshape(x, R.shape([8, 16]))
                lv1 = R.matmul(lv, w)
                gv = R.reshape(lv1, R.shape([1, 8, 32]))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 8, 2, 8), "float32"), w: R.Tensor((16, 32), "float32")):
            with R.dataflow():
                lv = R.reshape(x, R.shape([1, 8, 16]))
                gv = R.matmul(lv, w)
                R.output(gv)
            return gv

    after, _ = apply_rule(HeadsBefore, "flattened_linear")
    tvm.ir.assert_structural_equal(after, Expected)


def test_must_not_rewrite_a_reshape_that_reorders_rows():
    @I.ir_module
    class Mismatch:
        @R.function
        def main(x: R.Tensor((1, 8, 16), "float32"), w: R.Tensor((16, 32), "float32")):
            with R.dataflow():
                lv = R.reshape(x, R.shape([8, 16]))
                lv1 = R.matmul(lv, w)
                gv = R.reshape(lv1, R.shape([2, 4, 4, 8]))
                R.output(gv)
            return gv

    after, report = apply_rule(Mismatch, "flattened_linear")
    tvm.ir.assert_structural_equal(after, Mismatch)
    assert report.near_misses and "flatten/unflatten" in report.near_misses[0].reason


def test_values_are_unchanged():
    import numpy as np

    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype("float32") for s in [(1, 8, 16), (16, 32), (32,)]]
    after, _ = apply_rule(Before, "flattened_linear")
    np.testing.assert_allclose(run(after, *args), run(Before, *args), rtol=1e-5, atol=1e-5)


def test_symbolic_batch_and_sequence_keep_a_view():
    """GPT-2's Conv1D with symbolic batch and sequence: [b, s, 2, 8] -> [b*s, 16] -> [b, s, 32]."""

    @I.ir_module
    class SymbolicBefore:
        @R.function
        def main(x: R.Tensor(("b", "s", 2, 8), "float32"), w: R.Tensor((16, 32), "float32"),
                 bias: R.Tensor((32,), "float32")):
            b, s = T.int64(), T.int64()
            with R.dataflow():
                lv = R.reshape(x, R.shape([b * s, 16]))
                lv1 = R.matmul(lv, w)
                lv2 = R.add(lv1, bias)
                gv = R.reshape(lv2, R.shape([b, s, 32]))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("b", "s", 2, 8), "float32"), w: R.Tensor((16, 32), "float32"),
                 bias: R.Tensor((32,), "float32")):
            b, s = T.int64(), T.int64()
            with R.dataflow():
                lv = R.reshape(x, R.shape([b, s, 16]))
                lv1 = R.matmul(lv, w)
                gv = R.add(lv1, bias)
                R.output(gv)
            return gv

    after, report = apply_rule(SymbolicBefore, "flattened_linear")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["flattened_linear"] == 1


def test_must_not_rewrite_when_the_symbolic_rows_are_not_restored():
    """[n, 16] -> [n, 32] -> [1, m, 32]: n rows are not provably m."""

    @I.ir_module
    class Mismatch:
        @R.function
        def main(x: R.Tensor((1, "n", 16), "float32"), w: R.Tensor((16, 32), "float32"),
                 y: R.Tensor(("m",), "float32")):
            n, m = T.int64(), T.int64()
            with R.dataflow():
                lv = R.reshape(x, R.shape([n, 16]))
                lv1 = R.matmul(lv, w)
                gv = R.reshape(lv1, R.shape([1, m, 32]))
                R.output(gv)
            return gv

    after, report = apply_rule(Mismatch, "flattened_linear")
    tvm.ir.assert_structural_equal(after, Mismatch)
    assert [m.reason for m in report.near_misses] == [
        "the last reshape (1, m, 32) does not restore the n flattened rows"]

"""reshape (merging leading axes) -> softmax(last axis) -> reshape back -> softmax on the tensor."""

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from rewrite_helpers import apply_rule


def test_paddles_flattened_attention_softmax_becomes_softmax():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 8, 40, 40), "float32")) -> R.Tensor((1, 8, 40, 40), "float32"):
            with R.dataflow():
                lv = R.reshape(x, R.shape([320, 40]))
                lv1 = R.nn.softmax(lv, axis=-1)
                gv = R.reshape(lv1, R.shape([1, 8, 40, 40]))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 8, 40, 40), "float32")) -> R.Tensor((1, 8, 40, 40), "float32"):
            with R.dataflow():
                gv = R.nn.softmax(x, axis=-1)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "softmax_flattened")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["softmax_flattened"] == 1


def test_must_not_rewrite_a_reshape_that_changes_the_softmax_axis():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 8, 40, 40), "float32")) -> R.Tensor((1, 8, 40, 40), "float32"):
            with R.dataflow():
                lv = R.reshape(x, R.shape([160, 80]))
                lv1 = R.nn.softmax(lv, axis=-1)
                gv = R.reshape(lv1, R.shape([1, 8, 40, 40]))
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "softmax_flattened")
    tvm.ir.assert_structural_equal(after, Before)
    assert [m.reason for m in report.near_misses] == ["the reshape (1, 8, 40, 40) -> (160, 80) changes the softmax axis"]


def test_must_not_rewrite_when_the_result_keeps_another_shape():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 8, 40, 40), "float32")) -> R.Tensor((8, 40, 40), "float32"):
            with R.dataflow():
                lv = R.reshape(x, R.shape([320, 40]))
                lv1 = R.nn.softmax(lv, axis=-1)
                gv = R.reshape(lv1, R.shape([8, 40, 40]))
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "softmax_flattened")
    tvm.ir.assert_structural_equal(after, Before)
    assert not report.fired and report.near_misses


def test_symbolic_leading_dims_become_softmax():
    """SVTR's softmax with a symbolic sequence: [1, 8, n, 40] -> [8n, 40] -> back; the row
    products agree symbolically."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 8, "n", 40), "float32")) -> R.Tensor((1, 8, "n", 40), "float32"):
            n = T.int64()
            with R.dataflow():
                lv = R.reshape(x, R.shape([8 * n, 40]))
                lv1 = R.nn.softmax(lv, axis=-1)
                gv = R.reshape(lv1, R.shape([1, 8, n, 40]))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 8, "n", 40), "float32")) -> R.Tensor((1, 8, "n", 40), "float32"):
            with R.dataflow():
                gv = R.nn.softmax(x, axis=-1)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "softmax_flattened")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["softmax_flattened"] == 1


def test_must_not_rewrite_a_reshape_to_another_symbolic_row_count():
    """[1, 8, n, 40] -> [8m, 40]: the row counts are not provably equal."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 8, "n", 40), "float32"), y: R.Tensor(("m", 40), "float32")):
            n, m = T.int64(), T.int64()
            with R.dataflow():
                lv = R.reshape(x, R.shape([8 * m, 40]))
                lv1 = R.nn.softmax(lv, axis=-1)
                gv = R.reshape(lv1, R.shape([1, 8, n, 40]))
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "softmax_flattened")
    tvm.ir.assert_structural_equal(after, Before)
    assert [m.reason for m in report.near_misses] == [
        "the reshape (1, 8, n, 40) -> (8 * m, 40) changes the softmax axis"]

"""SinkViews: transposes and unit-axis squeezes pushed below element-wise ops cancel against
their inverses, and a channels-last converted CNN then fuses every conv with its epilogue; the
numbers match ONNX Runtime and the unfused module."""

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import helpers
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.passes.sink_views import SinkViews, view_count

# Stated tolerances: float32 convs, summation order differs between the engines.
RTOL, ATOL = 1e-4, 1e-4
BIAS = np.arange(4, dtype=np.float32)


def test_transposes_around_an_epilogue_cancel():
    """``t(relu(t(conv) + b))`` with the inverse transposes: the bias broadcast in NHWC becomes
    one value per channel in NCHW, and both transposes disappear."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 6, 5), "float32"), w: R.Tensor((4, 4, 1, 1), "float32")):
            with R.dataflow():
                conv = R.nn.conv2d(x, w)
                nhwc = R.permute_dims(conv, [0, 2, 3, 1])
                biased = R.add(nhwc, R.const(BIAS))
                act = R.nn.relu(biased)
                gv = R.permute_dims(act, [0, 3, 1, 2])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 6, 5), "float32"), w: R.Tensor((4, 4, 1, 1), "float32")):
            with R.dataflow():
                conv = R.nn.conv2d(x, w)
                biased = R.add(conv, R.const(BIAS.reshape(1, 4, 1, 1)))
                act = R.nn.relu(biased)
                gv = act
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(SinkViews()(Before), Expected)


def test_a_conv1d_rows_squeeze_meets_the_next_convs_expand_dims():
    """Conv1d as a one-row Conv2d: the bias (one value per channel, [C, 1]) gets the row axis back."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 1, 5), "float32"), w: R.Tensor((4, 4, 1, 1), "float32")):
            with R.dataflow():
                conv = R.nn.conv2d(x, w)
                row = R.squeeze(conv, [2])
                biased = R.add(row, R.const(BIAS.reshape(4, 1)))
                act = R.nn.relu(biased)
                again = R.expand_dims(act, [2])
                gv = R.nn.conv2d(again, w)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 1, 5), "float32"), w: R.Tensor((4, 4, 1, 1), "float32")):
            with R.dataflow():
                conv = R.nn.conv2d(x, w)
                biased = R.add(conv, R.const(BIAS.reshape(1, 4, 1, 1)))
                act = R.nn.relu(biased)
                gv = R.nn.conv2d(act, w)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(SinkViews()(Before), Expected)


def test_a_residual_of_two_transposed_maps_is_added_untransposed():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((1, 4, 6, 5), "float32"), b: R.Tensor((1, 4, 6, 5), "float32")):
            with R.dataflow():
                ta = R.permute_dims(a, [0, 2, 3, 1])
                tb = R.permute_dims(b, [0, 2, 3, 1])
                total = R.add(ta, tb)
                gv = R.permute_dims(total, [0, 3, 1, 2])
                R.output(gv)
            return gv

    sunk = SinkViews()(Before)
    assert view_count(sunk["main"]) == 0
    (binding,) = [b for b in sunk["main"].body.blocks[0].bindings if not isinstance(b.value, relax.Var)]
    assert binding.value.op.name == "relax.add" and list(binding.value.args) == list(sunk["main"].params)


def test_an_untransposed_operand_is_laid_out_back_where_that_saves_a_transpose():
    """``t(t(x) + y)`` with ``y`` a full NHWC tensor: one transpose of ``y`` in place of two."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 6, 5), "float32"), y: R.Tensor((1, 6, 5, 4), "float32")):
            with R.dataflow():
                tx = R.permute_dims(x, [0, 2, 3, 1])
                total = R.add(tx, y)
                gv = R.permute_dims(total, [0, 3, 1, 2])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 6, 5), "float32"), y: R.Tensor((1, 6, 5, 4), "float32")):
            with R.dataflow():
                ty = R.permute_dims(y, [0, 3, 1, 2])
                total = R.add(x, ty)
                gv = total
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(SinkViews()(Before), Expected)


def test_must_not_sink_past_an_untransposed_tensor_operand_when_nothing_cancels():
    """``t(x) + y`` left in NHWC: computing it in NCHW would need ``y`` transposed and the sum
    transposed back, two transposes for one."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 6, 5), "float32"), y: R.Tensor((1, 6, 5, 4), "float32")):
            with R.dataflow():
                tx = R.permute_dims(x, [0, 2, 3, 1])
                gv = R.add(tx, y)
                R.output(gv)
            return gv

    before = Before.script()
    tvm.ir.assert_structural_equal(SinkViews()(Before), Before)
    assert Before.script() == before  # the pass returns a new module; its input is untouched


def test_a_circular_pad_of_a_row_follows_it_into_the_row_layout():
    """``concat(slice(v), v, slice(v))`` of a squeezed row ``v``, then the next conv's
    ``expand_dims``: the slices and the concat move to the row's own axes and the views cancel."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 1, 6), "float32"), w: R.Tensor((4, 4, 1, 3), "float32")):
            with R.dataflow():
                conv = R.nn.conv2d(x, w, padding=[0, 1, 0, 1])
                row = R.squeeze(conv, [2])
                tail = R.strided_slice(row, [2], [4], [6])
                head = R.strided_slice(row, [-1], [0], [2])
                padded = R.concat((tail, row, head), axis=2)
                again = R.expand_dims(padded, [2])
                gv = R.nn.conv2d(again, w)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 1, 6), "float32"), w: R.Tensor((4, 4, 1, 3), "float32")):
            with R.dataflow():
                conv = R.nn.conv2d(x, w, padding=[0, 1, 0, 1])
                tail = R.strided_slice(conv, [3], [4], [6])
                head = R.strided_slice(conv, [3], [0], [2])
                padded = R.concat((tail, conv, head), axis=3)
                gv = R.nn.conv2d(padded, w)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(SinkViews()(Before), Expected)


def test_a_conv_rows_squeeze_moves_below_its_epilogue_when_nothing_cancels_it():
    """A one-row conv whose output is pooled (magika): the squeeze meets no expand_dims, but
    below the bias and activation it lets the conv epilogue take them; as many views as before."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 1, 5), "float32"), w: R.Tensor((4, 4, 1, 1), "float32")):
            with R.dataflow():
                conv = R.nn.conv2d(x, w)
                row = R.squeeze(conv, [2])
                biased = R.add(row, R.const(BIAS.reshape(4, 1)))
                act = R.nn.relu(biased)
                gv = R.max(act, axis=[2], keepdims=True)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 1, 5), "float32"), w: R.Tensor((4, 4, 1, 1), "float32")):
            with R.dataflow():
                conv = R.nn.conv2d(x, w)
                biased = R.add(conv, R.const(BIAS.reshape(1, 4, 1, 1)))
                act = R.nn.relu(biased)
                row = R.squeeze(act, [2])
                gv = R.max(row, axis=[2], keepdims=True)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(SinkViews()(Before), Expected)


def test_must_not_move_a_view_of_anything_but_a_conv_when_nothing_cancels_it():
    """A squeeze of an input, below a relu: as many views either way, and no epilogue to gain."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 1, 5), "float32")):
            with R.dataflow():
                row = R.squeeze(x, [2])
                act = R.nn.relu(row)
                gv = R.max(act, axis=[2], keepdims=True)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(SinkViews()(Before), Before)


def test_must_not_duplicate_a_transpose_that_cancels_nowhere():
    """One transpose read by two element-wise ops and never undone: sinking it would leave two."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 6, 5), "float32")):
            with R.dataflow():
                tx = R.permute_dims(x, [0, 2, 3, 1])
                first = R.nn.relu(tx)
                second = R.sigmoid(tx)
                gv = (first, second)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(SinkViews()(Before), Before)


def _channels_last_cnn() -> onnx.ModelProto:
    """Keras' NHWC CNN as onnx2torch/tf2onnx write it: every conv wrapped in transposes, bias,
    batch-norm (sub, mul, add), ReLU and an identity-shortcut add in NHWC."""
    rng = np.random.default_rng(0)
    channels = 8
    inits = [numpy_helper.from_array(rng.standard_normal((channels, 3, 3, 3)).astype(np.float32) * 0.3, "w1"),
             numpy_helper.from_array(rng.standard_normal((channels, channels, 3, 3)).astype(np.float32) * 0.2, "w2")]
    for name in ("b1", "mean1", "scale1", "shift1", "b2"):
        inits.append(numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), name))
    node = helper.make_node
    nodes = [
        node("Transpose", ["image"], ["x"], perm=[0, 3, 1, 2]),
        node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        node("Transpose", ["c1"], ["c1t"], perm=[0, 2, 3, 1]),
        node("Add", ["c1t", "b1"], ["h1"]), node("Sub", ["h1", "mean1"], ["h2"]),
        node("Mul", ["h2", "scale1"], ["h3"]), node("Add", ["h3", "shift1"], ["h4"]),
        node("Relu", ["h4"], ["r1"]),
        node("Transpose", ["r1"], ["r1n"], perm=[0, 3, 1, 2]),
        node("Conv", ["r1n", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        node("Transpose", ["c2"], ["c2t"], perm=[0, 2, 3, 1]),
        node("Add", ["c2t", "b2"], ["h5"]), node("Add", ["h5", "r1"], ["h6"]),
        node("Relu", ["h6"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "channels_last", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 12, 10, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 12, 10, channels])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def test_channels_last_cnn_fuses_every_epilogue_and_matches_onnxruntime(tmp_path):
    model = _channels_last_cnn()
    path = tmp_path / "channels_last.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    assert optimized.report.fired["conv_epilogue"] == 2
    # The input's transpose and the output's stay; the four around the convs cancelled.
    assert view_count(SinkViews()(relax.transform.ConvertToDataflow()(prepared.relax_module))["main"]) == 2
    inputs = {"image": np.random.default_rng(1).standard_normal((1, 12, 10, 3)).astype(np.float32)}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)

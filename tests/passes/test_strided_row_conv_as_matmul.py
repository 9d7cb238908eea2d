"""StridedRowConvAsMatmul: a strided conv over a one-row map becomes a matmul of its input's
frames (a ``take`` by constant indices) by the transposed filters; unit-stride, grouped,
biased, heavily overlapping or non-constant convs stay convs, each refusal with its reason (a
near miss where the model could avoid it); an
STFT-style power spectrum (two sibling convs, kernel 32, stride 10) matches ONNX Runtime."""

import numpy as np
import onnx
import pytest
import tvm
import tvm_ffi
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import helpers
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.passes.merge_sibling_convs import epilogue_reason, reader_ops
from tvm_fusion.passes.strided_row_conv_as_matmul import StridedRowConvAsMatmul, decline_reason, is_strided_row_conv
from tvm_fusion.patterns import PatternReport

# Stated tolerances: float32 dot products of 64 terms, summed in another order than ORT's conv.
RTOL, ATOL = 1e-4, 1e-4
FILTERS = np.arange(3 * 2 * 1 * 4, dtype=np.float32).reshape(3, 2, 1, 4) / 10
# frames[t, c*4 + j] = c*12 + t*3 + j: 2 channels of a padded row of 10 + 1 + 1, 3 frames.
INDICES = (np.arange(2)[None, :, None] * 12 + np.arange(3)[:, None, None] * 3
           + np.arange(4)[None, None, :]).reshape(3, 8).astype(np.int64)


def test_strided_row_conv_becomes_a_frames_matmul():
    """Two channels, padding one column each side, kernel 4, stride 3: ``(10 + 2 - 4) // 3 + 1``
    = 3 frames of 2 x 4 values over the padded row of 12."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2, 1, 10), "float32")):
            with R.dataflow():
                conv = R.nn.conv2d(x, R.const(FILTERS), strides=[1, 3], padding=[0, 1, 0, 1])
                gv = R.multiply(conv, conv)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 1, 10), "float32")):
            with R.dataflow():
                padded = R.nn.pad(x, [0, 0, 0, 0, 0, 0, 1, 1])
                flat = R.reshape(padded, [1, 24])
                frames = R.take(flat, R.const(INDICES), axis=1)
                product = R.matmul(frames, R.const(np.ascontiguousarray(FILTERS.reshape(3, 8).T)))
                ncw = R.permute_dims(product, [0, 2, 1])
                conv = R.expand_dims(ncw, [2])
                gv = R.multiply(conv, conv)
                R.output(gv)
            return gv

    report = PatternReport()
    tvm.ir.assert_structural_equal(StridedRowConvAsMatmul(report)(Before), Expected)
    assert report.variants["strided_row_conv_as_matmul.conv2d"] == 1


def _one_conv(stride=4, kernel=8, groups=1, weight_param=False, bias=False, rows=1):
    """``conv2d(x, W)`` over a [1, 2, rows, 32] map, squared."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 2, rows, 32), "float32"))
    shape = (4, 2 // groups, 1, kernel)
    w = relax.Var("w", relax.TensorType(shape, "float32"))
    with bb.function("main", [x, w] if weight_param else [x]):
        with bb.dataflow():
            conv = bb.emit(relax.op.nn.conv2d(x, w if weight_param else relax.const(np.ones(shape, np.float32)),
                                              strides=[1, stride], groups=groups))
            if bias:
                conv = bb.emit(relax.op.add(conv, relax.const(np.ones((1, 4, 1, 1), np.float32))))
            out = bb.emit_output(relax.op.multiply(conv, conv))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("variant, reason, reported", [
    (dict(stride=1), None, False),  # unit stride: not considered
    (dict(rows=3), None, False),  # not a one-row map
    (dict(groups=2), "grouped conv (2 groups)", True),
    (dict(weight_param=True), "the weight is not a constant", True),
    (dict(bias=True), "feeds add (a bias or an activation)", False),
    (dict(stride=2, kernel=16), "windows overlap too much: the frames would be 4.5x the input", False),
])
def test_must_not_rewrite_convs_the_direct_kernel_keeps(variant, reason, reported):
    """The module is unchanged and the check says why; a near miss only where the model could
    avoid the refusal (the direct conv is the better kernel for a biased or overlapping one)."""
    before = _one_conv(**variant)
    report = PatternReport()
    tvm.ir.assert_structural_equal(StridedRowConvAsMatmul(report)(before), before)
    bindings = before["main"].body.blocks[0].bindings
    conv = bindings[0]
    if reason is None:
        assert not is_strided_row_conv(conv.value)
    else:
        assert is_strided_row_conv(conv.value)
        said = decline_reason(conv.value) or epilogue_reason(conv.var, reader_ops(bindings))
        assert reason in said
    assert [reason in miss.reason for miss in report.near_misses] == ([True] if reported else [])


def _stft_power_model(samples: int, taps: int = 32, hop: int = 10, bins: int = 17) -> onnx.ModelProto:
    """torchlibrosa's STFT as openWakeWord exports it: the signal unsqueezed to one channel, a
    real and an imaginary Conv1d (no bias), each result unsqueezed and transposed to frames x
    bins, squared with Pow and summed, then a mel-like MatMul."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((bins, 1, taps)).astype(np.float32) * 0.2, "w_re"),
             numpy_helper.from_array(rng.standard_normal((bins, 1, taps)).astype(np.float32) * 0.2, "w_im"),
             numpy_helper.from_array(np.abs(rng.standard_normal((bins, 6))).astype(np.float32), "mel"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    frames = (samples - taps) // hop + 1
    nodes = [helper.make_node("Unsqueeze", ["x", "axis1"], ["signal"]),
             helper.make_node("Conv", ["signal", "w_re"], ["c_re"], kernel_shape=[taps], strides=[hop]),
             helper.make_node("Conv", ["signal", "w_im"], ["c_im"], kernel_shape=[taps], strides=[hop])]
    for part in ("re", "im"):
        nodes += [helper.make_node("Unsqueeze", [f"c_{part}", "axis1"], [f"u_{part}"]),
                  helper.make_node("Transpose", [f"u_{part}"], [f"t_{part}"], perm=[0, 1, 3, 2]),
                  helper.make_node("Pow", [f"t_{part}", "two"], [f"p_{part}"])]
    nodes += [helper.make_node("Add", ["p_re", "p_im"], ["power"]),
              helper.make_node("MatMul", ["power", "mel"], ["y"])]
    graph = helper.make_graph(nodes, "stft_power", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, samples])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, frames, 6])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_stft_power_spectrum_runs_as_one_matmul_and_matches_onnxruntime(tmp_path):
    """The two sibling convs merge (MergeSiblingConvs), the merged conv becomes one frames
    matmul, and no conv kernel is left."""
    model = _stft_power_model(samples=200)
    path = tmp_path / "stft_power.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    assert optimized.report.variants["merge_sibling_convs.conv2d"] == 1
    assert optimized.report.variants["strided_row_conv_as_matmul.conv2d"] == 1
    assert not [name for name in optimized.schedule_rules if "conv" in name], optimized.schedule_rules
    assert "MatmulEpilogue" in optimized.schedule_rules.values(), optimized.schedule_rules
    inputs = {"x": np.random.default_rng(1).standard_normal((1, 200)).astype(np.float32)}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)


@pytest.mark.parametrize("batch, channels, padding, dilation", [(2, 3, (2, 1), 2), (1, 1, (0, 0), 1)])
def test_frames_matmul_computes_the_conv(batch, channels, padding, dilation):
    """A batch, several input channels, uneven padding and a dilation: the rewritten module
    gives the conv's values."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((5, channels, 1, 6)).astype(np.float32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((batch, channels, 1, 50), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = bb.emit(relax.op.nn.conv2d(x, relax.const(weight), strides=[1, 4], dilation=[1, dilation],
                                              padding=[0, padding[0], 0, padding[1]]))
            out = bb.emit_output(relax.op.multiply(conv, conv))
        bb.emit_func_output(out)
    before = bb.get()
    after = StridedRowConvAsMatmul()(before)
    assert not tvm_ffi.structural_equal(before, after)
    data = rng.standard_normal((batch, channels, 1, 50)).astype(np.float32)
    np.testing.assert_allclose(helpers.run_lowered(after, data), helpers.run_lowered(before, data), rtol=RTOL, atol=ATOL)

"""CropDeadConvTaps: a conv's taps that read only padding are dropped, exactly: ASPP's dilated
convs over small maps become the 1x1 convs they are, a 3x3 conv over one row a 1x3 one."""

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
from tvm_fusion.passes import fusion_pipeline
from tvm_fusion.passes.crop_dead_conv_taps import CropDeadConvTaps, live_taps
from tvm_fusion.patterns import PatternReport

# Stated tolerances: float32 convs, summation order differs between the engines.
RTOL, ATOL = 1e-4, 1e-4
WEIGHT = np.arange(4 * 8 * 3 * 3, dtype=np.float32).reshape(4, 8, 3, 3)


def test_an_aspp_conv_reading_only_padding_off_centre_becomes_a_1x1_conv():
    """Dilation 24 over a 16x20 map: every outer tap is at least 24 rows or columns away."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 8, 16, 20), "float32")):
            with R.dataflow():
                gv = R.nn.conv2d(x, R.const(WEIGHT), padding=[24, 24, 24, 24], dilation=[24, 24])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 8, 16, 20), "float32")):
            with R.dataflow():
                gv = R.nn.conv2d(x, R.const(WEIGHT[:, :, 1:2, 1:2].copy()), padding=[0, 0, 0, 0], dilation=[1, 1])
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(CropDeadConvTaps()(Before), Expected)


def test_a_one_row_map_keeps_the_middle_kernel_row():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 8, 1, 41), "float32")):
            with R.dataflow():
                gv = R.nn.conv2d(x, R.const(WEIGHT), strides=[2, 2], padding=[1, 1, 1, 1])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 8, 1, 41), "float32")):
            with R.dataflow():
                gv = R.nn.conv2d(x, R.const(WEIGHT[:, :, 1:2, :].copy()), strides=[2, 2], padding=[0, 1, 0, 1])
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(CropDeadConvTaps()(Before), Expected)


@pytest.mark.parametrize("size, out_size, taps, stride, dilation, pad, live", [
    (16, 16, 3, 1, 24, 24, (1, 1)),     # ASPP at 256x320, dilation 24
    (16, 16, 3, 1, 12, 12, (0, 2)),     # dilation 12: the outer taps reach 4 rows each
    (10, 10, 3, 1, 12, 12, (1, 1)),
    (1, 1, 3, 1, 1, 1, (1, 1)),         # one row, pad 1
    (6, 1, 3, 1, 5, 1, (1, 1)),         # only the middle tap lands inside
    (3, 1, 3, 1, 4, 0, (0, 0)),         # no padding: the later taps run past the map
    (8, 8, 3, 1, 1, 1, (0, 2)),         # an ordinary 3x3 conv: every tap live
])
def test_live_taps(size, out_size, taps, stride, dilation, pad, live):
    assert live_taps(size, out_size, taps, stride, dilation, pad) == live


def _conv_module(shape, weight_shape, weight_is_constant=True, **attrs) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    params = [x] if weight_is_constant else [x, relax.Var("w", relax.TensorType(weight_shape, "float32"))]
    weight = np.random.default_rng(0).standard_normal(weight_shape).astype("float32")
    builder = relax.BlockBuilder()
    with builder.function("main", params):
        with builder.dataflow():
            w = relax.const(weight) if weight_is_constant else params[1]
            out = builder.emit_output(relax.op.nn.conv2d(x, w, **attrs))
        builder.emit_func_output(out)
    return builder.get()


@pytest.mark.parametrize("case", ["every tap live", "symbolic map", "weight computed at run time",
                                  "live taps before the padding"])
def test_must_not_crop(case):
    if case == "every tap live":
        before = _conv_module((1, 8, 8, 8), (4, 8, 3, 3), padding=1)
    elif case == "symbolic map":
        before = _conv_module((1, 8, tvm.tirx.Var("h", "int64"), 1), (4, 8, 3, 3), padding=1)
    elif case == "weight computed at run time":
        before = _conv_module((1, 8, 1, 40), (4, 8, 3, 3), weight_is_constant=False, padding=1)
    else:  # the only live tap row is 5 rows below a 1-row pad: it would need a pad of -4
        before = _conv_module((1, 2, 6, 6), (2, 2, 3, 3), padding=[1, 1, 4, 4], dilation=5)
    tvm.ir.assert_structural_equal(CropDeadConvTaps()(before), before)


@pytest.mark.parametrize("shape, weight_shape, attrs", [
    ((1, 8, 16, 20), (4, 8, 3, 3), {"padding": 36, "dilation": 36}),
    ((1, 8, 10, 30), (4, 8, 3, 3), {"padding": 12, "dilation": 12}),               # rows cropped, columns not
    ((1, 8, 1, 41), (4, 8, 3, 3), {"padding": 1, "strides": 2}),
    ((1, 8, 3, 9), (8, 1, 5, 5), {"padding": [4, 2, 2, 2], "dilation": 2, "groups": 8}),  # depthwise, uneven pad
    ((1, 8, 2, 7), (4, 8, 7, 7), {"padding": 3, "strides": [2, 1]}),
])
def test_cropped_conv_computes_the_same_outputs(shape, weight_shape, attrs):
    """Bit for bit here: the products dropped were all with zero padding."""
    before = _conv_module(shape, weight_shape, **attrs)
    after = CropDeadConvTaps()(before)
    assert not tvm_ffi.structural_equal(after, before)
    x = tvm.runtime.tensor(np.random.default_rng(1).standard_normal(shape).astype("float32"))
    outputs = [relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"](x).numpy()
               for mod in (before, after)]
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-6, atol=1e-6)


def _aspp(rows: int, columns: int, channels: int = 16) -> onnx.ModelProto:
    """DeepLabV3's ASPP in small: a 1x1 conv and 3x3 convs at dilations 2, 6 and 12 (+BN-free
    bias, Relu), concatenated, projected by a 1x1 conv."""
    rng = np.random.default_rng(0)
    inits, nodes, branches = [], [], []
    for index, dilation in enumerate((0, 2, 6, 12)):
        kernel = 1 if dilation == 0 else 3
        inits += [numpy_helper.from_array(rng.standard_normal((8, channels, kernel, kernel)).astype(np.float32) * 0.2,
                                          f"w{index}"),
                  numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), f"b{index}")]
        attrs = {} if dilation == 0 else {"pads": [dilation] * 4, "dilations": [dilation] * 2}
        nodes += [helper.make_node("Conv", ["x", f"w{index}", f"b{index}"], [f"c{index}"], **attrs),
                  helper.make_node("Relu", [f"c{index}"], [f"r{index}"])]
        branches.append(f"r{index}")
    inits.append(numpy_helper.from_array(rng.standard_normal((8, 32, 1, 1)).astype(np.float32) * 0.2, "wp"))
    nodes += [helper.make_node("Concat", branches, ["cat"], axis=1), helper.make_node("Conv", ["cat", "wp"], ["y"])]
    graph = helper.make_graph(nodes, "aspp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, rows, columns])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, rows, columns])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("rows, columns, kernels_cropped", [(6, 7, 2), (1, 9, 3), (24, 24, 0)])
def test_aspp_matches_onnxruntime_and_unfused(tmp_path, rows, columns, kernels_cropped):
    """6x7: dilations 6 and 12 reach past the map; one row: every dilated conv keeps its middle
    row; 24x24: every tap is live somewhere, nothing to crop."""
    model = _aspp(rows, columns)
    path = tmp_path / "aspp.onnx"
    onnx.save(model, str(path))
    prepared = api.prepare(path, load_config())
    canonical = fusion_pipeline(prepared.config, PatternReport(), phases=("canonicalize",))(prepared.relax_module)
    kernel_sizes = [tuple(int(d) for d in call.args[1].ty.shape.values[2:]) for call in _convs(canonical["main"])]
    assert sum(size != (3, 3) for size in kernel_sizes) - 2 == kernels_cropped  # two 1x1 convs to begin with
    optimized = api.optimize(prepared)
    inputs = {"x": np.random.default_rng(1).standard_normal((1, 16, rows, columns)).astype(np.float32)}
    helpers.assert_fused_matches_references(model, prepared, optimized, inputs, RTOL, ATOL)


def _convs(func) -> list:
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and getattr(e.op, "name", "") == "relax.nn.conv2d" else None)
    return found

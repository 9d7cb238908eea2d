"""Resize merge: upsample + lateral add (+ activation) and upsampled levels + channel concat."""

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from onnx import helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from cnn_helpers import compile_and_compare, make_model, prim_func_names, random_weights
from helpers import EXAMPLES
from tvm_fusion.passes import FusePatterns
from tvm_fusion.patterns import PatternReport, get_pattern


def fuse(mod):
    report = PatternReport()
    return FusePatterns([get_pattern("resize_merge")], report)(mod), report


def test_top_down_merge_with_relu_becomes_one_composite():
    @I.ir_module
    class Before:
        @R.function
        def main(top: R.Tensor((1, 8, 4, 4), "float32"), lateral: R.Tensor((1, 8, 8, 8), "float32")):
            with R.dataflow():
                lv = R.image.resize2d(top, R.shape([8, 8]), method="nearest_neighbor",
                                      coordinate_transformation_mode="asymmetric", rounding_method="floor")
                lv1 = R.add(lv, lateral)
                gv = R.nn.relu(lv1)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_image_resize2d_relax_add_relax_nn_relu(
            top: R.Tensor((1, 8, 4, 4), "float32"), lateral: R.Tensor((1, 8, 8, 8), "float32")
        ) -> R.Tensor((1, 8, 8, 8), "float32"):
            R.func_attr({"Composite": "resize_merge.add_relu", "Primitive": True})
            with R.dataflow():
                lv = R.image.resize2d(top, R.shape([8, 8]), method="nearest_neighbor",
                                      coordinate_transformation_mode="asymmetric", rounding_method="floor")
                lv1 = R.add(lv, lateral)
                gv = R.nn.relu(lv1)
                R.output(gv)
            return gv

        @R.function
        def main(top: R.Tensor((1, 8, 4, 4), "float32"),
                 lateral: R.Tensor((1, 8, 8, 8), "float32")) -> R.Tensor((1, 8, 8, 8), "float32"):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_image_resize2d_relax_add_relax_nn_relu(top, lateral)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.variants["resize_merge.add_relu"] == 1


def test_concat_of_upsampled_levels_and_a_plain_one_becomes_one_composite():
    @I.ir_module
    class Before:
        @R.function
        def main(p4: R.Tensor((1, 4, 2, 2), "float32"), p3: R.Tensor((1, 4, 4, 4), "float32"),
                 p2: R.Tensor((1, 4, 8, 8), "float32")):
            with R.dataflow():
                lv = R.image.resize2d(p4, R.shape([8, 8]), method="nearest_neighbor")
                lv1 = R.image.resize2d(p3, R.shape([8, 8]), method="linear")
                gv = R.concat((lv, lv1, p2), axis=1)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_image_resize2d_relax_image_resize2d_relax_concat(
            p4: R.Tensor((1, 4, 2, 2), "float32"), p3: R.Tensor((1, 4, 4, 4), "float32"),
            p2: R.Tensor((1, 4, 8, 8), "float32")
        ) -> R.Tensor((1, 12, 8, 8), "float32"):
            R.func_attr({"Composite": "resize_merge.concat3", "Primitive": True})
            with R.dataflow():
                lv = R.image.resize2d(p4, R.shape([8, 8]), method="nearest_neighbor")
                lv1 = R.image.resize2d(p3, R.shape([8, 8]), method="linear")
                gv = R.concat((lv, lv1, p2), axis=1)
                R.output(gv)
            return gv

        @R.function
        def main(p4: R.Tensor((1, 4, 2, 2), "float32"), p3: R.Tensor((1, 4, 4, 4), "float32"),
                 p2: R.Tensor((1, 4, 8, 8), "float32")) -> R.Tensor((1, 12, 8, 8), "float32"):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_image_resize2d_relax_image_resize2d_relax_concat(p4, p3, p2)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.variants["resize_merge.concat3"] == 1


def test_must_not_fuse_when_the_upsampled_map_is_used_elsewhere():
    @I.ir_module
    class Before:
        @R.function
        def main(top: R.Tensor((1, 8, 4, 4), "float32"), lateral: R.Tensor((1, 8, 8, 8), "float32")):
            with R.dataflow():
                lv = R.image.resize2d(top, R.shape([8, 8]), method="nearest_neighbor")
                lv1 = R.add(lateral, lv)
                gv = R.multiply(lv1, lv)  # the upsampled map has a second consumer
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert any("used outside" in m.reason for m in report.near_misses)


def test_must_not_fuse_an_add_that_broadcasts():
    @I.ir_module
    class Before:
        @R.function
        def main(top: R.Tensor((1, 8, 4, 4), "float32"), bias: R.Tensor((1, 8, 1, 1), "float32")):
            with R.dataflow():
                lv = R.image.resize2d(top, R.shape([8, 8]), method="nearest_neighbor")
                gv = R.add(lv, bias)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert any("the add broadcasts" in m.reason for m in report.near_misses)


def test_must_not_fuse_a_concat_along_a_spatial_axis():
    @I.ir_module
    class Before:
        @R.function
        def main(p3: R.Tensor((1, 4, 4, 4), "float32"), p2: R.Tensor((1, 4, 8, 8), "float32")):
            with R.dataflow():
                lv = R.image.resize2d(p3, R.shape([8, 8]), method="nearest_neighbor")
                gv = R.concat((lv, p2), axis=2)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert any("not the channel axis" in m.reason for m in report.near_misses)


# mode, coordinate_transformation_mode, nearest_mode: what exporters write for nearest
# (PyTorch: asymmetric + floor; the ONNX defaults: half_pixel + round_prefer_floor) and for
# bilinear (align_corners=False: pytorch_half_pixel or half_pixel; align_corners=True).
RESIZE_MODES = {
    "nearest": {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
    "nearest_onnx_default": {"mode": "nearest"},
    "bilinear_half_pixel": {"mode": "linear", "coordinate_transformation_mode": "half_pixel"},
    "bilinear_pytorch_half_pixel": {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
    "bilinear_align_corners": {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
}


def merge_model(resize_mode: dict, upsampled_first: bool):
    """relu(lateral + Resize(top, 2x)), with the add's operands in either order."""
    operands = ["up", "lateral"] if upsampled_first else ["lateral", "up"]
    nodes = [helper.make_node("Resize", ["top", "", "scales"], ["up"], **resize_mode),
             helper.make_node("Add", operands, ["sum"]), helper.make_node("Relu", ["sum"], ["y"])]
    return make_model(nodes, {"top": (1, 8, 5, 7), "lateral": (1, 8, 10, 14)}, "y",
                      {"scales": np.array([1, 1, 2, 2])})


@pytest.mark.parametrize("mode", sorted(RESIZE_MODES))
def test_each_resize_mode_merges_into_one_kernel(mode):
    model = merge_model(RESIZE_MODES[mode], upsampled_first=mode == "nearest")
    report, module = compile_and_compare(model, patterns=["resize_merge"])
    assert report.variants["resize_merge.add_relu"] == 1
    assert len(prim_func_names(module)) == 1


def test_upsampled_levels_and_a_plain_level_concatenate_in_one_kernel():
    """The FPN output of DBNet: a 3x3 conv per level, the coarse ones upsampled, one concat."""
    rng = np.random.default_rng(0)
    weights = random_weights(rng, w4=(4, 4, 3, 3), w3=(4, 4, 3, 3))
    weights.update(x4=np.array([1, 1, 4, 4]), x2=np.array([1, 1, 2, 2]))
    nodes = [helper.make_node("Conv", ["p4", "w4"], ["c4"], pads=[1] * 4),
             helper.make_node("Conv", ["p3", "w3"], ["c3"], pads=[1] * 4),
             helper.make_node("Resize", ["c4", "", "x4"], ["u4"], **RESIZE_MODES["nearest"]),
             helper.make_node("Resize", ["c3", "", "x2"], ["u3"], **RESIZE_MODES["bilinear_half_pixel"]),
             helper.make_node("Concat", ["u4", "u3", "p2"], ["y"], axis=1)]
    model = make_model(nodes, {"p4": (1, 4, 3, 4), "p3": (1, 4, 6, 8), "p2": (1, 4, 12, 16)}, "y", weights)
    report, module = compile_and_compare(model, patterns=["resize_merge"])
    assert report.variants["resize_merge.concat3"] == 1
    assert len(prim_func_names(module)) == 3  # two convs, one resize + concat


def test_dbnet_fuses_every_top_down_merge_and_the_concat_and_matches_onnxruntime():
    from tvm_fusion import api

    path, shape = EXAMPLES / "dbnet_tiny.onnx", (1, 3, 64, 64)
    input_shapes = ["input:1x3x64x64"]
    inspected = api.inspect_model(path, input_shapes=input_shapes)
    fired = inspected.report.variants
    # 1/32 -> 1/16 -> 1/8 -> 1/4: each lateral is a 1x1 conv, so conv_epilogue takes the merge
    assert fired["conv_epilogue.conv_upsampled_residual"] == 3
    assert fired["resize_merge.add"] == 0
    assert fired["resize_merge.concat4"] == 1
    assert not {op for op in inspected.fused_ops if op in ("image.resize2d", "concat")}

    prepared = api.prepare(path, input_shapes=input_shapes)
    optimized = api.optimize(prepared)
    image = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    vm = relax.VirtualMachine(api.build(optimized.module, prepared.config), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(image)).numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got, session.run(None, {"input": image})[0], rtol=1e-4, atol=1e-5)
    # the merges are blocked conv kernels with an upsampled residual (NCHW16c or NCHW8c, the
    # resize in that layout too), the concat a Resize kernel
    assert {rule for kernel, rule in optimized.schedule_rules.items() if "resize" in kernel} == {
        "Conv2dNCHWc", "Resize"}


# Symbolic image sizes ---------------------------------------------------------------------

NEAREST = {"method": "nearest_neighbor", "coordinate_transformation_mode": "asymmetric",
           "rounding_method": "floor"}


def pipeline_and_compare_at(mod, sizes):
    """symbolic_helpers.pipeline_and_compare for inputs whose dims are expressions of HEIGHT
    and WIDTH (``2 * height``)."""
    from symbolic_helpers import HEIGHT, WIDTH
    from tvm.sym.analyzer import Analyzer
    from tvm_fusion.config import load_config
    from tvm_fusion.passes import fusion_pipeline

    cfg = load_config(None)
    report, log = PatternReport(), {}
    optimized = fusion_pipeline(cfg, report, schedule_log=log)(mod)
    fused = relax.VirtualMachine(tvm.compile(optimized, target=cfg.tvm_target()), tvm.cpu())
    plain = relax.VirtualMachine(tvm.compile(mod, target=cfg.tvm_target()), tvm.cpu())
    rng = np.random.default_rng(0)
    for height, width in sizes:
        analyzer = Analyzer()
        analyzer.bind(HEIGHT, height)
        analyzer.bind(WIDTH, width)
        inputs = [tvm.runtime.tensor(rng.standard_normal(
            [int(analyzer.simplify(dim)) for dim in param.ty.shape.values]).astype("float32"))
            for param in mod["main"].params]
        np.testing.assert_allclose(fused["main"](*inputs).numpy(), plain["main"](*inputs).numpy(),
                                   rtol=1e-4, atol=1e-4)
    return report, log


def test_symbolic_merge_and_concat_fuse_and_match_at_every_size():
    """The lateral's rows are spelled ``2 * height``, the resize's ``height * 2``: equal by value."""
    from symbolic_helpers import HEIGHT, WIDTH, symbolic_module

    def fpn(top, lateral, p2):
        up = relax.op.image.resize2d(top, relax.ShapeExpr([HEIGHT * 2, WIDTH * 2]), **NEAREST)
        merged = relax.op.nn.relu(relax.op.add(lateral, up))
        up2 = relax.op.image.resize2d(merged, relax.ShapeExpr([4 * HEIGHT, 4 * WIDTH]), method="linear")
        return relax.op.concat([up2, p2], axis=1)

    mod = symbolic_module(fpn, {"top": (1, 8, HEIGHT, WIDTH), "lateral": (1, 8, 2 * HEIGHT, 2 * WIDTH),
                                "p2": (1, 4, 4 * HEIGHT, 4 * WIDTH)})
    report, log = pipeline_and_compare_at(mod, [(1, 1), (3, 17), (20, 9)])
    assert report.variants["resize_merge.add_relu"] == 1
    assert report.variants["resize_merge.concat2"] == 1
    assert list(log.values()) == ["Resize", "Resize"]


def test_must_not_fuse_a_resize_sized_by_vars_its_input_does_not_carry():
    """The size names the lateral's dims, not the input's: the kernel could only get them as a
    shape parameter, which LegalizeOps cannot lower for a resize."""
    from tvm import tirx
    from symbolic_helpers import HEIGHT, WIDTH
    lateral_h, lateral_w = tirx.Var("lateral_h", "int64"), tirx.Var("lateral_w", "int64")
    top = relax.Var("top", relax.TensorType((1, 8, HEIGHT, WIDTH), "float32"))
    lateral = relax.Var("lateral", relax.TensorType((1, 8, lateral_h, lateral_w), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [top, lateral]):
        with bb.dataflow():
            up = bb.emit(relax.op.image.resize2d(top, relax.ShapeExpr([lateral_h, lateral_w]), **NEAREST))
            out = bb.emit_output(relax.op.add(lateral, up))
        bb.emit_func_output(out)
    after, report = fuse(bb.get())
    assert not report.fired
    (miss,) = report.near_misses
    assert "uses lateral_h, lateral_w, which the resize input (1, 8, height, width) does not" in miss.reason


def test_must_not_fuse_an_add_of_another_symbolic_size():
    from tvm import tirx
    from symbolic_helpers import HEIGHT, WIDTH
    other = tirx.Var("other", "int64")
    top = relax.Var("top", relax.TensorType((1, 8, HEIGHT, WIDTH), "float32"))
    lateral = relax.Var("lateral", relax.TensorType((1, 8, 2 * HEIGHT, other), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [top, lateral]):
        with bb.dataflow():
            up = bb.emit(relax.op.image.resize2d(top, relax.ShapeExpr([2 * HEIGHT, 2 * WIDTH]), **NEAREST))
            out = bb.emit_output(relax.op.add(lateral, up))
        bb.emit_func_output(out)
    after, report = fuse(bb.get())
    assert not report.fired
    assert any("the add broadcasts" in miss.reason for miss in report.near_misses)

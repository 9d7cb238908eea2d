"""ConvertConvsToBlockedLayout: dense conv chains in NCHW16c with transforms only at the edges."""

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from helpers import EXAMPLES, run_lowered
from tvm_fusion import api
from tvm_fusion.passes.blocked_layout import ConvertConvsToBlockedLayout
from tvm_fusion.patterns import PatternReport


def convert(mod, block=16, depthwise=False):
    report = PatternReport()
    return ConvertConvsToBlockedLayout(block, report, depthwise)(mod), report


def test_a_conv_chain_converts_with_one_transform_at_each_end():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 16, 8, 8), "float32"), w1: R.Tensor((32, 16, 3, 3), "float32"),
                 w2: R.Tensor((16, 32, 1, 1), "float32")):
            with R.dataflow():
                lv = R.nn.conv2d(x, w1, padding=[1, 1, 1, 1])
                lv1 = R.nn.relu(lv)
                gv = R.nn.conv2d(lv1, w2)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 16, 8, 8), "float32"), w1: R.Tensor((32, 16, 3, 3), "float32"),
                 w2: R.Tensor((16, 32, 1, 1), "float32")) -> R.Tensor((1, 16, 8, 8), "float32"):
            with R.dataflow():
                x16 = R.layout_transform(x, index_map=T.index_map(lambda n, c, h, w: (n, c // 16, h, w, c % 16), index_dtype="int32"))
                w1_16 = R.layout_transform(w1, index_map=T.index_map(
                    lambda o, i, h, w: (o // 16, i // 16, h, w, i % 16, o % 16), index_dtype="int32"))
                lv = R.nn.conv2d(x16, w1_16, padding=[1, 1, 1, 1], data_layout="NCHW16c",
                                 kernel_layout="OIHW16i16o", out_layout="NCHW16c")
                lv1 = R.nn.relu(lv)
                w2_16 = R.layout_transform(w2, index_map=T.index_map(
                    lambda o, i, h, w: (o // 16, i // 16, h, w, i % 16, o % 16), index_dtype="int32"))
                lv2 = R.nn.conv2d(lv1, w2_16, data_layout="NCHW16c", kernel_layout="OIHW16i16o",
                                  out_layout="NCHW16c")
                gv = R.layout_transform(lv2, index_map=T.index_map(lambda n, c, h, w, b: (n, c * 16 + b, h, w), index_dtype="int32"))
                R.output(gv)
            return gv

    after, report = convert(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.variants["blocked_layout.conv2d"] == 2


def test_a_depthwise_conv_converts_with_its_filters_blocked():
    """With ``depthwise``, a depthwise conv on whole channel blocks takes NCHW16c with OIHW16o
    filters (one per channel, a block's filters side by side): the chain keeps one layout."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 16, 8, 8), "float32"), w1: R.Tensor((32, 16, 1, 1), "float32"),
                 w2: R.Tensor((32, 1, 3, 3), "float32")):
            with R.dataflow():
                lv = R.nn.conv2d(x, w1)
                gv = R.nn.conv2d(lv, w2, padding=[1, 1, 1, 1], groups=32)
                R.output(gv)
            return gv

    after, report = convert(Before, depthwise=True)
    convs = []
    relax.analysis.post_order_visit(after["main"].body, lambda e: convs.append(
        (str(e.attrs.data_layout), str(e.attrs.kernel_layout)))
        if isinstance(e, relax.Call) and e.op.name == "relax.nn.conv2d" else None)
    assert convs == [("NCHW16c", "OIHW16i16o"), ("NCHW16c", "OIHW16o")]
    assert report.variants["blocked_layout.conv2d"] == 2 and not report.near_misses

    # Switched off (blocked_depthwise = false in the config): the model stays in NCHW and says how.
    after, report = convert(Before)
    tvm.ir.assert_structural_equal(after, Before)
    (miss,) = report.near_misses
    assert "groups=32" in miss.reason and "blocked_depthwise = true" in miss.reason


def test_must_not_convert_around_a_grouped_conv_off_the_blocks():
    """Eight groups of 4 channels (their run-time weight cannot be merged into whole blocks):
    not depthwise, no blocked kernel; the model stays in NCHW."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 16, 8, 8), "float32"), w1: R.Tensor((32, 16, 1, 1), "float32"),
                 w2: R.Tensor((32, 4, 3, 3), "float32")):
            with R.dataflow():
                lv = R.nn.conv2d(x, w1)
                gv = R.nn.conv2d(lv, w2, padding=[1, 1, 1, 1], groups=8)
                R.output(gv)
            return gv

    after, report = convert(Before)
    tvm.ir.assert_structural_equal(after, Before)
    (miss,) = report.near_misses
    assert "groups=8" in miss.reason and "grouped" in miss.reason and "stays in NCHW" in miss.reason
    after, _ = convert(Before, depthwise=True)
    tvm.ir.assert_structural_equal(after, Before)


def test_a_grouped_conv_of_whole_blocks_converts_with_dense_block_filters():
    """Two groups of 16 channels: each output block reads its group's input block, with
    OIHW16i16o filters (the blocked dense kernel, ``_conv2d_nchwc`` with groups); outputs
    agree with the NCHW module to float rounding (sums of 144 products, up to about 20)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 16, 8, 8), "float32"), w1: R.Tensor((32, 16, 1, 1), "float32"),
                 w2: R.Tensor((32, 16, 3, 3), "float32")):
            with R.dataflow():
                lv = R.nn.conv2d(x, w1)
                gv = R.nn.conv2d(lv, w2, padding=[1, 1, 1, 1], groups=2)
                R.output(gv)
            return gv

    after, report = convert(Before)
    grouped = [e for e in _calls(after, "relax.nn.conv2d") if int(e.attrs.groups) == 2]
    assert [(str(e.attrs.data_layout), str(e.attrs.kernel_layout)) for e in grouped] == [("NCHW16c", "OIHW16i16o")]
    assert report.variants["blocked_layout.conv2d"] == 2 and not report.near_misses
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(shape).astype("float32") for shape in ((1, 16, 8, 8), (32, 16, 1, 1), (32, 16, 3, 3))]
    np.testing.assert_allclose(run_lowered(after, *args), run_lowered(Before, *args), rtol=1e-4, atol=1e-4)


def _calls(mod, op_name):
    found = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and getattr(e.op, "name", None) == op_name else None)
    return found


def test_an_rgb_stem_reads_nchw_and_writes_the_blocked_layout():
    """Three input channels are off the block, 16 output channels are not: the stem reads the
    NCHW image and writes NCHW16c, so no transform copies its output map."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 3, 8, 8), "float32"), w1: R.Tensor((16, 3, 3, 3), "float32"),
                 w2: R.Tensor((16, 16, 3, 3), "float32")):
            with R.dataflow():
                lv = R.nn.conv2d(x, w1, padding=[1, 1, 1, 1])
                gv = R.nn.conv2d(lv, w2, padding=[1, 1, 1, 1])
                R.output(gv)
            return gv

    after, report = convert(Before)
    assert conv_layouts(after) == ["NCHW", "NCHW16c"]
    assert conv_layouts(after, "out_layout") == ["NCHW16c", "NCHW16c"]
    assert conv_layouts(after, "kernel_layout") == ["OIHW16o", "OIHW16i16o"]
    assert transforms_of_maps(after) == 1  # the output back to NCHW
    assert report.variants["blocked_layout.conv2d"] == 2 and not report.near_misses


def conv_layouts(mod, attr: str = "data_layout") -> list[str]:
    layouts = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: layouts.append(str(getattr(e.attrs, attr)))
                                    if isinstance(e, relax.Call) and e.op.name == "relax.nn.conv2d" else None)
    return layouts


def assert_same_outputs(before, after, tolerance: float) -> None:
    """Both modules lowered and run on the same random input and weights (scaled like trained
    ones, so that activations stay of order 1)."""
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(d) for d in param.ty.shape]).astype("float32") * (0.1 if index else 1)
            for index, param in enumerate(before["main"].params)]
    np.testing.assert_allclose(run_lowered(after, *args), run_lowered(before, *args), rtol=tolerance, atol=tolerance)


def transforms_of_maps(mod) -> int:
    """Layout transforms of feature maps (not of weights, which fold away)."""
    found = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and e.op.name == "relax.layout_transform" and not any(
                                        p.same_as(e.args[0]) and str(p.name).startswith("w") for p in mod["main"].params)
                                    else None)
    return len(found)


def test_convs_off_the_block_stay_in_nchw_and_the_convs_around_them_convert():
    """A one-channel region in the middle (padding 16 -> 1 with 3x3 filters would cost more
    than the transforms): its two convs stay in NCHW (a near miss naming them), the conv before
    it is blocked, the one after it reads NCHW and writes blocks, and the outputs do not change."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 16, 8, 8), "float32"), w1: R.Tensor((16, 16, 3, 3), "float32"),
                 w2: R.Tensor((1, 16, 3, 3), "float32"), w3: R.Tensor((1, 1, 3, 3), "float32"),
                 w4: R.Tensor((16, 1, 1, 1), "float32")):
            with R.dataflow():
                lv1 = R.nn.relu(R.nn.conv2d(x, w1, padding=[1, 1, 1, 1]))
                lv2 = R.nn.relu(R.nn.conv2d(lv1, w2, padding=[1, 1, 1, 1]))
                lv3 = R.nn.relu(R.nn.conv2d(lv2, w3, padding=[1, 1, 1, 1]))
                gv = R.nn.conv2d(lv3, w4)
                R.output(gv)
            return gv

    after, report = convert(Before)
    assert conv_layouts(after) == ["NCHW16c", "NCHW", "NCHW", "NCHW"]
    assert conv_layouts(after, "out_layout") == ["NCHW16c", "NCHW", "NCHW", "NCHW16c"]
    assert report.variants["blocked_layout.conv2d"] == 2
    (miss,) = report.near_misses
    assert miss.reason.startswith("2 conv(s) stay in NCHW, their channels not multiples of 16")
    assert "16 -> 1 channels on (1, 16, 8, 8); 1 -> 1 channels on (1, 1, 8, 8)" in miss.reason
    assert_same_outputs(Before, after, tolerance=1e-4)


@pytest.mark.parametrize("block", [8, 16])
def test_a_transposed_conv_after_a_blocked_conv_reads_nchw(block):
    """TVM's layout inference fails on a conv2d_transpose reading blocks (dbnet's head on
    AVX2's 8-channel blocks kept the whole model in NCHW): the conv before it is blocked, the
    transposed conv reads NCHW, and the outputs do not change."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 16, 8, 8), "float32"), w1: R.Tensor((16, 16, 3, 3), "float32"),
                 wt: R.Tensor((16, 4, 2, 2), "float32")):
            with R.dataflow():
                lv1 = R.nn.relu(R.nn.conv2d(x, w1, padding=[1, 1, 1, 1]))
                gv = R.nn.conv2d_transpose(lv1, wt, strides=[2, 2])
                R.output(gv)
            return gv

    after, report = convert(Before, block=block)
    assert conv_layouts(after) == [f"NCHW{block}c"]
    transposed = []
    relax.analysis.post_order_visit(after["main"].body, lambda e: transposed.append(str(e.attrs.data_layout))
                                    if isinstance(e, relax.Call) and e.op.name == "relax.nn.conv2d_transpose" else None)
    assert transposed == ["NCHW"]
    assert report.variants["blocked_layout.conv2d"] == 1 and not report.near_misses
    assert_same_outputs(Before, after, tolerance=1e-4)


def test_convs_before_a_stack_of_stacks_convert_and_the_stacks_stay():
    """A CRNN: convs, then an LSTM's outputs stacked over the steps and then over the two
    directions. TVM's layout inference fails on what a stack feeds (which kept such models in
    NCHW): the stacks pass it as concats and come back as stacks."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 16, 2, 4), "float32"), w: R.Tensor((16, 16, 3, 3), "float32")):
            with R.dataflow():
                conv = R.nn.relu(R.nn.conv2d(x, w, padding=[1, 1, 1, 1]))
                steps = R.reshape(R.permute_dims(conv, axes=[3, 0, 1, 2]), R.shape([4, 1, 32]))
                halves = R.split(steps, 2, axis=0)  # a call of tuple type on the way
                h0 = R.squeeze(R.strided_slice(halves[0], (0,), (0,), (1,)), axis=[0])
                h1 = R.squeeze(R.strided_slice(halves[1], (0,), (1,), (2,)), axis=[0])
                forward = R.stack((h0, h1), axis=0)
                backward = R.stack((h1, h0), axis=0)
                gv = R.stack((forward, backward), axis=-3)
                R.output(gv)
            return gv

    after, report = convert(Before, block=8)
    assert not report.near_misses
    assert conv_layouts(after) == ["NCHW8c"]
    ops = []
    relax.analysis.post_order_visit(after["main"].body, lambda e: ops.append(e.op.name)
                                    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    assert ops.count("relax.stack") == 3 and "relax.concat" not in ops and "relax.expand_dims" not in ops
    assert_same_outputs(Before, after, tolerance=1e-4)


@pytest.mark.parametrize("shape", ["input:1x3x64x64", "input:2x3x32x96"])
def test_resnet_in_blocked_layout_matches_onnx_runtime_and_nchw(shape):
    """Every conv after the stem runs as NCHW16c under its own schedule; outputs agree with
    ONNX Runtime and with the NCHW pipeline to float rounding (rtol 1e-4, atol 1e-5)."""
    from tvm_fusion.config import load_config
    from tvm_fusion.verify import reference_outputs

    host = load_config(None)
    config, nchw = (dataclasses.replace(host, conv_layout=layout) for layout in ("NCHWc", "NCHW"))
    model = EXAMPLES / "resnet_tiny.onnx"
    results = {}
    for name, cfg in (("blocked", config), ("nchw", nchw)):
        prepared = api.prepare(model, cfg, input_shapes=shape)
        optimized = api.optimize(prepared, tuning_log=False)
        vm = relax.VirtualMachine(api.build(optimized.module, cfg), tvm.cpu())
        rng = np.random.default_rng(0)
        inputs = {s.name: rng.standard_normal(s.shape).astype("float32") for s in prepared.inputs}
        results[name] = vm["main"](*[tvm.runtime.tensor(v) for v in inputs.values()]).numpy()
        if name == "blocked":
            rules = set(optimized.schedule_rules.values())
            assert optimized.report.variants["blocked_layout.conv2d"] == 20
            assert "Conv2dNCHWc" in rules and "Conv2dNCHW" not in rules and "Fallback" not in rules
            # The stem writes blocks; one transform out, before the classifier.
            assert len([k for k in optimized.schedule_rules if "layout_transform" in k]) == 1
            (expected,) = reference_outputs(prepared.onnx_model, inputs).values()
    np.testing.assert_allclose(results["blocked"], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(results["blocked"], results["nchw"], rtol=1e-4, atol=1e-5)


def test_a_model_without_convs_is_not_shown_to_layout_inference(monkeypatch):
    """TVM's layout inference crashes on some ops (a negative stack axis after an LSTM): a model
    with nothing to block never meets it."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 16), "float32")):
            with R.dataflow():
                gv = R.stack([R.matmul(x, w), x], axis=-1)
                R.output(gv)
            return gv

    def fail(*_args):
        raise AssertionError("ConvertLayout ran on a model without convs")

    monkeypatch.setattr(relax.transform, "ConvertLayout", fail)
    after, report = convert(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert report.near_misses == [] and not report.fired


def test_a_layout_inference_failure_keeps_nchw_and_says_why(monkeypatch):
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 16, 8, 8), "float32"), w: R.Tensor((16, 16, 3, 3), "float32")):
            with R.dataflow():
                gv = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
                R.output(gv)
            return gv

    def crash(*_args):
        raise IndexError("Index -1 out of bounds 4")

    monkeypatch.setattr(relax.transform, "ConvertLayout", crash)
    after, report = convert(Before)
    tvm.ir.assert_structural_equal(after, Before)
    (miss,) = report.near_misses
    assert miss.reason == "layout inference failed: Index -1 out of bounds 4"


def test_resnet_for_a_range_of_sizes_runs_blocked_and_matches_onnx_runtime_at_each():
    """Rows and columns symbolic: the same 20 convs take NCHW16c (the RGB stem as its output),
    every one under the blocked schedule (full pixel tiles, the last shifted back), at sizes a
    tile does not divide."""
    from tvm_fusion.config import load_config
    from tvm_fusion.verify import reference_outputs

    cfg = dataclasses.replace(load_config(None), conv_layout="NCHWc")
    prepared = api.prepare(EXAMPLES / "resnet_tiny.onnx", cfg, input_shapes="input:1x3x16..256x16..256")
    optimized = api.optimize(prepared, tuning_log=False)
    assert optimized.report.variants["blocked_layout.conv2d"] == 20 and not optimized.report.near_misses
    rules = optimized.schedule_rules
    assert [k for k, rule in rules.items() if "conv2d" in k and rule != "Conv2dNCHWc"] == []
    vm = relax.VirtualMachine(api.build(optimized.module, cfg), tvm.cpu())
    rng = np.random.default_rng(0)
    for height, width in [(16, 16), (17, 250), (99, 31)]:
        x = rng.standard_normal((1, 3, height, width)).astype("float32")
        (expected,) = reference_outputs(prepared.onnx_model, {"input": x}).values()
        np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), expected, rtol=1e-4, atol=1e-5)


def test_a_model_with_symbolic_channels_stays_in_nchw_and_says_why():
    """The channel blocks and the blocked weights are fixed at compile time."""
    from tvm import tirx

    channels, height = tirx.Var("channels", "int64"), tirx.Var("height", "int64")
    x = relax.Var("x", relax.TensorType((1, channels, height, 8), "float32"))
    w = relax.Var("w", relax.TensorType((32, channels, 3, 3), "float32"))
    w2 = relax.Var("w2", relax.TensorType((16, 32, 3, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, w2]):
        with bb.dataflow():
            first = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, w, padding=1)))
            out = bb.emit_output(relax.op.nn.conv2d(first, w2, padding=1))
        bb.emit_func_output(out)
    before = bb.get()
    after, report = convert(before)
    tvm.ir.assert_structural_equal(after, before)
    assert not report.fired
    (miss,) = report.near_misses
    assert miss.pattern == "blocked_layout"
    assert "symbolic batch or channels (1, channels, height, 8)" in miss.reason and "stays in NCHW" in miss.reason


def test_a_c2f_block_split_and_concat_stays_blocked():
    """YOLOv8's C2f: a channel split (which TVM's inference gets wrong: a slice of 0 channels),
    a conv on one half, a concat of all three: spelled as slices and sunk with the concat, the
    block runs in NCHW16c with one transform at each end, and the outputs do not change."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 16, 8, 8), "float32"), w1: R.Tensor((32, 16, 1, 1), "float32"),
                 w2: R.Tensor((16, 16, 3, 3), "float32"), w3: R.Tensor((16, 48, 1, 1), "float32")):
            with R.dataflow():
                lv = R.nn.silu(R.nn.conv2d(x, w1))
                parts = R.split(lv, indices_or_sections=[16], axis=1)
                first = parts[0]
                second = parts[1]
                lv2 = R.nn.silu(R.nn.conv2d(second, w2, padding=[1, 1, 1, 1]))
                gv = R.nn.conv2d(R.concat((first, second, lv2), axis=1), w3)
                R.output(gv)
            return gv

    after, report = convert(Before)
    assert report.variants["blocked_layout.conv2d"] == 3 and not report.near_misses
    assert transforms_of_maps(after) == 2
    assert_same_outputs(Before, after, tolerance=1e-5)


def test_a_layout_inference_failure_leaves_the_channels_unpadded(monkeypatch):
    """Padding is for the blocked layout only: when the model stays in NCHW it keeps its convs
    as they were (a padded conv would put a slice between it and its epilogue)."""
    x = relax.Var("x", relax.TensorType((1, 16, 8, 8), "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            lv = builder.emit(R.nn.relu(R.nn.conv2d(x, relax.const(np.ones((16, 16, 1, 1), "float32")))))
            out = builder.emit_output(R.nn.conv2d(lv, relax.const(np.ones((12, 16, 1, 1), "float32"))))
        builder.emit_func_output(out)
    before = builder.get()

    def crash(*_args):
        raise IndexError("Index -1 out of bounds 4")

    monkeypatch.setattr(relax.transform, "ConvertLayout", crash)
    after, report = convert(before)
    tvm.ir.assert_structural_equal(after, before)
    assert "blocked_layout.padded_channels" not in report.fired


def test_layout_inference_sees_main_only_as_far_as_a_conv_layout_reaches(monkeypatch):
    """TVM's ConvertLayout is quadratic in a function's bindings (an unrolled decoder after an
    encoder: minutes), so it sees ``main`` cut after the last op a conv's layout reaches
    through ops with a layout rule; the matmul chain after that is joined back unchanged."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 16, 4, 4), "float32"), w: R.Tensor((16, 16, 3, 3), "float32"),
                 m: R.Tensor((16, 16), "float32")):
            with R.dataflow():
                conv = R.nn.relu(R.nn.conv2d(x, w, padding=[1, 1, 1, 1]))
                rows = R.reshape(conv, R.shape([16, 16]))  # reshape has no layout rule: the reach ends
                step1 = R.tanh(R.matmul(rows, m))
                step2 = R.tanh(R.matmul(step1, m))
                step3 = R.tanh(R.matmul(step2, m))
                step4 = R.tanh(R.matmul(step3, m))
                gv = R.add(R.tanh(R.matmul(step4, m)), rows)
                R.output(gv)
            return gv

    seen = []
    convert_layout = relax.transform.ConvertLayout

    def recording(*args, **kwargs):
        layout_pass = convert_layout(*args, **kwargs)

        def run(mod):
            seen.append(len(mod["main"].body.blocks[0].bindings))
            return layout_pass(mod)

        return run

    monkeypatch.setattr(relax.transform, "ConvertLayout", recording)
    after, report = convert(Before, block=8)
    assert not report.near_misses
    assert conv_layouts(after) == ["NCHW8c"]
    assert seen == [2 + 1]  # conv and relu, and an alias of relu's result: the one value the rest reads
    assert_same_outputs(Before, after, tolerance=1e-4)

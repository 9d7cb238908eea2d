"""sink_transforms_to_nchw: an FPN merge between blocked convs stays blocked."""

import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from helpers import run_lowered
from tvm_fusion.passes.sink_layout_transforms import sink_transforms_to_nchw


@I.ir_module
class TopDownMerge:
    """``to_blocked(concat(resize(to_nchw(p5)), to_nchw(p4)))``, as layout inference leaves it."""

    @R.function
    def main(p5: R.Tensor((1, 2, 4, 4, 16), "float32"), p4: R.Tensor((1, 1, 8, 8, 16), "float32")):
        with R.dataflow():
            a = R.layout_transform(p5, index_map=T.index_map(lambda n, c, h, w, b: (n, c * 16 + b, h, w), index_dtype="int32"))
            b = R.layout_transform(p4, index_map=T.index_map(lambda n, c, h, w, b: (n, c * 16 + b, h, w), index_dtype="int32"))
            up = R.image.resize2d(a, R.shape([8, 8]), method="nearest_neighbor",
                                  coordinate_transformation_mode="asymmetric", rounding_method="floor")
            merged = R.concat((up, b), axis=1)
            gv = R.layout_transform(merged, index_map=T.index_map(lambda n, c, h, w: (n, c // 16, h, w, c % 16), index_dtype="int32"))
            R.output(gv)
        return gv


@I.ir_module
class MergedBlocked:
    @R.function
    def main(p5: R.Tensor((1, 2, 4, 4, 16), "float32"), p4: R.Tensor((1, 1, 8, 8, 16), "float32")):
        with R.dataflow():
            up = R.image.resize2d(p5, R.shape([8, 8]), layout="NCHW16c", method="nearest_neighbor",
                                  coordinate_transformation_mode="asymmetric", rounding_method="floor")
            merged = R.concat((up, p4), axis=1)
            gv = merged  # the graph output keeps its own variable
            R.output(gv)
        return gv


def test_the_merge_runs_blocked_and_every_transform_cancels():
    after = sink_transforms_to_nchw(TopDownMerge)
    tvm.ir.assert_structural_equal(after, MergedBlocked)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((1, 2, 4, 4, 16)).astype("float32"), rng.standard_normal((1, 1, 8, 8, 16)).astype("float32")]
    np.testing.assert_array_equal(run_lowered(after, *args), run_lowered(TopDownMerge, *args))


def test_a_concat_with_an_nchw_input_keeps_its_transforms():
    """Must not sink: one concat input is a plain NCHW map (its channels need not be whole
    blocks), so the concat stays in NCHW and nothing changes."""

    @I.ir_module
    class Mixed:
        @R.function
        def main(p5: R.Tensor((1, 2, 4, 4, 16), "float32"), lateral: R.Tensor((1, 8, 4, 4), "float32")):
            with R.dataflow():
                a = R.layout_transform(p5, index_map=T.index_map(lambda n, c, h, w, b: (n, c * 16 + b, h, w), index_dtype="int32"))
                gv = R.concat((a, lateral), axis=1)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(sink_transforms_to_nchw(Mixed), Mixed)


@I.ir_module
class SqueezeExcitationTail:
    """A HardSwish (clip), a [1]-shaped affine scale, an SE block's pool and ``map * gate``, as
    layout inference leaves them: each sent back to NCHW."""

    @R.function
    def main(x: R.Tensor((1, 2, 4, 4, 16), "float32"), scale: R.Tensor((1,), "float32")):
        with R.dataflow():
            a = R.layout_transform(x, index_map=T.index_map(lambda n, c, h, w, b: (n, c * 16 + b, h, w), index_dtype="int32"))
            gate = R.clip(R.add(R.multiply(a, R.const(0.1666, "float32")), R.const(0.5, "float32")), 0, 1)
            swished = R.multiply(R.multiply(a, gate), scale)
            pooled = R.mean(swished, axis=[2, 3], keepdims=True)
            scaled = R.multiply(swished, R.sigmoid(pooled))
            gv = R.layout_transform(scaled, index_map=T.index_map(lambda n, c, h, w: (n, c // 16, h, w, c % 16), index_dtype="int32"))
            R.output(gv)
        return gv


@I.ir_module
class SqueezeExcitationBlocked:
    @R.function
    def main(x: R.Tensor((1, 2, 4, 4, 16), "float32"), scale: R.Tensor((1,), "float32")):
        with R.dataflow():
            third = R.multiply(x, R.const(0.1666, "float32"))
            shifted = R.add(third, R.const(0.5, "float32"))
            gate = R.clip(shifted, 0, 1)
            swish = R.multiply(x, gate)
            swished = R.multiply(swish, scale)
            pooled = R.mean(swished, axis=[2, 3], keepdims=True)
            squashed = R.sigmoid(pooled)
            scaled = R.multiply(swished, squashed)
            gv = scaled  # the graph output keeps its own variable
            R.output(gv)
        return gv


def test_element_wise_ops_pools_and_gates_run_blocked():
    after = sink_transforms_to_nchw(SqueezeExcitationTail)
    tvm.ir.assert_structural_equal(after, SqueezeExcitationBlocked)
    rng = np.random.default_rng(1)
    args = [rng.standard_normal((1, 2, 4, 4, 16)).astype("float32"), np.array([0.7], "float32")]
    np.testing.assert_allclose(run_lowered(after, *args), run_lowered(SqueezeExcitationTail, *args), rtol=1e-6)


def test_a_broadcast_across_channels_keeps_its_transform():
    """Must not sink: ``map * row`` broadcasts a [1, 1, 4, 4] map over the channels, which the
    blocked layout would not."""

    @I.ir_module
    class AcrossChannels:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4, 16), "float32"), y: R.Tensor((1, 1, 4, 4, 16), "float32")):
            with R.dataflow():
                a = R.layout_transform(x, index_map=T.index_map(lambda n, c, h, w, b: (n, c * 16 + b, h, w), index_dtype="int32"))
                b = R.layout_transform(y, index_map=T.index_map(lambda n, c, h, w, b: (n, c * 16 + b, h, w), index_dtype="int32"))
                row = R.strided_slice(b, [1], [0], [1])
                gv = R.multiply(a, row)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(sink_transforms_to_nchw(AcrossChannels), AcrossChannels)


def _requantized_between_convs(scale):
    """A QDQ model's layers as layout inference leaves them: back to NCHW for the
    requantization's clip, QuantizeLinear/DequantizeLinear, and blocked again for the next conv."""

    @I.ir_module
    class Requantized:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4, 16), "float32")):
            with R.dataflow():
                a = R.layout_transform(x, index_map=T.index_map(lambda n, c, h, w, b: (n, c * 16 + b, h, w), index_dtype="int32"))
                q = R.astype(R.clip(a, 0, 255), "uint8")
                d = R.dequantize(q, scale, R.const(3, "uint8"), axis=1)
                again = R.quantize(d, R.const(0.25, "float32"), R.const(7, "uint8"), axis=1, out_dtype="uint8")
                back = R.astype(again, "float32")
                gv = R.layout_transform(back, index_map=T.index_map(lambda n, c, h, w: (n, c // 16, h, w, c % 16), index_dtype="int32"))
                R.output(gv)
            return gv

    return Requantized


def test_quantize_and_dequantize_by_scalars_run_blocked():
    before = _requantized_between_convs(R.const(0.5, "float32"))
    after = sink_transforms_to_nchw(before)
    assert "layout_transform" not in after["main"].script()
    x = (np.random.default_rng(2).standard_normal((1, 2, 4, 4, 16)) * 300).round().astype("float32")
    np.testing.assert_array_equal(run_lowered(after, x), run_lowered(before, x))


def test_must_not_sink_a_dequantize_by_channel():
    """A scale per channel of the NCHW map has no blocked twin here: the transforms stay."""
    before = _requantized_between_convs(R.const(np.linspace(0.1, 1, 32, dtype="float32")))
    after = sink_transforms_to_nchw(before)
    assert after["main"].script().count("layout_transform") == 2


@I.ir_module
class CircularPadBetweenConvs:
    """A circular pad of a blocked map's columns (Slice + Concat), as layout inference leaves it:
    back to NCHW for the slices, the padded map blocked again for the next conv."""

    @R.function
    def main(x: R.Tensor((1, 2, 1, 10, 16), "float32")):
        with R.dataflow():
            a = R.layout_transform(x, index_map=T.index_map(lambda n, c, h, w, b: (n, c * 16 + b, h, w), index_dtype="int32"))
            tail = R.strided_slice(a, [3], [8], [10])
            head = R.strided_slice(a, [-1], [0], [2])
            padded = R.concat((tail, a, head), axis=3)
            gv = R.layout_transform(padded, index_map=T.index_map(lambda n, c, h, w: (n, c // 16, h, w, c % 16), index_dtype="int32"))
            R.output(gv)
        return gv


def test_a_circular_pad_of_columns_runs_blocked():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 1, 10, 16), "float32")):
            with R.dataflow():
                tail = R.strided_slice(x, [3], [8], [10])
                head = R.strided_slice(x, [3], [0], [2])
                padded = R.concat((tail, x, head), axis=3)
                gv = padded
                R.output(gv)
            return gv

    after = sink_transforms_to_nchw(CircularPadBetweenConvs)
    tvm.ir.assert_structural_equal(after, Expected)
    x = np.random.default_rng(0).standard_normal((1, 2, 1, 10, 16)).astype("float32")
    np.testing.assert_array_equal(run_lowered(after, x), run_lowered(CircularPadBetweenConvs, x))


def test_must_not_sink_a_slice_of_some_channels_of_a_block():
    """Channels 0..8 of a 16-channel block are not a slice of whole blocks: kept in NCHW."""
    @I.ir_module
    class PartBlock:
        @R.function
        def main(x: R.Tensor((1, 2, 1, 10, 16), "float32")):
            with R.dataflow():
                a = R.layout_transform(x, index_map=T.index_map(lambda n, c, h, w, b: (n, c * 16 + b, h, w), index_dtype="int32"))
                gv = R.strided_slice(a, [1], [0], [8])
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(sink_transforms_to_nchw(PartBlock), PartBlock)

"""pad_conv_channels: convs off the channel block computed on whole blocks, where that is cheap."""

import numpy as np
import tvm
from tvm import relax
from tvm.relax.op import add, divide, nn

from helpers import run_lowered

from tvm_fusion.passes.pad_conv_channels import pad_conv_channels

RNG = np.random.default_rng(0)


def const(*shape):
    return relax.const((RNG.standard_normal(shape) * 0.3).astype("float32"))


def module(x_shape, body):
    """``main(x)`` returning ``body(builder, x)``, weights as constants (padding needs them)."""
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            out = builder.emit_output(body(builder, x))
        builder.emit_func_output(out)
    return builder.get()


def calls(mod, op_name):
    found = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and getattr(e.op, "name", None) == op_name else None)
    return found


def conv_map(x, channels):
    """A conv on whole blocks in front: the conv under test then reads a map of the conv region."""
    return nn.relu(nn.conv2d(x, const(channels, channels, 1, 1)))


def padded(mod, block=16):
    return pad_conv_channels(tvm.IRModule(dict(mod.functions)), block)


def assert_same_outputs(before, after, x_shape):
    x = RNG.standard_normal(x_shape).astype("float32")
    np.testing.assert_allclose(run_lowered(after, x), run_lowered(before, x), rtol=1e-5, atol=1e-5)


def test_a_conv_off_the_block_is_padded_and_the_next_conv_reads_the_padded_map():
    """16 -> 12 -> 16: the first conv gets 4 zero filters, its bias and relu run on 16 channels,
    the second conv zero input filters for them; no slice is left and the outputs agree."""
    before = module((1, 16, 8, 8), lambda b, x: nn.conv2d(
        nn.relu(add(nn.conv2d(conv_map(x, 16), const(12, 16, 3, 3), padding=1), const(1, 12, 1, 1))),
        const(16, 12, 3, 3), padding=1))
    after, count = padded(before)
    assert count == 2
    _, first, second = calls(after, "relax.nn.conv2d")
    assert tuple(first.args[1].value.shape) == (16, 16, 3, 3) and tuple(second.args[1].value.shape) == (16, 16, 3, 3)
    assert not first.args[1].value.numpy()[12:].any() and not second.args[1].value.numpy()[:, 12:].any()
    (bias,) = [arg for call in calls(after, "relax.add") for arg in call.args if isinstance(arg, tvm.ir.GenericConst)]
    assert tuple(bias.value.shape) == (1, 16, 1, 1)
    assert not calls(after, "relax.strided_slice")
    assert_same_outputs(before, after, (1, 16, 8, 8))


def test_readers_that_are_not_per_channel_read_the_real_channels_through_a_slice():
    """A YOLO head (96 -> 1 objectness, 1x1) padded to a block; the graph output is its first
    channel, sliced back."""
    before = module((1, 96, 6, 6), lambda b, x: relax.op.sigmoid(add(nn.conv2d(conv_map(x, 96), const(1, 96, 1, 1)),
                                                                          const(1, 1, 1, 1))))
    after, count = padded(before)
    assert count == 1
    (slice_call,) = calls(after, "relax.strided_slice")
    assert [int(v) for v in slice_call.args[3]] == [1]  # (data, axes, begin, end)
    assert tuple(int(d) for d in after["main"].ret_ty.shape) == (1, 1, 6, 6)
    assert_same_outputs(before, after, (1, 96, 6, 6))


def test_a_division_by_the_padded_map_reads_the_slice():
    """Must not pad through: ``c / conv`` would divide by the padded channels' zeros."""
    before = module((1, 16, 4, 4), lambda b, x: divide(const(1, 12, 1, 1), relax.op.sigmoid(
        nn.conv2d(conv_map(x, 16), const(12, 16, 1, 1)))))
    after, count = padded(before)
    assert count == 1
    (division,) = calls(after, "relax.divide")
    assert tuple(int(d) for d in division.args[1].ty.shape) == (1, 12, 4, 4)
    assert_same_outputs(before, after, (1, 16, 4, 4))


def test_padding_that_costs_more_than_a_transform_is_declined():
    """Must not pad: a 3x3 conv 16 -> 1 would do 15 x 144 extra multiply-adds per input element."""
    before = module((1, 16, 8, 8), lambda b, x: nn.conv2d(conv_map(x, 16), const(1, 16, 3, 3), padding=1))
    after, count = padded(before)
    assert count == 0
    tvm.ir.assert_structural_equal(after, before)


def test_a_conv_reading_a_map_from_outside_the_conv_region_is_not_padded():
    """Must not pad: a head conv on a softmax (YOLOv8's DFL) or on the graph input would need a
    transform into the blocked layout in front of it."""
    for body in (lambda b, x: nn.conv2d(relax.op.nn.softmax(x, axis=1), const(1, 16, 1, 1)),
                 lambda b, x: nn.conv2d(x, const(12, 16, 1, 1))):
        before = module((1, 16, 4, 4), body)
        after, count = padded(before)
        assert count == 0
        tvm.ir.assert_structural_equal(after, before)


def test_convs_on_whole_blocks_are_left_alone():
    before = module((1, 16, 8, 8), lambda b, x: nn.relu(nn.conv2d(x, const(32, 16, 3, 3), padding=1)))
    after, count = padded(before)
    assert count == 0
    tvm.ir.assert_structural_equal(after, before)


def test_a_concat_of_padded_halves_keeps_each_half_in_its_blocks():
    """A CSP block's two 24-channel halves (each padded to 32) concatenated and read by a conv:
    the concat joins the padded maps (64 channels, real ones at 0..23 and 32..55) and the conv's
    input filters are spread to match; no slice or gather is left."""

    def body(b, x):
        region = conv_map(x, 16)
        halves = [nn.relu(nn.conv2d(region, const(24, 16, 1, 1))) for _ in range(2)]
        return nn.conv2d(relax.op.concat(halves, axis=1), const(16, 48, 1, 1))

    before = module((1, 16, 6, 6), body)
    after, count = padded(before)
    assert count == 3
    (concat,) = calls(after, "relax.concat")
    assert tuple(int(d) for d in concat.ty.shape) == (1, 64, 6, 6)
    filters = calls(after, "relax.nn.conv2d")[-1].args[1].value.numpy()
    assert filters.shape == (16, 64, 1, 1) and not filters[:, 24:32].any() and not filters[:, 56:].any()
    assert not calls(after, "relax.strided_slice")
    assert_same_outputs(before, after, (1, 16, 6, 6))


def test_a_concat_read_by_a_reshape_slices_the_real_channels_back_together():
    """After a concat of padded maps the real channels are not in front: a reader that is not
    per-channel gets them as a concat of one slice per run (injective, so it fuses)."""

    def body(b, x):
        region = conv_map(x, 16)
        halves = [nn.relu(nn.conv2d(region, const(24, 16, 1, 1))) for _ in range(2)]
        return relax.op.reshape(relax.op.concat(halves, axis=1), (1, 48 * 36))

    before = module((1, 16, 6, 6), body)
    after, _ = padded(before)
    runs = [([int(v) for v in s.args[2]], [int(v) for v in s.args[3]]) for s in calls(after, "relax.strided_slice")]
    assert sorted(runs) == [([0], [24]), ([32], [56])]
    assert_same_outputs(before, after, (1, 16, 6, 6))


def test_an_se_block_and_a_resize_run_on_the_padded_map():
    """16 -> 24 (padded to 32), upsampled, its SE gate (global pool, squeeze conv 24 -> 8,
    padded too, excitation 8 -> 24) scaling it: the pool, the squeeze conv and the resize read
    the padded maps, and only the graph output slices the real channels back."""

    def body(b, x):
        wide = nn.relu(nn.conv2d(conv_map(x, 16), const(24, 16, 1, 1)))
        pooled = relax.op.mean(wide, axis=[2, 3], keepdims=True)
        gate = relax.op.sigmoid(nn.conv2d(nn.relu(nn.conv2d(pooled, const(8, 24, 1, 1))), const(24, 8, 1, 1)))
        return relax.op.image.resize2d(relax.op.multiply(wide, gate), (8, 8), method="nearest_neighbor")

    before = module((1, 16, 4, 4), body)
    after, count = padded(before)
    assert count == 3  # 16 -> 24, the squeeze conv 24 -> 8 and the excitation conv 8 -> 24
    (mean,) = calls(after, "relax.mean")
    (resize,) = calls(after, "relax.image.resize2d")
    assert int(mean.args[0].ty.shape[1]) == 32 and int(resize.args[0].ty.shape[1]) == 32
    (slice_call,) = calls(after, "relax.strided_slice")
    assert [int(v) for v in slice_call.args[3]] == [24]
    assert_same_outputs(before, after, (1, 16, 4, 4))


def test_a_depthwise_conv_of_a_padded_map_runs_padded():
    """16 -> 24 (padded to 32) -> depthwise 3x3 over 24 channels -> 24 -> 16: the depthwise conv
    gets a zero filter per padded channel (32 groups), so MobileNet's expansions stay blocked."""
    before = module((1, 16, 6, 6), lambda b, x: nn.conv2d(
        nn.conv2d(nn.relu(nn.conv2d(conv_map(x, 16), const(24, 16, 1, 1))), const(24, 1, 3, 3), padding=1, groups=24),
        const(16, 24, 1, 1)))
    after, count = padded(before)
    assert count == 3
    depthwise = next(call for call in calls(after, "relax.nn.conv2d") if int(call.attrs.groups) != 1)
    assert int(depthwise.attrs.groups) == 32 and tuple(depthwise.args[1].value.shape) == (32, 1, 3, 3)
    assert not depthwise.args[1].value.numpy()[24:].any()
    assert not calls(after, "relax.strided_slice")
    assert_same_outputs(before, after, (1, 16, 6, 6))


def test_must_not_pad_a_depthwise_conv_of_a_map_that_is_not_padded():
    """The depthwise conv reads the graph input (24 channels): nothing to follow, left as it is."""
    before = module((1, 24, 6, 6), lambda b, x: nn.conv2d(x, const(24, 1, 3, 3), padding=1, groups=24))
    after, count = padded(before)
    assert count == 0
    tvm.ir.assert_structural_equal(after, before)


def _requantized(x, scale):
    """A QDQ model's layer output as the import writes it: the conv's requantization (round,
    shift, clip, cast to uint8), DequantizeLinear and QuantizeLinear by ``scale`` (one number,
    or one per channel), and the next conv's input ``float32(q) - 3``."""
    q = relax.op.astype(relax.op.clip(add(relax.op.round(relax.op.multiply(x, relax.const(4.0))),
                                          relax.const(3.0)), 0, 255), "uint8")
    d = relax.op.dequantize(q, scale, relax.const(3, "uint8"), axis=1)
    again = relax.op.quantize(d, scale, relax.const(3, "uint8"), axis=1, out_dtype="uint8")
    return relax.op.subtract(relax.op.astype(again, "float32"), relax.const(3.0))


def test_a_quantized_models_layers_between_convs_run_padded():
    """16 -> 24 (padded to 32) -> requantization, DequantizeLinear, QuantizeLinear -> depthwise
    3x3 over 24 channels: a quantized MobileNet's expansion stays blocked, as the float one."""
    def body(b, x):
        expanded = b.normalize(_requantized(nn.conv2d(conv_map(x, 16), const(24, 16, 1, 1)), relax.const(0.25)))
        return nn.conv2d(expanded, const(24, 1, 3, 3), padding=1, groups=24)

    before = module((1, 16, 6, 6), body)
    after, count = padded(before)
    assert count == 2
    depthwise = next(call for call in calls(after, "relax.nn.conv2d") if int(call.attrs.groups) != 1)
    assert int(depthwise.attrs.groups) == 32
    assert_same_outputs(before, after, (1, 16, 6, 6))


def test_must_not_pad_through_a_dequantize_by_channel():
    """A scale per channel has no value for the padded channels: the depthwise conv is left
    alone (the expansion's slice feeds the per-channel layers)."""
    def body(b, x):
        scale = relax.const(np.linspace(0.1, 1, 24, dtype="float32"))
        expanded = b.normalize(_requantized(nn.conv2d(conv_map(x, 16), const(24, 16, 1, 1)), scale))
        return nn.conv2d(expanded, const(24, 1, 3, 3), padding=1, groups=24)

    before = module((1, 16, 6, 6), body)
    after, _ = padded(before)
    depthwise = next(call for call in calls(after, "relax.nn.conv2d") if int(call.attrs.groups) != 1)
    assert int(depthwise.attrs.groups) == 24
    assert_same_outputs(before, after, (1, 16, 6, 6))

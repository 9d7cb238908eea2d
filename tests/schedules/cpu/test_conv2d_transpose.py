"""Conv2dTranspose: polyphase (kernel == stride == 2) or dilated transposed conv, epilogue fused."""

import pytest
from loop_structure import largest_divisor, loop_kinds, whole_vectors
from tvm import relax
from tvm.relax.op import add, nn, sigmoid

from tvm_fusion.schedules import ApplySchedules
from tvm_fusion.schedules.cpu import Conv2dNCHW, Conv2dTranspose, conv2d_transpose


@pytest.mark.parametrize(
    "x, w, strides, padding, output_padding, groups, polyphase",
    [((1, 8, 6, 10), (8, 16, 2, 2), 2, 0, 0, 1, True),     # decoder upsampling 2x2/2
     ((2, 4, 5, 7), (4, 3, 2, 2), 2, 0, 0, 2, True),       # batch 2, grouped, odd sizes
     ((1, 6, 5, 6), (6, 4, 3, 3), 2, 1, 1, 1, False),      # 3x3/2 with output_padding
     ((1, 4, 7, 7), (4, 5, 3, 3), 1, 1, 0, 1, False),      # stride 1: no zeros to skip
     ((1, 4, 4, 5), (4, 3, 4, 4), 2, 1, 0, 2, False),      # 4x4/2, grouped
     ((1, 4, 6, 6), (4, 8, 2, 2), 2, [1, 0, 0, 1], 0, 1, False)],  # leading padding
)
def test_conv_transpose_bias_relu_matches_unscheduled(assert_schedule_matches, lanes, monkeypatch, x, w, strides,
                                                      padding, output_padding, groups, polyphase):
    taken = []
    monkeypatch.setattr(conv2d_transpose, "_schedule_polyphase",
                        _recording(conv2d_transpose._schedule_polyphase, taken))

    def block(x, w, b):
        conv = nn.conv2d_transpose(x, w, strides=strides, padding=padding,
                                   output_padding=output_padding, groups=groups)
        return nn.relu(add(conv, b))

    funcs = assert_schedule_matches(Conv2dTranspose(), block, rtol=1e-4, atol=1e-4, x=x, w=w,
                                    b=(1, w[1] * groups, 1, 1))
    assert bool(taken) == polyphase
    (func,) = funcs.values()
    channels = w[1] * groups
    if polyphase:
        assert_polyphase_tiles(func, lanes, x[0], channels, rows=x[2], columns=x[3])
    else:
        top, left, bottom, right = padding if isinstance(padding, list) else [padding] * 4
        rows = (x[2] - 1) * strides - top - bottom + w[2] + output_padding
        columns = (x[3] - 1) * strides - left - right + w[3] + output_padding
        assert_dilated_tiles(func, lanes, x[0], channels, rows, columns)


def assert_polyphase_tiles(func, lanes, batch, channels, rows, columns):
    """(batch x channel tiles x input rows) across cores; per tile up to 4 channels x 2 x 2
    phases x one vector of input columns (a divisor of the row when a vector does not divide
    it), vectorized in every partitioned copy, and stored as runs of both column phases."""
    cols = whole_vectors(columns, lanes, 1) or largest_divisor(columns, lanes)
    channel_tile = largest_divisor(channels, 4)
    loops = loop_kinds(func)
    assert loops.parallel == [batch * (channels // channel_tile) * rows]
    assert loops.vectorized[-1] == 2 * cols
    assert loops.vectorized[:-1] == [cols] * (len(loops.vectorized) - 1) and len(loops.vectorized) > 2
    assert channel_tile in loops.unrolled


def assert_dilated_tiles(func, lanes, batch, channels, rows, columns):
    """A parallel pass materializes the padded dilated map; then as Conv2dNCHW: output rows
    across cores, tiles of channels x up to 2 vectors of columns, channels unrolled."""
    cols = whole_vectors(columns, lanes, 2) or largest_divisor(columns, lanes)
    channel_tile = largest_divisor(channels, 16 // -(-cols // lanes))
    loops = loop_kinds(func)
    assert len(loops.parallel) == 2 and loops.parallel[-1] == batch * (channels // channel_tile) * rows
    assert loops.vectorized == [cols] * len(loops.vectorized) and len(loops.vectorized) >= 2
    assert channel_tile in loops.unrolled


def test_residual_and_sigmoid_epilogue(assert_schedule_matches, lanes):
    def block(x, w, r):
        return sigmoid(add(nn.relu(nn.conv2d_transpose(x, w, strides=2)), r))

    funcs = assert_schedule_matches(Conv2dTranspose(), block, rtol=1e-4, atol=1e-4, x=(1, 4, 5, 8),
                                    w=(4, 6, 2, 2), r=(1, 6, 10, 16))
    assert_polyphase_tiles(*funcs.values(), lanes, batch=1, channels=6, rows=5, columns=8)


def test_declines_plain_conv_and_elementwise(lowered, prim_funcs, target):
    conv = lowered(lambda x, w: nn.conv2d(x, w, padding=1), x=(1, 8, 10, 10), w=(8, 8, 3, 3))
    elementwise = lowered(lambda x, y: nn.relu(add(x, y)), x=(4, 32), y=(4, 32))
    for func in [*prim_funcs(conv).values(), *prim_funcs(elementwise).values()]:
        assert Conv2dTranspose().apply(func, target, False) is None


def test_conv_rule_declines_and_apply_schedules_picks_this_rule(lowered, prim_funcs, target):
    mod = lowered(lambda x, w: nn.conv2d_transpose(x, w, strides=2), x=(1, 4, 6, 6), w=(4, 4, 2, 2))
    (func,) = prim_funcs(mod).values()
    assert Conv2dNCHW().apply(func, target, False) is None  # flipped IOHW weight: not a plain conv
    log = {}
    scheduled = ApplySchedules(target, log=log)(mod)
    assert log == {"conv2d_transpose": "Conv2dTranspose"}
    assert isinstance(scheduled["main"], relax.Function)


def _recording(schedule, calls):
    def record(*args):
        calls.append(args)
        return schedule(*args)

    return record

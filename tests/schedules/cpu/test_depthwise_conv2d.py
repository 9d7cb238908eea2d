"""DepthwiseConv2d: one filter per channel, window unrolled over a vector tile of columns."""

import pytest
from loop_structure import blocks_in, blocks_under_parallel_loop, column_tile, loop_kinds
from tvm.relax.op import add, nn

from tvm_fusion.schedules.cpu import DepthwiseConv2d


@pytest.mark.parametrize(
    "shape, kernel, strides, padding",
    [((1, 16, 28, 28), 3, 1, 1), ((1, 96, 14, 14), 5, 2, 2), ((2, 24, 9, 13), 3, 2, 1), ((1, 8, 7, 7), 7, 1, 3),
     ((1, 8, 26, 52), 3, 1, 1)],
)
def test_depthwise_bias_relu_matches_unscheduled(assert_schedule_matches, lanes, shape, kernel, strides, padding):
    """Also: (batch x channel x band of output rows) across cores, at stride 1 each task padding
    the input rows it reads (at stride 2 a pad pass first, its columns split into phases), up to 4
    vectors of output columns per tile (the last tile of a row shifted back when no whole
    vectors divide it; a divisor of a row shorter than a vector),
    the window taps unrolled."""
    batch, channels, height, width = shape

    def block(x, w, b):
        return nn.relu(add(nn.conv2d(x, w, strides=strides, padding=padding, groups=channels), b))

    funcs = assert_schedule_matches(DepthwiseConv2d(), block, rtol=1e-4, atol=1e-4, x=shape,
                                    w=(channels, 1, kernel, kernel), b=(1, channels, 1, 1))
    (func,) = funcs.values()
    rows, columns = ((size + 2 * padding - kernel) // strides + 1 for size in (height, width))
    cols = column_tile(columns, lanes, 4)
    loops = loop_kinds(func)
    tasks = loops.parallel[-1]
    assert (batch * channels * rows) % tasks == 0 and tasks % (batch * channels) == 0
    if strides == 1:
        assert blocks_under_parallel_loop(func) == blocks_in(func)
    else:
        pad_rows = loops.parallel[0]
        assert len(loops.parallel) == 2 and pad_rows % (height + 2 * padding) == 0
    assert loops.vectorized == [cols] * len(loops.vectorized) and len(loops.vectorized) >= 2
    assert loops.unrolled.count(kernel) >= 2  # both window loops
    if strides == 2:  # the padded map's even and odd columns stored apart: contiguous taps
        assert [tuple(buf.shape[-2:-1]) for buf in func.body.block.alloc_buffers if buf.name == "pad_temp"] == [(2,)]


def test_declines_dense_conv(lowered, prim_funcs, target):
    mod = lowered(lambda x, w: nn.conv2d(x, w, padding=1), x=(1, 8, 10, 10), w=(8, 8, 3, 3))
    for func in prim_funcs(mod).values():
        assert DepthwiseConv2d().apply(func, target, False) is None

"""Conv2dNCHW: register-blocked direct conv with its epilogue fused per output tile."""

import pytest
import tvm
import tvm_ffi
from loop_structure import column_tile, largest_divisor, loop_kinds
from machine import host_target
from tvm import relax
from tvm.relax.op import add, matmul, nn

from tvm_fusion.schedules.cpu import Conv2dNCHW
from tvm_fusion.targets.target_info import num_cores, vector_registers

# Accumulator vectors a tile may hold: 16 of AVX-512's 32 registers, 12 of AVX2's 16.
ACCUMULATORS = min(16, vector_registers(tvm.target.Target(host_target())) - 4)
CORES = num_cores(tvm.target.Target(host_target()))


def output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def channel_tile(channels: int, widest: int, shifts: bool = True) -> int:
    """Output channels per tile: a divisor of the channels up to ``widest``; when that is
    narrower than ``widest`` and the widest tile, the last one shifted back, computes at
    most an eighth more channels (and ``shifts``: the conv has an epilogue), the widest."""
    divisor = largest_divisor(channels, widest)
    if shifts and divisor < widest < channels and -channels % widest * 8 <= channels:
        return widest
    return divisor


def rows_per_tile(rows: int, channel_tile: int, vectors: int) -> int:
    """Output rows a tile takes: where the accumulators hold at least 4 of a row's tiles (few
    channels), the largest divisor of the rows they hold, if at least 2; else 1."""
    row_tiles = ACCUMULATORS // (channel_tile * vectors)
    tile = largest_divisor(rows, row_tiles) if row_tiles >= 4 else 1
    return tile if tile >= 2 else 1


def assert_register_blocked(func, lanes, batch, channels, rows, columns, stride, padded):
    """Output rows (batch x channel tiles x rows) across cores; a tile of channels x columns,
    the columns whole vectors (two when the stride is 1; the last tile of a row shifted back
    when none divides it) or a divisor of a short row, the channels unrolled so that the tile
    holds at most ``ACCUMULATORS`` vectors (the last channel tile shifted back where no
    divisor comes close); the pad copy is a parallel pass of its own, and no tile is
    predicated."""
    split = stride == 2 and padded  # even and odd columns of the padded map stored apart
    cols = column_tile(columns, lanes, 2 if stride == 1 or split else 1)
    tile = channel_tile(channels, ACCUMULATORS // -(-cols // lanes))
    loops = loop_kinds(func)
    conv_rows = batch * -(-channels // tile) * (rows // rows_per_tile(rows, tile, -(-cols // lanes)))
    assert loops.parallel[-1] == conv_rows and len(loops.parallel) == (2 if padded else 1)
    assert loops.vectorized == [cols] * len(loops.vectorized) and len(loops.vectorized) >= 2
    assert tile in loops.unrolled
    assert "T.where" not in func.script()
    pads = [tuple(buf.shape) for buf in func.body.block.alloc_buffers if buf.name == "pad_temp"]
    assert len(pads) == (1 if padded else 0) and (not split or pads[0][-2] == 2)


@pytest.mark.parametrize(
    "x, w, strides, padding, dilation, groups",
    [((1, 16, 28, 28), (32, 16, 3, 3), 1, 1, 1, 1),     # 3x3, 2 vectors of columns
     ((1, 3, 30, 30), (16, 3, 3, 3), 2, 1, 1, 1),       # stem: 3 input channels, stride 2
     ((1, 24, 14, 14), (40, 24, 1, 1), 1, 0, 1, 1),     # 1x1, columns not a vector multiple: one row
     ((1, 24, 14, 14), (8, 24, 1, 1), 1, 0, 1, 1),      # too few channel tiles to drop the rows
     ((1, 48, 64, 72), (16, 48, 1, 1), 1, 0, 1, 1),     # a map past 512 KiB keeps its rows
     ((2, 8, 9, 11), (12, 4, 3, 3), 1, 2, 2, 2),        # batch 2, dilated, grouped, odd sizes
     ((1, 16, 7, 7), (24, 16, 5, 5), 2, 2, 1, 1),       # 5x5 stride 2 on a 7x7 map
     ((1, 12, 13, 13), (24, 12, 3, 3), 1, 1, 1, 1),     # 13 columns: vectors, the last one shifted back
     ((1, 12, 26, 26), (12, 12, 3, 3), 1, 1, 1, 1),     # 26 columns
     # ShuffleNet's 1x1 convs: 58, 116 and 232 channels (2 x 29, 4 x 29, 8 x 29), the last
     # channel tile shifted back
     ((1, 58, 28, 28), (58, 58, 1, 1), 1, 0, 1, 1),
     ((1, 116, 14, 14), (116, 116, 1, 1), 1, 0, 1, 1),
     ((1, 232, 7, 7), (232, 232, 1, 1), 1, 0, 1, 1)],
)
def test_conv_bias_relu_matches_unscheduled(assert_schedule_matches, lanes, x, w, strides, padding, dilation,
                                            groups):
    channels = w[0]

    def block(x, w, b):
        conv = nn.conv2d(x, w, strides=strides, padding=padding, dilation=dilation, groups=groups)
        return nn.relu(add(conv, b))

    funcs = assert_schedule_matches(Conv2dNCHW(), block, rtol=1e-4, atol=1e-4, x=x, w=w, b=(1, channels, 1, 1))
    (func,) = funcs.values()
    rows, columns = (output_size(x[i], w[i], strides, padding, dilation) for i in (2, 3))
    if pixels_as_one_row(x, w, strides, padding, lanes):
        rows, columns = 1, rows * columns
    assert_register_blocked(func, lanes, x[0], channels, rows, columns, strides, padded=padding > 0)


def pixels_as_one_row(x, w, stride, padding, lanes) -> bool:
    """A 1x1 unit-stride conv without pad whose rows are not whole vectors, over a map of at
    most 512 KiB, with at least two channel tiles (of half the accumulators) per core: its
    pixels are tiled as one row."""
    tiles = x[0] * -(-w[0] // (ACCUMULATORS // 2))
    return (w[2:] == (1, 1) and stride == 1 and padding == 0 and x[2] > 1 and x[3] % lanes != 0
            and x[1] * x[2] * x[3] * 4 <= 512 * 1024 and tiles >= 2 * CORES)


def test_residual_and_hardswish_epilogue(assert_schedule_matches, lanes):
    def block(x, w, r):
        conv = nn.conv2d(x, w, padding=1)
        hardswish = relax.op.multiply(conv, relax.op.clip(relax.op.add(relax.op.multiply(
            conv, relax.const(1 / 6, "float32")), relax.const(0.5, "float32")), 0, 1))
        return nn.relu(add(hardswish, r))

    funcs = assert_schedule_matches(Conv2dNCHW(), block, rtol=1e-4, atol=1e-4, x=(1, 8, 12, 12),
                                    w=(8, 8, 3, 3), r=(1, 8, 12, 12))
    (func,) = funcs.values()
    assert_register_blocked(func, lanes, 1, 8, 12, 12, 1, padded=True)


def test_a_one_column_map_tiles_its_rows(assert_schedule_matches, lanes):
    """A 1-D conv exported as a 5x1 Conv2d over a 40x1 map: the vectors run down the rows."""
    funcs = assert_schedule_matches(Conv2dNCHW(), lambda x, w: nn.conv2d(x, w, padding=(2, 0)),
                                    rtol=1e-4, atol=1e-4, x=(1, 12, 40, 1), w=(20, 12, 5, 1))
    (func,) = funcs.values()
    rows = column_tile(40, lanes, 2)
    loops = loop_kinds(func)
    assert loops.vectorized and set(loops.vectorized) == {rows}
    assert loops.parallel[-1] == 20 // largest_divisor(20, ACCUMULATORS // -(-rows // lanes))


def test_a_conv_without_epilogue_keeps_a_channel_divisor(assert_schedule_matches, lanes):
    """Without an epilogue the conv accumulates in its output, which a shifted-back channel
    tile would share with the task before it: the tile stays a divisor of 116 channels (4 on
    AVX-512 and AVX2 alike, so the tile takes rows too)."""
    funcs = assert_schedule_matches(Conv2dNCHW(), nn.conv2d, rtol=1e-4, atol=1e-4,
                                    x=(1, 116, 14, 14), w=(116, 116, 1, 1))
    (func,) = funcs.values()
    cols = column_tile(14, lanes, 2)
    tile = channel_tile(116, ACCUMULATORS // -(-cols // lanes), shifts=False)
    assert loop_kinds(func).parallel[-1] == 116 // tile * (14 // rows_per_tile(14, tile, -(-cols // lanes)))
    assert tile in loop_kinds(func).unrolled and "T.min" not in func.script()


def test_declines_depthwise_and_matmul(lowered, prim_funcs, target):
    depthwise = lowered(lambda x, w: nn.conv2d(x, w, padding=1, groups=8), x=(1, 8, 10, 10), w=(8, 1, 3, 3))
    dense = lowered(matmul, x=(16, 32), w=(32, 16))
    for func in [*prim_funcs(depthwise).values(), *prim_funcs(dense).values()]:
        assert Conv2dNCHW().apply(func, target, False) is None


def test_a_large_map_takes_its_input_channels_in_chunks(assert_schedule_matches, lanes):
    """32 input channels x 3 kernel rows over a 48x48 map (each channel plane past a page; 48
    columns are whole vectors on AVX2 and AVX-512 alike, which chunking needs):
    the reduction runs in two passes of 16 channels over a row of accumulators kept in cache,
    the epilogue once per row; outputs unchanged."""
    funcs = assert_schedule_matches(Conv2dNCHW(), lambda x, w, b: nn.relu(add(nn.conv2d(x, w, padding=1), b)),
                                    rtol=1e-4, atol=1e-4, x=(1, 32, 48, 48), w=(16, 32, 3, 3), b=(1, 16, 1, 1))
    (func,) = funcs.values()
    extents = {}
    tvm_ffi.structural_walk(func.body, (tvm.tirx.For, lambda loop: extents.setdefault(loop.loop_var.name,
                                                                                     int(loop.extent))))
    assert extents.get("rc_0") == 2
    loops = loop_kinds(func)
    assert loops.parallel[-1] == 16 // largest_divisor(16, ACCUMULATORS // -(-column_tile(48, lanes, 2) // lanes)) * 48
    assert set(loops.vectorized) <= {column_tile(48, lanes, 2), lanes}


def test_a_few_channel_convs_tile_takes_several_rows(assert_schedule_matches, lanes):
    """A 1-channel head (basic-pitch's 32 -> 1 by 7 x 3): a row's tile holds 2 vectors of its one
    channel, so the tile takes the largest divisor of the 12 rows that the accumulators hold
    (6 on AVX-512 and AVX2 alike), each row's chain of FMAs beside the others; outputs unchanged."""
    funcs = assert_schedule_matches(Conv2dNCHW(), lambda x, w, b: nn.relu(add(nn.conv2d(x, w, padding=(3, 1)), b)),
                                    rtol=1e-4, atol=1e-4, x=(1, 32, 12, 40), w=(1, 32, 7, 3), b=(1, 1, 1, 1))
    (func,) = funcs.values()
    rows = rows_per_tile(12, 1, -(-column_tile(40, lanes, 2) // lanes))
    assert rows > 1
    loops = loop_kinds(func)
    assert loops.parallel[-1] == 12 // rows and rows in loops.unrolled

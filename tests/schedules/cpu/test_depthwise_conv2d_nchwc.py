"""DepthwiseConv2dNCHWc: one filter per channel in NCHW[x]c, a tile of pixels x one vector of channels."""

import numpy as np
import pytest
import tvm
from loop_structure import blocks_in, blocks_under_parallel_loop, float_lanes, loop_kinds, pixel_tile
from machine import host_target
from tvm import relax
from tvm.relax.op import add, nn

from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.schedules.cpu import Conv2dNCHWc, DepthwiseConv2d, DepthwiseConv2dNCHWc
from tvm_fusion.schedules.cpu.helpers import one_reduction_kernel, padded_band_rows

TARGET = tvm.target.Target(host_target())

BLOCK = float_lanes(TARGET)


def out_shape(x, kernel, stride, pad, dilation):
    size = [(x[i] + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1 for i in (2, 3)]
    return (x[0], x[1], *size, BLOCK)


def depthwise_kernel(x, kernel, stride=1, pad=0, dilation=1):
    """The one PrimFunc of ``relu(depthwise_conv2d(x, w) + b)`` in NCHW[BLOCK]c, OIHW[BLOCK]o."""
    shapes = {"x": x, "w": (x[1], 1, kernel, kernel, BLOCK), "b": (1, x[1], 1, 1, BLOCK)}
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in shapes.items()]
    builder = relax.BlockBuilder()
    with builder.function("main", params):
        with builder.dataflow():
            conv = nn.conv2d(params[0], params[1], strides=stride, padding=pad, dilation=dilation,
                             groups=x[1] * BLOCK, data_layout=f"NCHW{BLOCK}c", kernel_layout=f"OIHW{BLOCK}o")
            out = builder.emit_output(nn.relu(add(conv, params[2])))
        builder.emit_func_output(out)
    mod = tvm.transform.Sequential(lowering_passes())(builder.get())
    (func,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return func, shapes


@pytest.mark.parametrize("x, kernel, stride, pad, dilation", [
    ((1, 2, 14, 14, BLOCK), 3, 1, 1, 1),    # 3x3
    ((1, 3, 15, 15, BLOCK), 5, 2, 2, 1),    # 5x5 stride 2 on an odd map
    ((2, 1, 13, 13, BLOCK), 3, 1, 1, 1),    # batch 2, 13 pixels: overlapping tiles
    ((1, 2, 12, 12, BLOCK), 3, 1, 2, 2),    # dilated
    ((1, 1, 40, 1, BLOCK), 3, 1, 1, 1),     # one column
])
def test_depthwise_matches_the_unscheduled_kernel(target, run_kernel, x, kernel, stride, pad, dilation):
    """Also: (batch x channel blocks x bands of output rows) across cores, each task padding
    its own input rows (no pass over the whole map), a tile of pixels unrolled (a divisor of
    the row of 4 to 8, else 7 with the last tile shifted back), the channel block one vector,
    the window taps unrolled."""
    func, shapes = depthwise_kernel(x, kernel, stride, pad, dilation)
    sch = DepthwiseConv2dNCHWc().apply(func, target, False)
    assert sch is not None
    result_shape = out_shape(x, kernel, stride, pad, dilation)
    batch, blocks, rows, columns, _ = result_shape
    loops = loop_kinds(sch.mod["main"])
    (tasks,) = loops.parallel
    assert (batch * blocks * rows) % tasks == 0 and tasks % (batch * blocks) == 0
    assert blocks_under_parallel_loop(sch.mod["main"]) == blocks_in(sch.mod["main"])
    assert loops.vectorized == [BLOCK] * len(loops.vectorized) and len(loops.vectorized) >= 2
    assert pixel_tile(columns) in loops.unrolled and loops.unrolled.count(kernel) >= 2
    np.testing.assert_allclose(run_kernel(sch.mod["main"], shapes, result_shape),
                               run_kernel(func, shapes, result_shape), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("x, stride, cores, band", [
    ((1, 4, 160, 1280 // BLOCK - 2, BLOCK), 1, 2, 16),   # 5 KiB padded rows: the widest band
    ((1, 2, 600, 4096 // BLOCK - 2, BLOCK), 1, 2, 6),    # 16 KiB padded rows: 8 in cache, a band of 6
    ((1, 2, 600, 16384 // BLOCK - 2, BLOCK), 1, 2, 1),   # 64 KiB rows: not even 3 fit, one row a task
    ((1, 1, 8, 8, BLOCK), 1, 2, 1),                      # 8 rows, 1 block: one row a task for 2 cores
    ((1, 12, 14, 14, BLOCK), 1, 2, 14),                  # 12 blocks: a task per block is enough
    ((1, 1, 112, 4096 // BLOCK - 2, BLOCK), 2, 2, 2),    # stride 2: a band of b rows reads 2b + 1
])
def test_band_of_rows_fits_cache_and_shares_out(x, stride, cores, band):
    func, _ = depthwise_kernel(x, 3, stride, pad=1)
    kernel = one_reduction_kernel(func, TARGET)
    assert padded_band_rows(kernel.stmt, kernel.stmt.reads[0].source, cores) == band


def test_declines_dense_blocked_and_nchw_depthwise_convs(target, lowered, prim_funcs):
    """The dense blocked conv is Conv2dNCHWc's, the NCHW depthwise conv DepthwiseConv2d's."""
    func, _ = depthwise_kernel((1, 1, 8, 8, BLOCK), 3, pad=1)
    assert Conv2dNCHWc().apply(func, target, False) is None
    assert DepthwiseConv2d().apply(func, target, False) is None
    mod = lowered(lambda x, w: nn.conv2d(x, w, padding=1, groups=8), x=(1, 8, 10, 10), w=(8, 1, 3, 3))
    for nchw in prim_funcs(mod).values():
        assert DepthwiseConv2dNCHWc().apply(nchw, target, False) is None

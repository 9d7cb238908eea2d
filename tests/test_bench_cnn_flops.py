"""benchmarks/bench_cnn.py's FLOP count: a conv's multiply-adds whether it runs direct or by
Winograd (whose rate is reported as the direct conv's it replaces)."""

import importlib.util
from pathlib import Path

import pytest
from tvm import te

from tvm_fusion.passes.blocked_layout_legalize import _conv2d_nchwc
from tvm_fusion.passes.precompute_winograd_weights import _weight_as_parameter, _weight_block
from tvm_fusion.kernels.winograd_conv2d import winograd_conv2d_nchwc

BLOCK = 8


def bench_cnn():
    spec = importlib.util.spec_from_file_location(
        "bench_cnn", Path(__file__).resolve().parent.parent / "benchmarks" / "bench_cnn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("channels, out_channels, rows, columns, tile", [
    (64, 64, 56, 56, 4),
    (64, 64, 7, 7, 4),     # a cover of 2x2 tiles past the map: its zeros not counted
    (32, 16, 6, 6, 2),
    (16, 32, 12, 20, None),  # the direct conv
])
def test_a_conv_counts_its_direct_multiply_adds(channels, out_channels, rows, columns, tile):
    data = te.placeholder((1, channels // BLOCK, rows, columns, BLOCK), name="data")
    kernel = te.placeholder((out_channels // BLOCK, channels // BLOCK, 3, 3, BLOCK, BLOCK), name="kernel")
    if tile is None:
        func = te.create_prim_func([data, kernel, _conv2d_nchwc(data, kernel, (1, 1), (1, 1, 1, 1), (1, 1), None)])
    else:
        func = te.create_prim_func([data, kernel, winograd_conv2d_nchwc(data, kernel, (1, 1, 1, 1), tile)])
        func = _weight_as_parameter(func, _weight_block(func))
    assert bench_cnn().kernel_flops(func) == 2 * 9 * channels * out_channels * rows * columns

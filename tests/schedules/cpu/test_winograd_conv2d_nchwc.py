"""WinogradConv2dNCHWc: a Winograd conv's tiles, products and epilogue in one pass per row of tiles."""

import numpy as np
import pytest
import tvm
from loop_structure import blocks_in, float_lanes, loop_kinds
from machine import host_target
from tvm import relax
from tvm.relax.op import add, nn

from tvm_fusion.kernels.winograd_conv2d import weight_transform
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.passes.precompute_winograd_weights import _weight_as_parameter, _weight_block
from tvm_fusion.schedules.cpu import Conv2dNCHWc, WinogradConv2dNCHWc
from tvm_fusion.schedules.cpu.winograd_conv2d_nchwc import _register_tiles

BLOCK = float_lanes(tvm.target.Target(host_target()))


def conv_kernel(x, w, pad, epilogue, winograd=True):
    """The one PrimFunc of ``epilogue(conv2d(x, w) + b)`` in NCHW[BLOCK]c after our lowering
    (``epilogue``: "silu", "residual" (relu, then + r) or "none": the conv alone)."""
    out = (x[0], w[0], x[2] + 2 * pad - 2, x[3] + 2 * pad - 2, BLOCK)
    shapes = {"x": x, "w": w, **({} if epilogue == "none" else {"b": (1, w[0], 1, 1, BLOCK)}),
              **({"r": out} if epilogue == "residual" else {})}
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in shapes.items()]
    builder = relax.BlockBuilder()
    with builder.function("main", params):
        with builder.dataflow():
            value = nn.conv2d(params[0], params[1], padding=pad, data_layout=f"NCHW{BLOCK}c",
                              kernel_layout=f"OIHW{BLOCK}i{BLOCK}o", out_layout=f"NCHW{BLOCK}c")
            if epilogue == "silu":
                value = nn.silu(add(value, params[2]))
            if epilogue == "residual":
                value = add(nn.relu(add(value, params[2])), params[3])
            value = builder.emit_output(value)
        builder.emit_func_output(value)
    mod = tvm.transform.Sequential(lowering_passes(winograd=winograd))(builder.get())
    (kernel,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return kernel, shapes, out


@pytest.mark.parametrize("x, w, pad, epilogue", [
    ((1, 2, 16, 24, BLOCK), (4, 2, 3, 3, BLOCK, BLOCK), 1, "silu"),       # F(4x4): 4 rows of 6 tiles
    ((1, 2, 10, 14, BLOCK), (2, 2, 3, 3, BLOCK, BLOCK), 1, "residual"),   # F(2x2): 5 rows, rows x channel chunks
    ((2, 3, 8, 8, BLOCK), (3, 3, 3, 3, BLOCK, BLOCK), 1, "silu"),         # batch 2, odd channel blocks
    ((1, 2, 54, 54, BLOCK), (2, 2, 3, 3, BLOCK, BLOCK), 1, "silu"),       # 13 tiles a row: a partial register tile
    ((1, 2, 18, 10, BLOCK), (2, 2, 3, 3, BLOCK, BLOCK), 0, "silu"),       # no pad: 16 x 8 out
    ((1, 2, 4, 4, BLOCK), (2, 2, 3, 3, BLOCK, BLOCK), 1, "none"),         # 4 tiles of 2x2, no epilogue
    ((1, 128, 8, 8, BLOCK), (2, 128, 3, 3, BLOCK, BLOCK), 1, "silu"),     # 1024+ input channels: a band of 1 tile
    ((1, 2, 7, 7, BLOCK), (2, 2, 3, 3, BLOCK, BLOCK), 1, "residual"),     # F(4x4) over 8x8: a last tile of 3x3
    ((1, 2, 13, 7, BLOCK), (3, 2, 3, 3, BLOCK, BLOCK), 0, "silu"),        # no pad: 11 x 5 out, odd both ways
    ((2, 2, 3, 3, BLOCK), (2, 2, 3, 3, BLOCK, BLOCK), 1, "silu"),         # F(2x2) over 4x4, batch 2
    ((1, 2, 2, 2, BLOCK), (2, 2, 3, 3, BLOCK, BLOCK), 1, "none"),         # one F(2x2) tile
    ((1, 2, 3, 21, BLOCK), (2, 2, 3, 3, BLOCK, BLOCK), 1, "residual"),    # 3 rows: one row of F(4x4) tiles
])
def test_the_winograd_conv_matches_the_direct_conv(target, run_kernel, x, w, pad, epilogue):
    """The scheduled kernel, its weight transformed at build time, against the unscheduled
    direct conv; both transformed points unrolled, channel blocks on vectors, one parallel loop
    with every block under it (a task transforms its own input tiles)."""
    kernel, shapes, out = conv_kernel(x, w, pad, epilogue)
    direct, _, _ = conv_kernel(x, w, pad, epilogue, winograd=False)
    weight = _weight_block(kernel)
    assert weight is not None and {"winograd_input", "winograd_gemm", "winograd_output"} <= blocks_in(kernel)
    tile = int(weight.writes[0].source.shape[0]) - 2
    precomputed = _weight_as_parameter(kernel, weight)
    sch = WinogradConv2dNCHWc().apply(precomputed, target, False)
    assert sch is not None
    scheduled = sch.mod["main"]
    loops = loop_kinds(scheduled)
    assert len(loops.parallel) == 1
    assert loops.vectorized and set(loops.vectorized) == {BLOCK}
    assert loops.unrolled.count(tile + 2) >= 2 and loops.unrolled.count(tile) >= 2
    rng = np.random.default_rng(0)
    inputs = {name: rng.standard_normal(shape).astype("float32") for name, shape in shapes.items()}
    inputs["w"] /= np.sqrt(9 * x[1] * BLOCK)
    expected = _run(direct, inputs, out)
    transformed = dict(inputs, w=weight_transform(inputs["w"], tile))
    np.testing.assert_allclose(_run(scheduled, transformed, out), expected, rtol=1e-4, atol=1e-4)


def test_a_weight_computed_at_run_time_is_transformed_in_the_kernel(target):
    """Without the build-time transform the kernel keeps ``winograd_weight``, scheduled across
    the cores, and still computes the conv."""
    x, w = (1, 2, 8, 8, BLOCK), (2, 2, 3, 3, BLOCK, BLOCK)
    kernel, shapes, out = conv_kernel(x, w, 1, "silu")
    direct, _, _ = conv_kernel(x, w, 1, "silu", winograd=False)
    sch = WinogradConv2dNCHWc().apply(kernel, target, False)
    assert sch is not None and "winograd_weight" in blocks_in(sch.mod["main"])
    assert len(loop_kinds(sch.mod["main"]).parallel) == 2  # the weight's channels, then the tiles
    rng = np.random.default_rng(1)
    inputs = {name: rng.standard_normal(shape).astype("float32") for name, shape in shapes.items()}
    inputs["w"] /= np.sqrt(9 * x[1] * BLOCK)  # unit-scale outputs, as a trained conv's (the tolerance is for those)
    np.testing.assert_allclose(_run(sch.mod["main"], inputs, out), _run(direct, inputs, out), rtol=1e-4, atol=1e-4)


def test_the_direct_conv_rule_declines_a_winograd_kernel_and_vice_versa(target):
    winograd, _, _ = conv_kernel((1, 2, 8, 8, BLOCK), (2, 2, 3, 3, BLOCK, BLOCK), 1, "silu")
    direct, _, _ = conv_kernel((1, 2, 8, 8, BLOCK), (2, 2, 3, 3, BLOCK, BLOCK), 1, "silu", winograd=False)
    assert Conv2dNCHWc().apply(winograd, target, False) is None
    assert WinogradConv2dNCHWc().apply(direct, target, False) is None


@pytest.mark.parametrize("band", [1, 2, 3, 5, 8, 13, 16, 26])
@pytest.mark.parametrize("chunk, registers", [(1, 16), (2, 16), (2, 32)])
def test_the_register_tile_fits_the_registers(band, chunk, registers):
    """Accumulators + one weight vector per channel block + the broadcast input fit."""
    tiles = _register_tiles(band, chunk, registers)
    assert 1 <= tiles <= band and tiles * chunk + chunk + 1 <= registers


def test_a_row_of_13_tiles_takes_5_per_register_tile():
    """5 (3 register tiles, 15 tiles computed) over 4 (16) and 6 (18), 2 channel blocks, AVX2."""
    assert _register_tiles(13, 2, 16) == 5


def _run(func, inputs: dict, out_shape) -> np.ndarray:
    args = [tvm.runtime.tensor(value) for value in inputs.values()]
    out = tvm.runtime.tensor(np.zeros(out_shape, "float32"))
    tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                target=tvm.target.Target(host_target()))["main"](*args, out)
    return out.numpy()

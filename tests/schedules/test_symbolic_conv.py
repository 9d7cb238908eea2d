"""Conv-family CPU rules on kernels with symbolic output rows and columns (a model compiled for
a range of image sizes): full column tiles with the last one shifted back, one copy per tile
width picked at run time, numbers equal to the unscheduled kernel at every size."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.op import add, multiply, nn

from conftest import TARGET, _run
from tvm.tirx import ForKind
from tvm_fusion.schedules.cpu import Conv2dNCHW, DepthwiseConv2d, Pooling
from tvm_fusion.schedules.cpu.symbolic_width import width_tiles

# 1-wide, smaller than any vector, not a multiple of any tile, and a large map.
SIZES = (1, 3, 13, 37, 130)


def lower_symbolic(fn, channels: int, **params):
    """``fn(x, *params)`` with ``x: (1, channels, height, width)``, height and width symbolic."""
    height, width = tirx.Var("height", "int64"), tirx.Var("width", "int64")
    x = relax.Var("x", relax.TensorType((1, channels, height, width), "float32"))
    others = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in params.items()]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *others]):
        with bb.dataflow():
            out = bb.emit_output(fn(x, *others))
        bb.emit_func_output(out)
    return relax.get_pipeline("zero")(bb.get())


def _schedule_with(rule, mod):
    """Schedule the PrimFuncs ``rule`` answers for (at least one)."""
    scheduled, answered = mod.clone(), 0
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            sch = rule.apply(func, TARGET, False)
            if sch is not None:
                scheduled[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
                answered += 1
    assert answered, f"{type(rule).__name__} declined every kernel"
    return scheduled


class loop_kinds:
    """Extents of the parallel, vectorized and unrolled loops (None where symbolic)."""

    def __init__(self, func):
        self.parallel, self.vectorized, self.unrolled = [], [], []
        kinds = {ForKind.PARALLEL: self.parallel, ForKind.VECTORIZED: self.vectorized,
                 ForKind.UNROLLED: self.unrolled}

        def visit(loop):
            if loop.kind in kinds:
                kinds[loop.kind].append(int(loop.extent) if isinstance(loop.extent, tirx.IntImm) else None)

        tvm_ffi.structural_walk(func.body, (tirx.For, visit))


def assert_symbolic_matches(rule, fn, channels, sizes=SIZES, **params):
    """Schedule with ``rule``, compare against the unscheduled module at every size (square and
    not), return the scheduled PrimFuncs."""
    mod = lower_symbolic(fn, channels, **params)
    scheduled = _schedule_with(rule, mod)
    rng = np.random.default_rng(0)
    for height, width in [(s, s) for s in sizes] + [(sizes[-1], sizes[0]), (sizes[0], sizes[-1])]:
        inputs = [rng.standard_normal((1, channels, height, width)).astype("float32")]
        inputs += [rng.standard_normal(shape).astype("float32") for shape in params.values()]
        np.testing.assert_allclose(_run(scheduled, inputs), _run(mod, inputs), rtol=1e-4, atol=1e-4)
    return [f for f in scheduled.functions.values() if isinstance(f, tirx.PrimFunc)]


def width_copies(func) -> list[int]:
    """The tile widths the kernel chooses between at run time (its ``width >= tile`` tests)."""
    found = []

    def visit(node):
        cond = node.condition
        if isinstance(cond, tirx.GE) and isinstance(cond.b, tirx.IntImm):
            found.append(int(cond.b))

    tvm_ffi.structural_walk(func.body, (tirx.IfThenElse, visit))
    return sorted(found, reverse=True)


def test_width_tiles_halve_down_to_one_column():
    assert width_tiles(32, 16) == [32, 16, 8, 4, 1]
    assert width_tiles(16, 8) == [16, 8, 4, 1]
    assert width_tiles(8, 8) == [8, 4, 1]


@pytest.mark.parametrize("strides, padding", [(1, 1), (2, 1), (1, 0)])
def test_dense_conv_bias_relu(lanes, strides, padding):
    def block(x, w, b):
        return nn.relu(add(nn.conv2d(x, w, strides=strides, padding=padding), b))

    sizes = SIZES if padding else SIZES[1:]  # an unpadded 3x3 needs 3 rows and columns
    (func,) = assert_symbolic_matches(Conv2dNCHW(), block, 8, sizes, w=(16, 8, 3, 3), b=(1, 16, 1, 1))
    widest = (2 if strides == 1 else 1) * lanes
    tiles = width_tiles(widest, lanes)
    assert width_copies(func) == tiles[:-1]
    loops = loop_kinds(func)
    # Every copy runs its rows across cores (plus the pad pass when padded) and vectorizes the
    # accumulator tile, its init and the epilogue over that copy's columns.
    assert len(loops.parallel) == len(tiles) * (2 if padding else 1)
    for tile in tiles[:-1]:
        assert loops.vectorized.count(tile) >= 3
    assert loops.unrolled and all(16 % tile == 0 for tile in loops.unrolled)  # the channel tile


def test_dense_conv_with_residual_and_input_scale():
    def block(x, w, b, r, gate):
        return nn.relu(add(add(nn.conv2d(multiply(x, gate), w, padding=1), b), r))

    # The residual has the output's symbolic shape: it is read from a second map input.
    height, width = tirx.Var("height", "int64"), tirx.Var("width", "int64")
    x = relax.Var("x", relax.TensorType((1, 8, height, width), "float32"))
    r = relax.Var("r", relax.TensorType((1, 16, height, width), "float32"))
    w = relax.Var("w", relax.TensorType((16, 8, 3, 3), "float32"))
    b = relax.Var("b", relax.TensorType((1, 16, 1, 1), "float32"))
    gate = relax.Var("gate", relax.TensorType((1, 8, 1, 1), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, r, w, b, gate]):
        with bb.dataflow():
            out = bb.emit_output(block(x, w, b, r, gate))
        bb.emit_func_output(out)
    mod = relax.get_pipeline("zero")(bb.get())
    scheduled = _schedule_with(Conv2dNCHW(), mod)  # the conv kernel (the scale is its own here)
    rng = np.random.default_rng(1)
    for size in (1, 11, 40):
        inputs = [rng.standard_normal(s).astype("float32") for s in
                  ((1, 8, size, size), (1, 16, size, size), (16, 8, 3, 3), (1, 16, 1, 1), (1, 8, 1, 1))]
        np.testing.assert_allclose(_run(scheduled, inputs), _run(mod, inputs), rtol=1e-4, atol=1e-4)


def test_depthwise_conv(lanes):
    def block(x, w):
        return nn.relu(nn.conv2d(x, w, padding=1, groups=16))

    (func,) = assert_symbolic_matches(DepthwiseConv2d(), block, 16, w=(16, 1, 3, 3))
    tiles = width_tiles(4 * lanes, lanes)
    assert width_copies(func) == tiles[:-1]
    loops = loop_kinds(func)
    assert len(loops.parallel) == 2 * len(tiles)
    for tile in tiles[:-1]:
        assert tile in loops.vectorized
    assert 3 in loops.unrolled  # the 3x3 window taps


def test_max_pool(lanes):
    def block(x):
        return nn.max_pool2d(x, pool_size=3, strides=2, padding=1)

    (func,) = assert_symbolic_matches(Pooling(), block, 8)
    tiles = width_tiles(4 * lanes, lanes)
    assert width_copies(func) == tiles[:-1]
    for tile in tiles[:-1]:
        assert tile in loop_kinds(func).vectorized


def test_global_average_pool_sums_each_channel_on_its_own_core():
    def block(x):
        return nn.adaptive_avg_pool2d(x, output_size=1)

    (func,) = assert_symbolic_matches(Pooling(), block, 24)
    assert loop_kinds(func).parallel == [24]  # (batch x channels), the map summed serially


def test_symbolic_channels_are_declined():
    channels = tirx.Var("channels", "int64")
    x = relax.Var("x", relax.TensorType((1, channels, 16, 16), "float32"))
    w = relax.Var("w", relax.TensorType((8, channels, 3, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(nn.conv2d(x, w, padding=1))
        bb.emit_func_output(out)
    mod = relax.get_pipeline("zero")(bb.get())
    func = next(f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc))
    assert Conv2dNCHW().apply(func, TARGET, False) is None

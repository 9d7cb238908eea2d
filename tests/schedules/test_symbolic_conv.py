"""Conv-family CPU rules on kernels with symbolic output rows and columns (a model compiled for
a range of image sizes): full column tiles with the last one shifted back, one copy per tile
width picked at run time, numbers equal to the unscheduled kernel at every size."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.op import add, concat, image, multiply, nn

from conftest import TARGET
from tvm.tirx import ForKind
from tvm_fusion.passes import FusePatterns
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.schedules.cpu import (Conv2dNCHW, Conv2dNCHWc, Conv2dTranspose, DepthwiseConv2d,
                                      DepthwiseConv2dNCHWc, Pooling, Resize)
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


def runner(mod: tvm.IRModule):
    """``inputs -> output`` of ``mod`` built once: a symbolic module runs at every size."""
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    return lambda inputs: vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()


def assert_symbolic_matches(rule, fn, channels, sizes=SIZES, **params):
    """Schedule with ``rule``, compare against the unscheduled module at every size (square and
    not), return the scheduled PrimFuncs."""
    mod = lower_symbolic(fn, channels, **params)
    scheduled = _schedule_with(rule, mod)
    rng = np.random.default_rng(0)
    run_scheduled, run_unscheduled = runner(scheduled), runner(mod)
    for height, width in [(s, s) for s in sizes] + [(sizes[-1], sizes[0]), (sizes[0], sizes[-1])]:
        inputs = [rng.standard_normal((1, channels, height, width)).astype("float32")]
        inputs += [rng.standard_normal(shape).astype("float32") for shape in params.values()]
        np.testing.assert_allclose(run_scheduled(inputs), run_unscheduled(inputs), rtol=1e-4, atol=1e-4)
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
    run_scheduled, run_unscheduled = runner(scheduled), runner(mod)
    for size in (1, 11, 40):
        inputs = [rng.standard_normal(s).astype("float32") for s in
                  ((1, 8, size, size), (1, 16, size, size), (16, 8, 3, 3), (1, 16, 1, 1), (1, 8, 1, 1))]
        np.testing.assert_allclose(run_scheduled(inputs), run_unscheduled(inputs), rtol=1e-4, atol=1e-4)


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


def buffer_names(func) -> set[str]:
    found = set()
    tvm_ffi.structural_walk(func.body, (tirx.BufferStore, lambda store: found.add(store.buffer.name)))
    return found


@pytest.mark.parametrize("strides, kernel", [(2, 2), (2, 3), (1, 3)])
def test_conv_transpose_bias_relu(lanes, strides, kernel):
    """2x2/2 (DBNet's upsampling head) runs polyphase, reading the undilated input; the others
    convolve the padded dilated map."""
    def block(x, w, b):
        return nn.relu(add(nn.conv2d_transpose(x, w, strides=strides), b))

    (func,) = assert_symbolic_matches(Conv2dTranspose(), block, 8, w=(8, 4, kernel, kernel), b=(1, 4, 1, 1))
    polyphase = strides == kernel == 2
    # Polyphase tiles count input columns (one vector per phase); dilated ones output columns.
    tiles = width_tiles(lanes, lanes) if polyphase else width_tiles(2 * lanes, lanes)
    assert width_copies(func) == tiles[:-1]
    loops = loop_kinds(func)
    assert len(loops.parallel) == len(tiles) * (1 if polyphase else 2)  # + the pad pass
    for tile in tiles[:-1]:
        assert tile in loops.vectorized
    assert ("data_pad" in buffer_names(func)) != polyphase


def lower_fused_resize(fn, top_shape, other_shape):
    """``fn(top, other)`` fused by resize_merge (one kernel), lowered by the zero pipeline."""
    top = relax.Var("top", relax.TensorType(top_shape, "float32"))
    other = relax.Var("other", relax.TensorType(other_shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [top, other]):
        with bb.dataflow():
            out = bb.emit_output(fn(top, other))
        bb.emit_func_output(out)
    report = PatternReport()
    fused = FusePatterns([get_pattern("resize_merge")], report)(bb.get())
    assert sum(report.fired.values()) == 1 and sum(report.variants.values()) == 1, report.near_misses
    return relax.get_pipeline("zero")(fused)


@pytest.mark.parametrize("method", ["nearest_neighbor", "linear"])
@pytest.mark.parametrize("merge", ["add_relu", "concat"])
def test_resize_merge(lanes, method, merge):
    height, width = tirx.Var("height", "int64"), tirx.Var("width", "int64")
    options = {"method": method}
    if method == "nearest_neighbor":
        options.update(coordinate_transformation_mode="asymmetric", rounding_method="floor")

    def fn(top, lateral):
        up = image.resize2d(top, relax.ShapeExpr([2 * height, 2 * width]), **options)
        return nn.relu(add(lateral, up)) if merge == "add_relu" else concat([up, lateral], axis=1)

    mod = lower_fused_resize(fn, (1, 8, height, width), (1, 8, 2 * height, 2 * width))
    scheduled = _schedule_with(Resize(), mod)
    (func,) = [f for f in scheduled.functions.values() if isinstance(f, tirx.PrimFunc)]
    tiles = width_tiles(4 * lanes, lanes)
    assert width_copies(func) == tiles[:-1]
    loops = loop_kinds(func)
    assert len(loops.parallel) == len(tiles)  # (n, c, y) rows across cores in every copy
    assert sorted(loops.vectorized, reverse=True) == tiles[:-1]
    rng = np.random.default_rng(2)
    run_scheduled, run_unscheduled = runner(scheduled), runner(mod)
    for h, w in [(1, 1), (3, 3), (13, 13), (37, 37), (130, 130), (130, 1), (1, 130)]:
        inputs = [rng.standard_normal((1, 8, h, w)).astype("float32"),
                  rng.standard_normal((1, 8, 2 * h, 2 * w)).astype("float32")]
        np.testing.assert_allclose(run_scheduled(inputs), run_unscheduled(inputs), rtol=1e-4, atol=1e-4)


def test_resize_with_symbolic_channels_is_declined():
    channels, height = tirx.Var("channels", "int64"), tirx.Var("height", "int64")
    top = relax.Var("top", relax.TensorType((1, channels, height, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [top]):
        with bb.dataflow():
            out = bb.emit_output(image.resize2d(top, relax.ShapeExpr([2 * height, 16]), method="nearest_neighbor"))
        bb.emit_func_output(out)
    mod = relax.get_pipeline("zero")(bb.get())
    func = next(f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc))
    assert Resize().apply(func, TARGET, False) is None


def blocked_conv(lanes: int, strides: int, bias: bool):
    """A 3x3 conv over a symbolic map in NCHW[lanes]c (+ bias + relu), legalized as the blocked
    layout pass does: (module, the module under Conv2dNCHWc, the scheduled conv PrimFunc)."""
    from tvm_fusion.passes.blocked_layout_legalize import blocked_conv2d_legalize

    height, width = tirx.Var("height", "int64"), tirx.Var("width", "int64")
    params = [relax.Var("x", relax.TensorType((1, 2, height, width, lanes), "float32")),
              relax.Var("w", relax.TensorType((2, 2, 3, 3, lanes, lanes), "float32"))]
    if bias:
        params.append(relax.Var("b", relax.TensorType((1, 2, 1, 1, lanes), "float32")))
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = nn.conv2d(params[0], params[1], strides=strides, padding=1, data_layout=f"NCHW{lanes}c",
                            kernel_layout=f"OIHW{lanes}i{lanes}o", out_layout=f"NCHW{lanes}c")
            out = bb.emit_output(nn.relu(add(out, params[2])) if bias else out)
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps({"relax.nn.conv2d": blocked_conv2d_legalize})(bb.get())
    mod = relax.get_pipeline("zero")(mod)
    scheduled = _schedule_with(Conv2dNCHWc(), mod)
    (func,) = [f for f in scheduled.functions.values()
               if isinstance(f, tirx.PrimFunc) and "tirx.is_scheduled" in (f.attrs or {})]
    return mod, scheduled, func


@pytest.mark.parametrize("strides", [1, 2])
def test_blocked_conv_bias_relu(lanes, strides):
    """NCHW[lanes]c (passes/blocked_layout.py): tiles of pixels, unrolled, the channel block on
    the vector; one copy per tile width."""
    from tvm_fusion.schedules.cpu.conv2d_nchwc import _MAX_ROW_TILE

    mod, scheduled, func = blocked_conv(lanes, strides, bias=True)
    tiles = width_tiles(_MAX_ROW_TILE, lanes)
    assert width_copies(func) == tiles[:-1]
    loops = loop_kinds(func)
    assert len(loops.parallel) == 2 * len(tiles)  # rows and the pad pass, in every copy
    for tile in tiles[:-1]:
        assert tile in loops.unrolled
    rng = np.random.default_rng(3)
    run_scheduled, run_unscheduled = runner(scheduled), runner(mod)
    for h, w_ in [(1, 1), (3, 13), (37, 1), (130, 130)]:
        inputs = [rng.standard_normal(shape).astype("float32")
                  for shape in ((1, 2, h, w_, lanes), (2, 2, 3, 3, lanes, lanes), (1, 2, 1, 1, lanes))]
        np.testing.assert_allclose(run_scheduled(inputs), run_unscheduled(inputs), rtol=1e-4, atol=1e-4)


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


def divisors_mentioning(func, name: str) -> list:
    """Divisors of the integer divisions and modulos in ``func`` that depend on the variable
    ``name`` (a division by a run-time extent costs tens of cycles)."""
    found = []

    def visit(node):
        divisor = node.b
        if not isinstance(divisor, tirx.IntImm):
            names = []
            tvm_ffi.structural_walk(divisor, (tirx.Var, lambda v: names.append(v.name)))
            if name in names:
                found.append(divisor)

    tvm_ffi.structural_walk(func.body, [(tirx.FloorDiv, visit), (tirx.FloorMod, visit)])
    return found


@pytest.mark.parametrize("strides", [1, 2])
def test_blocked_conv_pad_divides_once_per_row(lanes, strides):
    """The pad pass of a symbolic blocked conv runs rows across cores with the columns inside:
    fused down to the pixel it divided by the run-time row length per pixel (2-3x the conv)."""
    mod, scheduled, func = blocked_conv(lanes, strides, bias=False)
    assert divisors_mentioning(func, "width") == []
    rng = np.random.default_rng(5)
    run_scheduled, run_unscheduled = runner(scheduled), runner(mod)
    for h, w_ in [(1, 1), (5, 37), (64, 9)]:
        inputs = [rng.standard_normal(shape).astype("float32")
                  for shape in ((1, 2, h, w_, lanes), (2, 2, 3, 3, lanes, lanes))]
        np.testing.assert_allclose(run_scheduled(inputs), run_unscheduled(inputs), rtol=1e-4, atol=1e-4)


def test_symbolic_layout_transform_divides_once_per_row():
    """NCHW -> NCHW8c over a symbolic map (the blocked layout's entry): rows across cores,
    columns and the channel block inside, no division by the run-time width."""
    from tvm_fusion.schedules.cpu import Injective

    height, width = tirx.Var("height", "int64"), tirx.Var("width", "int64")
    x = relax.Var("x", relax.TensorType((1, 16, height, width), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.layout_transform(x, index_map=lambda n, c, h, w: (n, c // 8, h, w, c % 8)))
        bb.emit_func_output(out)
    mod = relax.get_pipeline("zero")(bb.get())
    scheduled = _schedule_with(Injective(), mod)
    (func,) = [f for f in scheduled.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert divisors_mentioning(func, "width") == []
    assert loop_kinds(func).parallel
    rng = np.random.default_rng(6)
    run_scheduled, run_unscheduled = runner(scheduled), runner(mod)
    for h, w_ in [(1, 1), (3, 13), (40, 7)]:
        inputs = [rng.standard_normal((1, 16, h, w_)).astype("float32")]
        np.testing.assert_allclose(run_scheduled(inputs), run_unscheduled(inputs), rtol=0, atol=0)


def test_blocked_depthwise_conv_keeps_the_whole_map_pad(lanes):
    """DepthwiseConv2dNCHWc over symbolic rows: no band can be chosen to divide them, so the
    map is padded by a pass of its own, and every size still matches."""
    from tvm_fusion.passes.pipeline import lowering_passes

    height, width = tirx.Var("height", "int64"), tirx.Var("width", "int64")
    params = [relax.Var("x", relax.TensorType((1, 2, height, width, lanes), "float32")),
              relax.Var("w", relax.TensorType((2, 1, 3, 3, lanes), "float32"))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(nn.relu(nn.conv2d(params[0], params[1], padding=1, groups=2 * lanes,
                                                   data_layout=f"NCHW{lanes}c", kernel_layout=f"OIHW{lanes}o")))
        bb.emit_func_output(out)
    mod = tvm.transform.Sequential(lowering_passes())(bb.get())
    scheduled = _schedule_with(DepthwiseConv2dNCHWc(), mod)
    (func,) = [f for f in scheduled.functions.values() if isinstance(f, tirx.PrimFunc)]
    tiles = width_tiles(8, lanes)
    assert len(loop_kinds(func).parallel) == 2 * len(tiles)  # the pad pass and the rows, in every copy
    rng = np.random.default_rng(5)
    run_scheduled, run_unscheduled = runner(scheduled), runner(mod)
    for h, w_ in [(1, 1), (3, 13), (37, 1), (130, 130)]:
        inputs = [rng.standard_normal(shape).astype("float32") for shape in ((1, 2, h, w_, lanes), (2, 1, 3, 3, lanes))]
        np.testing.assert_allclose(run_scheduled(inputs), run_unscheduled(inputs), rtol=1e-4, atol=1e-4)

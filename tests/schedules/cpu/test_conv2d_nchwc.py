"""Conv2dNCHWc: blocked-layout conv with an (output pixels x channel blocks) register tile."""

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from loop_structure import float_lanes, loop_kinds, pixel_tile
from machine import host_target
from tvm import relax
from tvm.relax.op import add, nn

from tvm_fusion.passes import FusePatterns
from tvm_fusion.passes.pipeline import lowering_passes
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.schedules.cpu import Conv2dNCHW, Conv2dNCHWc
from tvm_fusion.schedules.cpu.conv2d_nchwc import _SPILL_FREE_UNROLL as SPILL_FREE_UNROLL
from tvm_fusion.schedules.cpu.conv2d_nchwc import _register_tile
from tvm_fusion.targets.target_info import spills_unrolled_loads, vector_registers

# One vector register of channels, the block the pipeline picks for this host (the rule
# declines a block wider than a register).
BLOCK = float_lanes(tvm.target.Target(host_target()))
# Output rows from which the rule's tasks may be rows alone (fewer: rows x channel tiles).
ROW_TASKS = 6


def rows_alone(rows, cores):
    """Rows alone are the tasks when they share out over the cores within 1/16 of even."""
    busiest = -(-rows // cores) * cores
    return rows >= ROW_TASKS and busiest * 16 <= rows * 17


def out_shape(x, w, stride, pad, dilation):
    size = [(x[i] + 2 * pad - dilation * (w[i] - 1) - 1) // stride + 1 for i in (2, 3)]
    return (x[0], w[0], *size, BLOCK)


def blocked_conv_kernel(x, w, stride=1, pad=0, dilation=1, residual=False, block=BLOCK):
    """The one PrimFunc of ``relu(conv2d(x, w) + b) [+ r]`` in NCHW[block]c after our lowering
    (``x`` 4-D: an NCHW map in, with ``OIHW{block}o`` weights)."""
    shapes = {"x": x, "w": w, "b": (1, w[0], 1, 1, block)}
    data_layout, kernel_layout = (f"NCHW{block}c", f"OIHW{block}i{block}o") if len(x) == 5 else ("NCHW", f"OIHW{block}o")
    if residual:
        shapes["r"] = out_shape(x, w, stride, pad, dilation)[:-1] + (block,)
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in shapes.items()]
    builder = relax.BlockBuilder()
    with builder.function("main", params):
        with builder.dataflow():
            conv = nn.conv2d(params[0], params[1], strides=stride, padding=pad, dilation=dilation,
                             data_layout=data_layout, kernel_layout=kernel_layout, out_layout=f"NCHW{block}c")
            out = nn.relu(add(conv, params[2]))
            if residual:
                out = add(out, params[3])
            out = builder.emit_output(out)
        builder.emit_func_output(out)
    # The direct conv (3x3 stride-1 convs would otherwise be Winograd's: test_winograd_conv2d_nchwc.py).
    mod = tvm.transform.Sequential(lowering_passes(winograd=False))(builder.get())
    (kernel,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return kernel, shapes


@pytest.mark.parametrize("x, w, stride, pad, dilation, residual", [
    ((1, 2, 14, 14, BLOCK), (4, 2, 3, 3, BLOCK, BLOCK), 1, 1, 1, True),    # 3x3 + residual
    ((1, 2, 15, 15, BLOCK), (2, 2, 3, 3, BLOCK, BLOCK), 2, 1, 1, False),   # stride 2, odd map
    ((2, 1, 7, 9, BLOCK), (3, 1, 1, 1, BLOCK, BLOCK), 1, 0, 1, False),     # 1x1, odd channel blocks
    ((1, 1, 12, 12, BLOCK), (2, 1, 3, 3, BLOCK, BLOCK), 1, 2, 2, True),    # dilated
    ((1, 2, 13, 13, BLOCK), (12, 2, 3, 3, BLOCK, BLOCK), 1, 1, 1, True),   # 13 pixels: overlapping tiles, 13 rows: rows x channel tiles
    ((1, 2, 26, 26, BLOCK), (6, 2, 3, 3, BLOCK, BLOCK), 2, 1, 1, False),   # 13 columns, stride 2
    ((1, 2, 34, 16, BLOCK), (4, 2, 3, 3, BLOCK, BLOCK), 1, 1, 1, False),   # 34 rows: rows alone (17 per core)
    ((1, 2, 17, 16, BLOCK), (4, 2, 3, 3, BLOCK, BLOCK), 1, 1, 1, False),   # 17 rows: rows x channel tiles
    ((1, 2, 5, 8, BLOCK), (4, 2, 3, 3, BLOCK, BLOCK), 1, 1, 1, False),     # 5 rows: channel tiles x rows
    ((1, 1, 6, 17, BLOCK), (3, 1, 3, 3, BLOCK, BLOCK), 1, 1, 1, True),     # 3 blocks x 17 columns: 9 + overlap
    ((1, 8, 7, 7, BLOCK), (16, 8, 3, 3, BLOCK, BLOCK), 1, 1, 1, True),     # deep over 7x7: channel tiles
    ((1, 16, 7, 7, BLOCK), (32, 16, 1, 1, BLOCK, BLOCK), 1, 0, 1, False),  # 1x1 deep over 7x7: channel tiles
    ((1, 8, 14, 14, BLOCK), (16, 8, 1, 1, BLOCK, BLOCK), 2, 0, 1, False),  # 1x1/2: filters 1.3x the map, rows
    ((1, 2, 5, 5, BLOCK), (4, 2, 3, 3, BLOCK, BLOCK), 1, 1, 1, False),     # filters outweigh the map, too few tiles
    ((1, 2, 6, 20, BLOCK), (15, 2, 1, 1, BLOCK, BLOCK), 1, 0, 1, True),    # 1x1, 15 blocks: 5 pixels x 3 blocks
    ((1, 2, 3, 7, BLOCK), (5, 2, 1, 1, BLOCK, BLOCK), 1, 0, 1, False),     # 1x1, 5 blocks: 3 pixels (overlapping) x 5
    ((1, 2, 4, 20, BLOCK), (6, 2, 1, 1, BLOCK, BLOCK), 1, 0, 1, False),    # 1x1, 6 blocks, 5 | 20 columns: 5 x 3
    ((1, 2, 4, 14, BLOCK), (6, 2, 1, 1, BLOCK, BLOCK), 1, 0, 1, False),    # 1x1, 6 blocks, 14 columns: 7 x 2
])
def test_blocked_conv_matches_the_unscheduled_kernel(target, run_kernel, x, w, stride, pad, dilation, residual):
    kernel, shapes = blocked_conv_kernel(x, w, stride, pad, dilation, residual)
    sch = Conv2dNCHWc().apply(kernel, target, False)
    assert sch is not None
    result_shape = out_shape(x, w, stride, pad, dilation)
    assert_pixel_by_channel_block_tiles(sch.mod["main"], target, result_shape, padded=pad > 0,
                                        window=w[2] * w[3], channel_tiles=channel_tiles(x, w, pad, result_shape, target))
    np.testing.assert_allclose(run_kernel(sch.mod["main"], shapes, result_shape),
                               run_kernel(kernel, shapes, result_shape), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("x, w, stride, pad", [
    ((1, 3, 32, 32), (2, 3, 3, 3, BLOCK), 2, 1),     # an RGB stem, stride 2
    ((1, 12, 13, 13), (1, 12, 3, 3, BLOCK), 1, 1),   # a space-to-depth stem, overlapping tiles
    ((2, 5, 7, 9), (3, 5, 1, 1, BLOCK), 1, 0),       # 1x1, odd channel blocks, batch 2
])
def test_a_conv_reading_an_nchw_map_writes_blocks_under_the_same_tiles(target, run_kernel, x, w, stride, pad):
    """Input channels off the block (passes/blocked_layout.py): the NCHW map is read as it is,
    one broadcast value per pixel and input channel, into the same register tile."""
    kernel, shapes = blocked_conv_kernel(x, w, stride, pad)
    sch = Conv2dNCHWc().apply(kernel, target, False)
    assert sch is not None
    result_shape = out_shape(x, w, stride, pad, 1)
    assert_pixel_by_channel_block_tiles(sch.mod["main"], target, result_shape, padded=pad > 0,
                                        window=w[2] * w[3], blocked_input=False)
    np.testing.assert_allclose(run_kernel(sch.mod["main"], shapes, result_shape),
                               run_kernel(kernel, shapes, result_shape), rtol=1e-4, atol=1e-4)


def channel_tiles(x, w, pad, result_shape, target):
    """Whether the tasks are channel tiles over the whole map: the filters hold more than 4x the
    values of the padded map, and there are enough tiles to share out evenly."""
    padded_map = np.prod([*x[:2], x[2] + 2 * pad, x[3] + 2 * pad, *x[4:]])
    blocks = _register_tile(result_shape[3], w[0], vector_registers(target), w[2] * w[3])[1]
    return bool(np.prod(w) > 4 * padded_map) and rows_alone(x[0] * w[0] // blocks, int(target.attrs["num-cores"]))


def assert_pixel_by_channel_block_tiles(func, target, result_shape, padded, window, tiles_rows=False,
                                        blocked_input=True, channel_tiles=False):
    """A tile of pixels x channel blocks, both unrolled, the channel block one vector; the
    input channels of a block unrolled (an input in NCHW has none). One parallel loop: over
    the output rows when a padded map has enough to share out evenly (``rows_alone``), else
    over (batch x rows x channel-block tiles); a task pads the input rows it reads itself. With
    ``channel_tiles`` a task is a tile of channel blocks over the whole map, after a pad pass.

    With 32 vector registers the tile is up to 8 pixels dividing the row (7 with the last tile
    shifted back when no divisor of 5 or more does) x 2 channel blocks, or x 1 block with an odd
    number of blocks; a 1x1 conv whose blocks 3 (or 5) divides takes 3 (5) blocks x up to 5 (3)
    pixels, when the blocks are odd or those pixels divide the row; with an odd number and a
    window wider than 1x1 (``window`` taps), up to 16 pixels (no divisor of 8 or more: shifted back) x 1 block; with 16 registers at most 12
    accumulators, that with a weight vector per block and the broadcast input still fit the 16.
    A one-column map tiles its rows instead."""
    batch, channel_blocks, rows, columns, _ = result_shape
    if tiles_rows:
        rows, columns = columns, rows
    loops = loop_kinds(func)
    unrolled = list(loops.unrolled)
    if blocked_input:  # the block's input channels, four at a time where the whole block spills
        channels = SPILL_FREE_UNROLL if spills_unrolled_loads(target) else BLOCK
        assert channels in unrolled
        unrolled.remove(channels)
    if channel_tiles:
        tiles = loops.parallel[-1]
        assert len(loops.parallel) == (2 if padded else 1) and (batch * channel_blocks) % tiles == 0
        candidates = [batch * channel_blocks // tiles]
    elif padded and not tiles_rows and rows_alone(batch * rows, int(target.attrs["num-cores"])):
        assert loops.parallel == [batch * rows]
        candidates = [extent for extent in set(unrolled) if channel_blocks % extent == 0]
    else:  # (rows x channel tiles) tasks, a pad inside each
        assert len(loops.parallel) == 1
        tiles_per_row = batch * channel_blocks * rows
        assert tiles_per_row % loops.parallel[-1] == 0
        candidates = [tiles_per_row // loops.parallel[-1]]
    if vector_registers(target) >= 32:
        wide = channel_blocks % 2 == 1 and window > 1
        blocks = 2 if channel_blocks % 2 == 0 else 1
        pixels = pixel_tile(columns, 16, 8) if wide else pixel_tile(columns, 8, 5)
        three_or_five = [b for b in (3, 5) if channel_blocks % b == 0][:1]
        if window == 1 and three_or_five:
            odd_pixels = pixel_tile(columns, 16 // three_or_five[0], min(16 // three_or_five[0], 4))
            if channel_blocks % 2 or columns % odd_pixels == 0:
                blocks, pixels = three_or_five[0], odd_pixels
        assert blocks in candidates and blocks in unrolled and pixels in unrolled
    else:
        def fits(blocks):
            others = [extent for extent in unrolled if extent != blocks] or [blocks]
            pixels = max(others)
            return blocks in unrolled and pixels * blocks + blocks + 1 <= 16 and (columns == 1 or pixels > 1)
        assert any(fits(blocks) for blocks in candidates)
    assert loops.vectorized == [BLOCK] * len(loops.vectorized) and len(loops.vectorized) >= 2


def test_a_one_column_map_tiles_its_rows(target, run_kernel):
    """A 1-D conv exported as a 5x1 Conv2d over a 40x1 map: pixels tiled down the rows."""
    x, w = (1, 2, 40, 1, BLOCK), (4, 2, 5, 1, BLOCK, BLOCK)
    kernel, shapes = blocked_conv_kernel(x, w, pad=0)
    sch = Conv2dNCHWc().apply(kernel, target, False)
    result_shape = out_shape(x, w, 1, 0, 1)
    assert_pixel_by_channel_block_tiles(sch.mod["main"], target, result_shape, padded=False,
                                        window=w[2] * w[3], tiles_rows=True)
    assert max(loop_kinds(sch.mod["main"]).unrolled) > 2
    np.testing.assert_allclose(run_kernel(sch.mod["main"], shapes, result_shape),
                               run_kernel(kernel, shapes, result_shape), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mcpu, whole_block", [("znver4", False), ("sapphirerapids", True)])
def test_the_input_channels_are_unrolled_as_far_as_the_registers_hold(mcpu, whole_block):
    """LLVM's Zen scheduling moved the 16 unrolled channels' broadcasts of a 1x1 conv ahead of
    their FMAs and spilled them (40 zmm spills and as many reloads): four channels at a time
    there, the whole block on Intel. The assembly of both has no vector register spilled (the
    timings: docs/benchmarks/models.md)."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    x, w = (1, 8, 20, 76, 16), (8, 8, 1, 1, 16, 16)
    kernel, _ = blocked_conv_kernel(x, w, block=16)
    func = Conv2dNCHWc().apply(kernel, target, False).mod["main"]
    assert (16 in loop_kinds(func).unrolled) == whole_block
    assembly = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                              target=target).inspect_source("asm")
    assert "vfmadd231ps" in assembly
    assert not re.search(r"vmov[au]ps\s+%zmm\d+, -?\d*\(%rsp\)", assembly)


def test_avx2_zen_keeps_the_whole_block_unrolled():
    """Zen 1-3 (AVX2, 8-channel blocks): the unrolled block spilled no more than four at a time."""
    assert not spills_unrolled_loads(tvm.target.Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2}))
    assert spills_unrolled_loads(tvm.target.Target({"kind": "llvm", "mcpu": "znver5", "num-cores": 2}))


def test_the_nchw_rule_declines_a_blocked_conv_and_vice_versa(lowered, prim_funcs, target):
    kernel, _ = blocked_conv_kernel((1, 1, 8, 8, BLOCK), (1, 1, 3, 3, BLOCK, BLOCK), pad=1)
    assert Conv2dNCHW().apply(kernel, target, False) is None
    mod = lowered(lambda x, w: nn.conv2d(x, w, padding=1), x=(1, 16, 8, 8), w=(16, 16, 3, 3))
    for func in prim_funcs(mod).values():
        assert Conv2dNCHWc().apply(func, target, False) is None


@pytest.mark.parametrize("width", [1, 2, 3, 5, 7, 13, 14, 20, 26, 52, 104])
@pytest.mark.parametrize("channel_blocks", [1, 2, 3, 4, 6, 12, 24])
def test_an_avx2_register_tile_fits_the_16_registers_and_is_fma_bound(width, channel_blocks):
    """Accumulators + one weight vector per block + the broadcast input fit 16 registers (a
    3x4 tile, 17, spilled); with 4 or more blocks the tile has one FMA per load or more."""
    pixels, blocks = _register_tile(width, channel_blocks, 16, 9)
    assert channel_blocks % blocks == 0 and pixels <= width
    assert pixels * blocks + blocks + 1 <= 16
    if channel_blocks % 4 == 0 and width >= 2:
        assert pixels * blocks >= pixels + blocks


def test_an_avx2_tile_of_a_13_pixel_row_wastes_the_fewest_columns():
    """2 x 4 (7 tiles, 14 columns computed) over 4 x 3 (4 tiles, 16 columns): Zen 1, 96 channels
    3x3 over 13x13, 371 against 812 us."""
    assert _register_tile(13, 12, 16, 9) == (2, 4)


@pytest.mark.parametrize("width, channel_blocks, window, tile", [
    (80, 15, 1, (5, 3)),   # ppocrv4-rec's 240 -> 240 over 12x80: 53 -> 75 % of the FMA peak
    (7, 5, 1, (3, 5)),     # 5 blocks: 3 pixels, the last tile shifted back
    (160, 6, 1, (5, 3)),   # even blocks, 5 pixels divide the row
    (14, 6, 1, (7, 2)),    # even blocks, 5 pixels would overlap: 4x2 and 7x2 measured no worse
    (80, 4, 1, (8, 2)),    # no 3 or 5 among the blocks
    (104, 3, 9, (13, 1)),  # a 3x3 window keeps its wide one-block tile
])
def test_an_avx512_1x1_conv_tiles_3_or_5_channel_blocks(width, channel_blocks, window, tile):
    """A 1x1 conv's short reduction: 16 accumulators as 5x3 or 3x5 load fewer vectors per FMA
    than 8x1 (conv2d_nchwc._odd_blocks_tile)."""
    assert _register_tile(width, channel_blocks, 32, window) == tile


@pytest.mark.parametrize("pad", [0, 1], ids=["1x1, no pad", "3x3 padded"])
def test_a_quantized_maps_dequantization_is_computed_once_per_value(target, pad):
    """A conv reading a quantized map's bytes (passes/absorb_dequantized_inputs.py) converts each
    byte once, in a block of its own (inlined into the loads it was a conversion per FMA), and
    computes what the unscheduled kernel computes."""
    x_shape, w_shape = (1, 2, 6, 20, BLOCK), (3, 2, 2 * pad + 1, 2 * pad + 1, BLOCK, BLOCK)
    x = relax.Var("x", relax.TensorType(x_shape, "uint8"))
    w = relax.Var("w", relax.TensorType(w_shape, "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x, w]):
        with builder.dataflow():
            centered = relax.op.subtract(relax.op.astype(x, "float32"), relax.const(9.0, "float32"))
            conv = nn.conv2d(centered, w, padding=pad, data_layout=f"NCHW{BLOCK}c",
                             kernel_layout=f"OIHW{BLOCK}i{BLOCK}o", out_layout=f"NCHW{BLOCK}c")
            out = builder.emit_output(nn.relu(conv))
        builder.emit_func_output(out)
    fused = FusePatterns([get_pattern("conv_epilogue")], PatternReport())(builder.get())
    mod = tvm.transform.Sequential(lowering_passes(winograd=False))(fused)
    (kernel,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    sch = Conv2dNCHWc().apply(kernel, target, False)
    assert sch is not None
    blocks = []
    tvm_ffi.structural_walk(sch.mod["main"].body, (tvm.s_tir.SBlock, blocks.append))
    conv_block = next(b for b in blocks if b.name_hint == "conv2d_nchwc_update")
    byte_readers = [b for b in blocks if any(r.source.dtype == "uint8" for r in b.reads)]
    assert byte_readers and conv_block not in byte_readers
    rng = np.random.default_rng(0)
    args = [rng.integers(0, 256, x_shape).astype("uint8"), rng.integers(-9, 9, w_shape).astype("float32"),
            np.array(9.0, "float32")]  # the zero point: a parameter of the composite
    result_shape = (1, 3, 6, 20, BLOCK)

    def run(func):
        out = tvm.runtime.tensor(np.zeros(result_shape, "float32"))
        built = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
        built["main"](*(tvm.runtime.tensor(a) for a in args), out)
        return out.numpy()

    np.testing.assert_array_equal(run(sch.mod["main"]), run(kernel))

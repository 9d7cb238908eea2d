"""frontend/bf16_conv.py: a dense conv2d as the bf16 matmul kernel. Its patch matrix times its
weight matrix is the conv (NCHW and NCHW16c, strides, dilation, asymmetric padding, a batch);
the kernel, built as written for the host, equals that product of bf16-rounded operands; the
rows follow output rows where OW has a divisor that fills a tile; and convs it does not take
are declined with a reason."""

import dataclasses

import ml_dtypes
import numpy as np
import onnxruntime
import pytest
import tvm
from machine import host_target
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from helpers import blocked_weight
from tvm_fusion.frontend.bf16_conv import BF16_PATCHES, emit_bf16_conv2d
from tvm_fusion.frontend.conv_geometry import (ConvGeometry, conv_geometry, flat_rows, oihw_weight, patch_rows,
                                               pixel_major, reads_input_directly, reads_runs, rows_per_output_row,
                                               weight_matrix)
from tvm_fusion.frontend.conv_patches import DIRECT_INPUT, patches_te
from tvm_fusion.passes.pipeline import lowering_passes

HOST = tvm.target.Target(host_target())
BLOCK = 16


def conv_call(shape, weight_shape, layout="NCHW", groups=1, dtype="float32", **attrs):
    """A ``relax.nn.conv2d`` call of a data variable by a constant, normalized (typed)."""
    data = relax.Var("x", relax.TensorType(shape, dtype))
    kernel_layout = "OIHW" if layout == "NCHW" else f"OIHW{BLOCK}i{BLOCK}o"
    weight = relax.const(np.zeros(weight_shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [data]):
        with bb.dataflow():
            out = bb.emit(relax.op.nn.conv2d(data, weight, data_layout=layout, kernel_layout=kernel_layout,
                                             out_layout=layout, groups=groups, **attrs))
            bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()["main"].body.blocks[0].bindings[0].value


def ort_conv(x: np.ndarray, weight: np.ndarray, strides, pads, dilations) -> np.ndarray:
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=strides, pads=pads, dilations=dilations)
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def blocked(x: np.ndarray) -> np.ndarray:
    """NCHW as NCHW16c."""
    n, c, h, w = x.shape
    return np.ascontiguousarray(x.reshape(n, c // BLOCK, BLOCK, h, w).transpose(0, 1, 3, 4, 2))


def unblocked(y: np.ndarray) -> np.ndarray:
    n, blocks, h, w, b = y.shape
    return y.transpose(0, 1, 4, 2, 3).reshape(n, blocks * b, h, w)


CASES = {  # (N, C, H, W), Co, kernel, strides, pads (top, left, bottom, right), dilations
    "3x3": ((1, 32, 9, 11), 48, 3, (1, 1), (1, 1, 1, 1), (1, 1)),
    "1x1-batch": ((2, 16, 5, 6), 32, 1, (1, 1), (0, 0, 0, 0), (1, 1)),
    "strided-dilated-asymmetric": ((1, 32, 15, 13), 32, 3, (2, 1), (1, 0, 2, 1), (2, 1)),
    "prime-width": ((1, 16, 6, 19), 32, 3, (1, 1), (0, 0, 0, 0), (1, 1)),
    "8-channels-column-stride": ((1, 8, 7, 23), 32, 5, (1, 3), (2, 1, 2, 1), (1, 1)),  # basic-pitch's
    "padded-flat-rows": ((2, 16, 3, 17), 32, 3, (1, 1), (1, 1, 1, 1), (1, 1)),  # 102 pixels in 112 rows
    "rgb-stem": ((1, 3, 11, 13), 32, 3, (2, 2), (1, 1, 1, 1), (1, 1)),  # 3 channels padded to 4
}
# each case in NCHW, and in NCHW16c where its channels fill whole blocks
LAYOUT_CASES = [(case, layout) for case in CASES for layout in ("NCHW", "NCHW16c")
                if layout == "NCHW" or CASES[case][0][1] % BLOCK == 0]


@pytest.mark.parametrize("tile_row_depth", [0, 16, 32])
@pytest.mark.parametrize("case, layout", LAYOUT_CASES)
def test_patches_times_weight_matrix_is_the_conv(case, layout, tile_row_depth):
    """Also where the k run pixel major, as the tiles that read the input directly want them:
    tile rows of 16 k (every blocked case's channels fill whole rows), and of 32 k, where a
    narrow input's kernel rows are runs padded to whole tile rows (8 channels by 5: 40 k in 48
    or 64, a stride of 3 along the columns)."""
    shape, out_channels, k, strides, pads, dilations = CASES[case]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    weight = rng.standard_normal((out_channels, shape[1], k, k)).astype(np.float32)
    expected = ort_conv(x, weight, strides, pads, dilations)
    data, kernel = (x, weight) if layout == "NCHW" else (blocked(x), blocked_weight(weight))
    call = conv_call(data.shape, kernel.shape, layout, strides=strides, padding=pads, dilation=dilations)
    geometry = conv_geometry(call, tile_row_depth)
    assert isinstance(geometry, ConvGeometry), geometry
    plain = oihw_weight(kernel, str(call.attrs.kernel_layout))
    np.testing.assert_array_equal(plain, weight)
    product = patch_rows(data, geometry) @ weight_matrix(plain, geometry)  # [pixels, Co]
    n, _, oh, ow = expected.shape
    got = product.reshape(n, oh, ow, out_channels).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def run_bf16_conv(data: np.ndarray, kernel: np.ndarray, layout: str, **attrs) -> np.ndarray:
    """The bf16 kernel as written (no schedule), built for the host."""
    call = conv_call(data.shape, kernel.shape, layout, **attrs)
    geometry = conv_geometry(call)
    matrix = weight_matrix(oihw_weight(kernel, str(call.attrs.kernel_layout)), geometry)
    x = relax.Var("x", relax.TensorType(data.shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(emit_bf16_conv2d(bb, x, geometry, matrix))
        bb.emit_func_output(out)
    lowered = tvm.transform.Sequential(lowering_passes())(bb.get())
    vm = relax.VirtualMachine(tvm.compile(lowered, target=HOST), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(data)).numpy()


@pytest.mark.parametrize("case, layout", [(c, layout) for c, layout in LAYOUT_CASES if c != "1x1-batch"])
def test_the_kernel_is_the_product_of_bf16_operands(case, layout):
    """Within float32 summation error of the float64 product of the bf16-rounded patches and
    weights, and with the input rounded (not the float32 conv)."""
    shape, out_channels, k, strides, pads, dilations = CASES[case]
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    weight = rng.standard_normal((out_channels, shape[1], k, k)).astype(np.float32)
    data, kernel = (x, weight) if layout == "NCHW" else (blocked(x), blocked_weight(weight))
    got = run_bf16_conv(data, kernel, layout, strides=strides, padding=pads, dilation=dilations)
    got = got if layout == "NCHW" else unblocked(got)
    rounded_x, rounded_w = (v.astype(ml_dtypes.bfloat16).astype(np.float32) for v in (x, weight))
    expected = ort_conv(rounded_x, rounded_w, strides, pads, dilations)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    assert np.abs(got - ort_conv(x, weight, strides, pads, dilations)).max() > 1e-3  # bf16 was used


def test_rows_follow_output_rows_unless_the_width_has_no_tile_divisor():
    def geometry(width):
        return ConvGeometry(BLOCK, BLOCK, 1, 32, 8, width, 32, 8, width, (1, 1), (1, 1), (1, 1), (0, 0))
    assert rows_per_output_row(geometry(40))  # tiles of 10
    assert rows_per_output_row(geometry(13))  # one tile per row
    assert not rows_per_output_row(geometry(17))  # prime past 16: tiles of 16 over flat rows
    assert not rows_per_output_row(geometry(38))  # 2 x 19
    assert not rows_per_output_row(geometry(1))  # a conv1d's map: 1-row tiles, 508 of them
    assert not rows_per_output_row(geometry(4))
    assert rows_per_output_row(geometry(7))


def test_flat_rows_are_padded_to_whole_tiles_where_no_large_tile_divides_them():
    def geometry(height, width):
        return ConvGeometry(BLOCK, BLOCK, 1, 32, height, width, 32, height, width, (1, 1), (1, 1), (1, 1), (0, 0))
    assert flat_rows(geometry(25, 19)) == 480  # 475 pixels: tiles of 5 rows, padded to 30 of 16
    assert flat_rows(geometry(50, 38)) == 1900  # tiles of 10
    assert flat_rows(geometry(9, 17)) == 153  # tiles of 9
    assert flat_rows(geometry(1, 13)) == 13  # one tile


@pytest.mark.parametrize("call, reason", [
    (lambda: conv_call((1, 32, 8, 8), (32, 16, 3, 3), groups=2), "grouped"),
    (lambda: conv_call((1, 32, 8, 8), (32, 32, 3, 3), dtype="float16"), "float16"),
    (lambda: conv_call((1, 1, 8, 64), (16, 1, 1, 16)), "1 input channel: a filter over a raw signal"),
    (lambda: conv_call((1, 2, 8, 8), (16, 2, 1, 3)), "a receptive field of 6 values"),
], ids=["grouped", "float16", "one-channel-filter", "two-channel-1x3"])
def test_must_not_take(call, reason):
    declined = conv_geometry(call())
    assert isinstance(declined, str) and reason in declined


def test_an_nchw_input_is_converted_pixel_major_with_its_padding():
    """An RGB stem: its 3 channels padded to 4 per pixel, K over (kh, kw, channel) = 3 x 3 x 4,
    the input converted into [N, H', W', 4] with the conv's padding as zeros, so each of a
    patch row's 3 runs is 12 contiguous values."""
    geometry = conv_geometry(conv_call((1, 3, 8, 24), (32, 3, 3, 3), strides=(2, 2), padding=(1, 1, 1, 1)))
    assert isinstance(geometry, ConvGeometry)
    assert (geometry.patch_channels, geometry.depth) == (4, 36)
    assert geometry.padded_input == (1, 9, 25, 4)  # 2 x 3 + 3 rows, 2 x 11 + 3 columns


def test_takes_8_channels_strided_along_columns():
    """Its float32 kernel gathers each input vector: patches pay from 8 channels there."""
    geometry = conv_geometry(conv_call((1, 8, 12, 30), (32, 8, 5, 5), strides=(1, 3), padding=(2, 1, 2, 1)))
    assert isinstance(geometry, ConvGeometry) and geometry.channels == 8 and geometry.strides == (1, 3)


def test_must_not_take_a_symbolic_shape():
    n = tvm.tirx.Var("n", "int64")
    declined = conv_geometry(conv_call((n, 32, 8, 8), (32, 32, 3, 3)))
    assert declined == "a shape is not static"


def test_bf16_weight_order_matches_the_blocked_patches():
    """In NCHW16c, k runs over (channel block, kh, kw, channel in block): the weight matrix's
    row for (block 1, tap (0, 2), channel 3) holds the weights of input channel 16 + 3 there."""
    weight = np.arange(16 * 32 * 3 * 3, dtype=np.float32).reshape(16, 32, 3, 3)
    geometry = ConvGeometry(BLOCK, BLOCK, 1, 32, 5, 5, 16, 5, 5, (3, 3), (1, 1), (1, 1), (1, 1))
    matrix = weight_matrix(weight, geometry)
    assert matrix.shape == (32 * 9, 16)
    row = ((1 * 3 + 0) * 3 + 2) * BLOCK + 3
    np.testing.assert_array_equal(matrix[row], weight[:, BLOCK + 3, 0, 2])



def direct_geometry(**changes) -> ConvGeometry:
    """A blocked 3x3 conv of 64 channels with output rows of 20 (tiles of 10 or 20), whose AMX
    tiles take 32 k a row (bf16's)."""
    geometry = ConvGeometry(BLOCK, BLOCK, 1, 64, 12, 20, 32, 12, 20, (3, 3), (1, 1), (1, 1), (1, 1),
                            tile_row_depth=32)
    return dataclasses.replace(geometry, **changes)


@pytest.mark.parametrize("changes, direct, run_depth", [
    ({}, True, 192),
    ({"kernel": (1, 1), "padding": (0, 0)}, False, 64),  # its patches are its input, converted as read
    ({"channels": 48}, True, 160),  # a kernel row's 144 k in 5 tile rows
    ({"channels": 48, "dilation": (1, 2)}, False, 144),  # a tile row of 32 k would straddle two taps
    ({"channels": 8, "kernel": (5, 5), "padding": (2, 2)}, False, 40),  # 40 k in 64: too much padding
    ({"channels": 8, "kernel": (3, 39), "padding": (1, 19)}, True, 320),  # basic-pitch's 312 k in 320
    ({"width": 17, "out_width": 17}, False, 192),  # flat rows: a tile's pixels straddle output rows
    ({"data_block": 0}, True, 192),  # NCHW: converted pixel major all the same
    ({"tile_row_depth": 0}, False, 192),  # no AMX tiles to read it
], ids=["3x3-64-channels", "1x1", "48-channels", "48-channels-dilated", "8-channels-5x5", "8-channels-3x39",
        "prime-width", "nchw", "register-tiles"])
def test_which_convs_tiles_read_the_input_directly(changes, direct, run_depth):
    geometry = direct_geometry(**changes)
    assert reads_input_directly(geometry) == direct
    assert pixel_major(geometry) == (direct or not geometry.data_block)
    assert geometry.run_depth == run_depth and geometry.depth == geometry.kernel[0] * run_depth


def test_a_narrow_inputs_padded_runs_read_on_into_zero_weights():
    """basic-pitch's 8-channel 3x39 conv: each kernel row's 312 k padded to 320 (10 tile rows),
    the 8 padding k of a run reading the next pixel (a column more of the converted input,
    zeros past the map) with all-zero weight rows; its 8 output channels are taken (a column
    block of 16 for half the work), where the patches' copies would not pay."""
    call = conv_call((1, 8, 6, 40), (8, 8, 3, 39), padding=(1, 19, 1, 19))
    geometry = conv_geometry(call, 32)
    assert isinstance(geometry, ConvGeometry) and reads_runs(geometry)
    assert geometry.padded_input == (1, 8, 40 + 38 + 1, 8)
    weight = np.random.default_rng(3).standard_normal((8, 8, 3, 39)).astype(np.float32)
    matrix = weight_matrix(weight, geometry)
    assert matrix.shape == (960, 8)
    assert not matrix[312:320].any() and not matrix[632:640].any() and matrix[320:328].any()
    np.testing.assert_array_equal(matrix[320 + 2 * 8 + 5], weight[:, 5, 1, 2])  # kernel row 1, tap 2, channel 5
    assert isinstance(conv_geometry(call), str)  # without AMX: its patches would cost more than the tiles save


def test_a_direct_convs_patches_are_pixel_major_runs_marked_for_the_tiles():
    """Its input converted into [N, H + 2, W + 2, C] (the padding written), k over (kh, kw,
    channel): each kernel row of a patch one run of 3 x 64 values, and the patch block carries
    what the tile loads need to find a row in the converted input."""
    geometry = direct_geometry()
    data = tvm.te.placeholder((1, 4, 12, 20, BLOCK), "float32", "x")
    patches = patches_te(data, geometry, BF16_PATCHES)
    converted = patches.op.input_tensors[0]
    assert [int(d) for d in converted.shape] == [1, 14, 22, 64]
    assert [int(v) for v in patches.op.attrs[DIRECT_INPUT]] == [12, 1, 1, 1, 1, 3 * 64, 64]
    weight = np.arange(32 * 64 * 9, dtype=np.float32).reshape(32, 64, 3, 3)
    row = (1 * 3 + 2) * 64 + 17  # tap (1, 2), channel 17
    np.testing.assert_array_equal(weight_matrix(weight, geometry)[row], weight[:, 17, 1, 2])

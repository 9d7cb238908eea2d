"""frontend/int8_conv.py: a conv of whole numbers as the uint8 x int8 -> int32 kernel on its
input's patches. Built as written for the host (any CPU runs the plain loops), it equals the
float32 conv of the same whole numbers exactly, for inputs of either byte type's offset,
strides, dilation, asymmetric padding (the padding is the offset's byte), a batch, and rows
that do not follow output rows; weights it cannot hold in int8 are refused."""

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_fusion.frontend.conv_geometry import ConvGeometry, patch_rows, rows_per_output_row
from tvm_fusion.frontend.int8_conv import emit_int8_conv2d, int8_conv_weight
from tvm_fusion.passes.pipeline import lowering_passes

BLOCK = 16
GEOMETRIES = {  # ConvGeometry: data block, out block, N, C, H, W, Co, OH, OW, kernel, strides, dilation, padding
    "1x1": ConvGeometry(BLOCK, BLOCK, 1, 64, 6, 10, 32, 6, 10, (1, 1), (1, 1), (1, 1), (0, 0)),
    "3x3-strided-batch": ConvGeometry(BLOCK, BLOCK, 2, 32, 9, 11, 48, 5, 6, (3, 3), (2, 2), (1, 1), (1, 1)),
    "dilated-asymmetric": ConvGeometry(BLOCK, BLOCK, 1, 16, 12, 13, 16, 10, 13, (3, 3), (1, 1), (2, 1), (1, 0)),
    "prime-width": ConvGeometry(BLOCK, BLOCK, 1, 16, 5, 19, 16, 3, 17, (3, 3), (1, 1), (1, 1), (0, 0)),
}


def int8_conv_module(geometry: ConvGeometry, weight: np.ndarray, offset: int) -> tvm.IRModule:
    g = geometry
    data = relax.Var("x", relax.TensorType((g.batch, g.channels // BLOCK, g.height, g.width, BLOCK), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [data]):
        with bb.dataflow():
            out = bb.emit_output(emit_int8_conv2d(bb, data, g, weight, offset))
        bb.emit_func_output(out)
    return tvm.transform.Sequential(lowering_passes())(bb.get())


@pytest.mark.parametrize("offset", [0, 128 + 5], ids=["uint8", "int8-zero-point-5"])
@pytest.mark.parametrize("name", GEOMETRIES)
def test_the_kernel_is_the_float_conv_of_the_same_whole_numbers(name, offset):
    g = GEOMETRIES[name]
    rng = np.random.default_rng(0)
    # v + offset fills [0, 255]: the extremes of the byte and of the weight, with no room to spare
    x = (rng.integers(0, 256, (g.batch, g.channels // BLOCK, g.height, g.width, BLOCK)) - offset).astype(np.float32)
    x.flat[:2] = [-offset, 255 - offset]
    weight = rng.integers(-128, 128, (g.depth, g.out_channels)).astype(np.int8)
    weight.flat[:2] = [-128, 127]
    mod = int8_conv_module(g, weight, offset)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    expected = patch_rows(x, g).astype(np.int64) @ weight.astype(np.int64)  # [pixels, Co]
    n, blocks, oh, ow, b = got.shape
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.transpose(0, 2, 3, 1, 4).reshape(n * oh * ow, blocks * b), expected)
    assert rows_per_output_row(g) == (name != "prime-width")


def test_weights_int8_cannot_hold_are_refused():
    whole = np.array([[-128.0, 127.0], [3.0, -4.0]], np.float32)
    assert int8_conv_weight(whole).dtype == np.int8
    assert int8_conv_weight(whole + 0.5) is None  # not whole numbers: a float conv
    assert int8_conv_weight(whole * 2) is None  # past int8 (a uint8 weight far from its zero point)

"""Int8Convs: a quantized conv (a float32 conv of ``x - x_zp`` by whole-number weights) becomes
the int8 kernel on an AVX512-VNNI target, with AMX-INT8 or without (Zen 4), computing the same
values (an NCHW input's on pixel-major patch runs); convs whose input is not provably bytes,
whose weights int8 cannot hold, which are too small for tiles, in NCHW with patch runs of a
partial group of 4 k, or on a target without AVX512-VNNI stay float32 convs."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

from helpers import blocked_weight
from tvm_fusion.config import parse_config
from tvm_fusion.frontend.conv_patches import DIRECT_INPUT
from tvm_fusion.passes.int8_convs import Int8Convs
from tvm_fusion.passes.pipeline import graph_phases_key, lowering_passes

AMX = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
VNNI_NO_AMX = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
BLOCK = 16


def quantized_conv(channels=64, out_channels=32, size=8, kernel=3, zero_point=7, input_dtype="uint8",
                   weight_scale=1.0, blocked=True, quantized_input=True):
    """x (bytes) -> float32 less its zero point -> NCHW16c -> conv by whole-number weights, as
    the import and the layout phase leave a QLinearConv; ``quantized_input`` False: a float input."""
    rng = np.random.default_rng(1)
    shape = (1, channels, size, size)
    x = relax.Var("x", relax.TensorType(shape, input_dtype if quantized_input else "float32"))
    weight = rng.integers(-128, 128, (out_channels, channels, kernel, kernel)).astype(np.float32) * weight_scale
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            data = x
            if quantized_input:
                data = bb.emit(relax.op.subtract(relax.op.astype(x, "float32"), relax.const(float(zero_point))))
            if blocked:
                data = bb.emit(relax.op.layout_transform(data, lambda n, c, h, w: (n, c // BLOCK, h, w, c % BLOCK)))
                weight = blocked_weight(weight, BLOCK)
            layouts = ("NCHW16c", "OIHW16i16o", "NCHW16c") if blocked else ("NCHW", "OIHW", "NCHW")
            conv = bb.emit(relax.op.nn.conv2d(data, relax.const(weight), padding=kernel // 2,
                                              data_layout=layouts[0], kernel_layout=layouts[1], out_layout=layouts[2]))
            out = bb.emit_output(relax.op.nn.relu(conv))
        bb.emit_func_output(out)
    return bb.get()


def kernel_blocks(func: tvm.tirx.PrimFunc, name: str) -> list:
    found = []
    tvm_ffi.structural_walk(func.body, (tvm.s_tir.SBlock, lambda b: found.append(b) if b.name_hint == name else None))
    return found


def op_names(mod) -> list[str]:
    return [b.value.op.name for b in mod["main"].body.blocks[0].bindings]


def run(mod, x: np.ndarray) -> np.ndarray:
    """The module lowered as the pipeline lowers it (unscheduled: any CPU runs it) on ``x``."""
    lowered = tvm.transform.Sequential(lowering_passes())(mod)
    vm = relax.VirtualMachine(tvm.compile(lowered, target="llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


@pytest.mark.parametrize("target", [AMX, VNNI_NO_AMX], ids=["amx", "vnni-no-amx"])
@pytest.mark.parametrize("input_dtype, zero_point", [("uint8", 7), ("int8", -3)])
def test_a_quantized_conv_becomes_the_int8_kernel_with_the_same_values(input_dtype, zero_point, target):
    before = quantized_conv(input_dtype=input_dtype, zero_point=zero_point)
    after = Int8Convs(target)(before)
    assert op_names(after) == ["relax.astype", "relax.subtract", "relax.layout_transform", "relax.call_tir",
                               "relax.nn.relu"]
    kernel = after["main"].body.blocks[0].bindings[3].value.args[0]
    assert kernel.name_hint == "int8_conv2d" and isinstance(after[kernel], tvm.tirx.PrimFunc)
    # On AMX tiles the 64 channels are whole 64-byte tile rows of k: the tiles read the
    # converted input directly (pixel major, no patch matrix once scheduled); registers keep patches.
    patch_annotations = [block.annotations for block in kernel_blocks(after[kernel], "int8_conv_patches")]
    assert [DIRECT_INPUT in a for a in patch_annotations] == [target is AMX]
    info = np.iinfo(input_dtype)
    x = np.random.default_rng(2).integers(info.min, info.max + 1, (1, 64, 8, 8)).astype(input_dtype)
    np.testing.assert_array_equal(run(after, x), run(before, x))


MUST_NOT = {
    "a float input": dict(quantized_input=False),
    "an input whose zero is no byte": dict(zero_point=300),
    "fractional weights": dict(weight_scale=0.5),
    "weights past int8": dict(weight_scale=2.0),
    "fewer than 64 products per value": dict(channels=16, kernel=1),
    # an NCHW input's pixel-major patch runs must fill whole groups of 4 k: 10 x 3 x 3 = 90 do not
    "an NCHW input of 10 channels": dict(blocked=False, channels=10),
    "a 3x3 output (9 pixels)": dict(size=3),
}


@pytest.mark.parametrize("target", [AMX, VNNI_NO_AMX], ids=["amx", "vnni-no-amx"])
def test_an_nchw_quantized_conv_becomes_the_int8_kernel_on_pixel_major_patches(target):
    """An RGB stem's shape (3 channels, padded to 4 per pixel: K = 4 x 7 x 7): its input is
    converted pixel major into bytes, each kernel row of a patch one run, the padding the zero
    point's byte; the same values as the float32 conv of whole numbers."""
    before = quantized_conv(channels=3, out_channels=32, size=16, kernel=7, blocked=False)
    after = Int8Convs(target)(before)
    assert op_names(after) == ["relax.astype", "relax.subtract", "relax.call_tir", "relax.nn.relu"]
    kernel = after["main"].body.blocks[0].bindings[2].value.args[0]
    (patches,) = kernel_blocks(after[kernel], "int8_conv_patches")
    assert [int(v) for v in patches.annotations["tvm_fusion.patch_loops"]] == [7, 7 * 4]
    x = np.random.default_rng(3).integers(0, 256, (1, 3, 16, 16)).astype("uint8")
    np.testing.assert_array_equal(run(after, x), run(before, x))


@pytest.mark.parametrize("input_dtype, zero_point", [("uint8", 7), ("int8", -3)])
def test_the_kernel_reads_a_uint8_maps_bytes_not_their_float32_copy(input_dtype, zero_point):
    """``astype(x, float32) - zp`` of uint8 bytes right before the conv: the kernel reads ``x``
    itself (the bytes it would convert the copy back to); an int8 map (its bytes are not the
    kernel's, which are offset by 128) keeps the float32 copy. Same values either way."""
    before = quantized_conv(channels=64, size=8, kernel=3, blocked=False, input_dtype=input_dtype,
                            zero_point=zero_point)
    after = Int8Convs(AMX)(before)
    call = next(b.value for b in after["main"].body.blocks[0].bindings if b.value.op.name == "relax.call_tir")
    data = call.args[1][0]
    assert data.same_as(after["main"].params[0]) == (input_dtype == "uint8")
    info = np.iinfo(input_dtype)
    x = np.random.default_rng(4).integers(info.min, info.max + 1, (1, 64, 8, 8)).astype(input_dtype)
    np.testing.assert_array_equal(run(after, x), run(before, x))


@pytest.mark.parametrize("case", MUST_NOT)
def test_must_not_rewrite(case):
    before = quantized_conv(**MUST_NOT[case])
    tvm.ir.assert_structural_equal(Int8Convs(AMX)(before), before)


@pytest.mark.parametrize("mcpu", ["znver3", "skylake-avx512"], ids=["avx2", "avx512-no-vnni"])
def test_must_not_rewrite_without_vnni(mcpu):
    """No ``vpdpbusd`` (AVX2 only, or AVX-512 before VNNI): the float32 conv stays."""
    before = quantized_conv()
    tvm.ir.assert_structural_equal(Int8Convs(tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))(before), before)


def test_the_fused_graph_of_a_vnni_target_is_its_own():
    """The graph phases differ with AVX512-VNNI (a multi-target compile must not share them), and
    an AMX target's are a VNNI one's (both rewrite the same convs)."""
    configs = [parse_config({"target": {"kind": "llvm", "mcpu": mcpu, "num-cores": 2},
                             "pipeline": {"conv_layout": "NCHWc"}}, name=mcpu)
               for mcpu in ("sapphirerapids", "znver4", "skylake-avx512")]
    amx, vnni, no_vnni = (graph_phases_key(config) for config in configs)
    assert amx == vnni != no_vnni

"""The int8 matmul and conv kernels (frontend/integer_matmul.py, frontend/int8_conv.py) as the
int8 rules' tests build them: one lowered module around each, the kernel found by name,
scheduled by a rule, read as assembly."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvm_fusion.frontend.conv_geometry import ConvGeometry
from tvm_fusion.frontend.int8_conv import emit_int8_conv2d
from tvm_fusion.frontend.integer_matmul import emit_integer_matmul
from tvm_fusion.passes.pipeline import lowering_passes


def int8_module(m, k: int, n: int, dtype: str = "uint8", seed: int = 0):
    """main(a[m, k]) = float32(sum_k (a - 3) * centered[k, n]) through the int8 kernel (``m`` a
    tuple: the leading axes), lowered (one fused kernel: the sum, its corrections, the
    conversion); and ``centered``."""
    rng = np.random.default_rng(seed)
    centered = rng.integers(-140, 116, (k, n))  # some columns past int8: shifted
    a = relax.Var("a", relax.TensorType((*(m if isinstance(m, tuple) else (m,)), k), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [a]):
        with bb.dataflow():
            out = bb.emit_output(emit_integer_matmul(bb, a, 3, centered))
        bb.emit_func_output(out)
    return tvm.transform.Sequential(lowering_passes())(bb.get()), centered


CONVS = {  # ConvGeometry: data block, out block, N, C, H, W, Co, OH, OW, kernel, strides, dilation, padding
    "3x3-rows-of-10": ConvGeometry(16, 16, 1, 32, 20, 40, 64, 20, 40, (3, 3), (1, 1), (1, 1), (1, 1)),
    "1x1-batch": ConvGeometry(16, 16, 2, 64, 7, 7, 32, 7, 7, (1, 1), (1, 1), (1, 1), (0, 0)),
    "strided-prime-width": ConvGeometry(16, 16, 1, 16, 17, 33, 48, 9, 17, (3, 3), (2, 2), (1, 1), (1, 1)),
    # 2 x 3 x 17 = 102 pixels (no divisor from 8 to 16): 112 patch rows, 10 of them padding
    "batch-padded-rows": ConvGeometry(16, 16, 2, 16, 3, 17, 32, 3, 17, (3, 3), (1, 1), (1, 1), (1, 1)),
}
# An NCHW input (an RGB stem: 3 channels padded to 4 per pixel), converted pixel major: each
# kernel row of a patch one run of 7 x 4 bytes.
RGB_STEM = ConvGeometry(0, 16, 1, 3, 32, 32, 32, 16, 16, (7, 7), (2, 2), (1, 1), (3, 3))
# Convs whose AMX tiles read the converted input directly (``conv_geometry.reads_input_directly``):
# channels in whole 64-byte tile rows, a 3x3 at stride 1 and a strided, dilated one of a batch; and
# a 16-channel 3x3 read by kernel rows, each run of 48 bytes padded to a tile row of 64.
DIRECT_CONVS = {
    "3x3-direct": ConvGeometry(16, 16, 1, 64, 20, 40, 64, 20, 40, (3, 3), (1, 1), (1, 1), (1, 1), tile_row_depth=64),
    "strided-dilated-batch-direct": ConvGeometry(16, 16, 2, 128, 15, 28, 32, 8, 14, (3, 3), (2, 2), (2, 1), (1, 1),
                                                 tile_row_depth=64),
    "16-channels-runs": ConvGeometry(16, 16, 1, 16, 10, 24, 32, 10, 24, (3, 3), (1, 1), (1, 1), (1, 1),
                                     tile_row_depth=64),
}


def input_shape(geometry: ConvGeometry) -> tuple[int, ...]:
    """The conv's input shape: NCHW16c, or NCHW where ``data_block`` is 0."""
    g = geometry
    if g.data_block:
        return (g.batch, g.channels // g.data_block, g.height, g.width, g.data_block)
    return (g.batch, g.channels, g.height, g.width)


def int8_conv_module(geometry: ConvGeometry, offset: int = 3, seed: int = 0) -> tvm.IRModule:
    """main(x) = round(conv(x, w) * 0.01) through the int8 conv kernel (a requantization's
    shape of epilogue), lowered; ``x`` (``input_shape``) float32 whole numbers with ``x + offset`` bytes."""
    g = geometry
    weight = np.random.default_rng(seed).integers(-128, 128, (g.depth, g.out_channels)).astype(np.int8)
    x = relax.Var("x", relax.TensorType(input_shape(g), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            total = emit_int8_conv2d(bb, x, g, weight, offset)
            out = bb.emit_output(relax.op.round(relax.op.multiply(total, relax.const(0.01, "float32"))))
        bb.emit_func_output(out)
    return tvm.transform.Sequential(lowering_passes())(bb.get())


def assert_scheduled_conv_is_exact(geometry: ConvGeometry, rule, target) -> None:
    """``int8_conv_module``'s kernel scheduled by ``rule`` for ``target`` (one the host runs)
    gives the values of the kernel as written: the same int32 sums, converted and requantized
    alike."""
    g = geometry
    mod = int8_conv_module(g)
    x = (np.random.default_rng(4).integers(0, 256, input_shape(g)) - 3).astype(np.float32)
    results = []
    for module in (mod, scheduled(mod, rule, target, kernel=int8_conv_kernel)):
        vm = relax.VirtualMachine(tvm.compile(module, target=target), tvm.cpu())
        results.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(results[1], results[0])


def int8_conv_kernel(mod: tvm.IRModule) -> tuple[tvm.ir.GlobalVar, tvm.tirx.PrimFunc]:
    (found,) = [(gv, f) for gv, f in mod.functions_items() if "int8_conv2d" in gv.name_hint]
    return found


def int8_kernel(mod: tvm.IRModule) -> tuple[tvm.ir.GlobalVar, tvm.tirx.PrimFunc]:
    (found,) = [(gv, f) for gv, f in mod.functions_items() if "int8_matmul" in gv.name_hint]
    return found


def scheduled(mod: tvm.IRModule, rule, target, kernel=int8_kernel) -> tvm.IRModule:
    """``mod`` with its int8 kernel (the one ``kernel(mod)`` finds) scheduled by ``rule``
    (which must take it)."""
    out = mod.clone()
    gvar, func = kernel(mod)
    sch = rule.apply(func, target, False)
    assert sch is not None
    out[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    return out


def kernel_assembly(mod: tvm.IRModule, target) -> str:
    (kernels,) = tvm.compile(mod, target=target).mod.imports
    return kernels.inspect_source("s")

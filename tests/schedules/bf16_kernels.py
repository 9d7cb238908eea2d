"""The bf16 matmul kernel (frontend/bf16_matmul.py) and the conv kernel built on it
(frontend/bf16_conv.py) as the bf16 rules' tests build them: one lowered module around each
(the kernel, its prologue and a float32 epilogue), and numpy references that round both
operands to bf16 and sum in float64."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import tvm
from tvm import relax, te

from tvm_fusion.frontend.bf16_conv import conv_te, emit_bf16_conv2d
from tvm_fusion.frontend.conv_geometry import ConvGeometry, patch_rows, weight_matrix
from tvm_fusion.frontend.bf16_matmul import emit_bf16_matmul, pack_weight
from tvm_fusion.passes.pipeline import lowering_passes


def leading(m) -> tuple:
    return m if isinstance(m, tuple) else (m,)


def bf16_module(m, k: int, n: int, seed: int = 0):
    """main(a[m.., k]) = relu(a @ w + 1) through the bf16 kernel (``m`` a tuple: the leading
    axes), lowered (one fused kernel: the prologue, the sum, the epilogue); and ``w``."""
    weight = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    a = relax.Var("a", relax.TensorType((*leading(m), k), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a]):
        with bb.dataflow():
            total = emit_bf16_matmul(bb, a, weight)
            out = bb.emit_output(relax.op.nn.relu(relax.op.add(total, relax.const(1.0, "float32"))))
        bb.emit_func_output(out)
    return tvm.transform.Sequential(lowering_passes())(bb.get()), weight


def assert_bf16_result(got: np.ndarray, a: np.ndarray, weight: np.ndarray) -> None:
    """``got`` is relu(bf16(a) @ bf16(w) + 1) summed in float32 in any order: within the
    recursive-summation bound K * 2^-24 * (|a| @ |w|) of the float64 sum of the same bf16
    products, plus the epilogue's rounding (2^-23 of the value)."""
    ra, rw = (x.astype(ml_dtypes.bfloat16).astype(np.float64) for x in (a, weight))
    expected = np.maximum(ra @ rw + 1, 0)
    bound = weight.shape[0] * 2.0**-24 * (np.abs(ra) @ np.abs(rw)) + 2.0**-23 * (np.abs(expected) + 1)
    assert got.shape == expected.shape
    excess = np.abs(got - expected) - bound
    assert np.all(excess <= 0), f"max error past the bound: {excess.max()}"


def bf16_conv_module(geometry: ConvGeometry, seed: int = 0, scale: float | None = None):
    """main(x) = relu(conv(x, w) + 1) through the bf16 conv kernel, lowered; and ``w`` as the
    ``[K, Co]`` matrix its patches multiply. ``x`` is NCHW16c (16-channel blocks) or NCHW, as
    ``geometry.data_block`` says. With ``scale`` the conv reads ``x * scale``, computed in the
    same kernel (as a composite's affine before its conv is)."""
    g = geometry
    plain = np.random.default_rng(seed).standard_normal((g.out_channels, g.channels, *g.kernel)).astype(np.float32)
    matrix = weight_matrix(plain, g)
    shape = (g.batch, g.channels // g.data_block, g.height, g.width, g.data_block) if g.data_block else (
        g.batch, g.channels, g.height, g.width)
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            if scale is None:
                total = emit_bf16_conv2d(bb, x, g, matrix)
            else:
                packed = relax.const(tvm.runtime.tensor(pack_weight(matrix)))
                total = bb.emit_te(lambda data, w: conv_te(te.compute(data.shape, lambda *i: data[i] * scale,
                                                                       name="T_multiply"), w, g), x, packed,
                                   primfunc_name_hint="bf16_conv2d")
            out = bb.emit_output(relax.op.nn.relu(relax.op.add(total, relax.const(1.0, "float32"))))
        bb.emit_func_output(out)
    return tvm.transform.Sequential(lowering_passes())(bb.get()), matrix


def assert_bf16_conv_result(got: np.ndarray, x: np.ndarray, matrix: np.ndarray, geometry: ConvGeometry) -> None:
    """``got`` (the conv's output layout) is relu(patches(bf16(x)) @ bf16(w) + 1) within
    ``assert_bf16_result``'s bound, read back as [pixels, Co]."""
    g = geometry
    if g.out_block:  # [N, Co/b, OH, OW, b] -> [pixels, Co]
        rows = got.transpose(0, 2, 3, 1, 4).reshape(g.pixels, g.out_channels)
    else:
        rows = got.transpose(0, 2, 3, 1).reshape(g.pixels, g.out_channels)
    assert_bf16_result(rows, patch_rows(x, g), matrix)


def bf16_kernel(mod: tvm.IRModule) -> tuple[tvm.ir.GlobalVar, tvm.tirx.PrimFunc]:
    (found,) = [(gv, f) for gv, f in mod.functions_items() if "bf16_matmul" in gv.name_hint or "bf16_conv" in gv.name_hint]
    return found


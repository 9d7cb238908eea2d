"""The bf16 matmul kernel (frontend/bf16_matmul.py) as the bf16 rules' tests build it: one
lowered module around it (the kernel, its prologue and a float32 epilogue), and a numpy
reference that rounds both operands to bf16 and sums in float64."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import tvm
from tvm import relax

from tvm_fusion.frontend.bf16_matmul import emit_bf16_matmul
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


def bf16_kernel(mod: tvm.IRModule) -> tuple[tvm.ir.GlobalVar, tvm.tirx.PrimFunc]:
    (found,) = [(gv, f) for gv, f in mod.functions_items() if "bf16_matmul" in gv.name_hint]
    return found


"""The bf16 matmul kernel (frontend/bf16_matmul.py; its AMX schedule: schedules/cpu/test_bf16_matmul_amx.py):
the weight's rounding and packing, the activation's rounding against ml_dtypes, and the kernel
as written (no schedule rule: bf16 loads widened to float32) against a numpy reference on any
x86 host, at odd shapes; and the operands it declines."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from machine import host_target
from tvm import relax, te

from tvm_fusion.frontend.bf16_matmul import (activation_te, bf16_matmul_applies, bf16_matmul_declines,
                                             emit_bf16_matmul, pack_weight)
from tvm_fusion.passes.pipeline import lowering_passes

HOST = tvm.target.Target(host_target())


def test_weight_is_rounded_to_nearest_even_and_packed_in_pairs_of_k():
    weight = np.random.default_rng(0).standard_normal((5, 20)).astype(np.float32)
    weight[0, 0] = 1 + 2.0**-8  # halfway between two bf16: to the even one, 1.0
    weight[0, 1] = 1 + 3 * 2.0**-8  # halfway: up, to 1 + 2^-6
    packed = pack_weight(weight)
    assert packed.shape == (2, 3, 16, 2) and packed.dtype == np.uint16
    values = packed.view(ml_dtypes.bfloat16).astype(np.float32)
    rounded = weight.astype(ml_dtypes.bfloat16).astype(np.float32)
    for j, q, c, r in np.ndindex(*packed.shape):
        k, n = 2 * q + r, 16 * j + c
        assert values[j, q, c, r] == (rounded[k, n] if k < 5 and n < 20 else 0)
    assert values[0, 0, 0, 0] == 1.0 and values[0, 0, 1, 0] == 1 + 2.0**-6


def test_activation_rounding_matches_ml_dtypes():
    specials = [0.0, -0.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, np.finfo(np.float32).max, np.inf, -np.inf, np.nan,
                1e-40, -3.3895314e38]
    x = np.concatenate([np.asarray(specials, np.float32),
                        np.random.default_rng(1).standard_normal(53).astype(np.float32)]).reshape(1, -1)
    data = te.placeholder(x.shape, "float32", name="data")
    out = activation_te(data, x.shape[1] + 1)
    built = tvm.compile(te.create_prim_func([data, out]).with_attr("global_symbol", "main"), target=HOST)
    got = tvm.runtime.empty((1, x.shape[1] + 1), "uint16", tvm.cpu())
    built["main"](tvm.runtime.tensor(x), got)
    expected = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got.numpy()[:, :-1][~nan], expected[~nan])
    assert np.isnan(got.numpy()[:, :-1][nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    assert got.numpy()[0, -1] == 0  # the padding


def bf16_matmul_module(shape: tuple, weight: np.ndarray, row_multiple: int = 1) -> tvm.IRModule:
    data = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [data]):
        with bb.dataflow():
            out = bb.emit_output(emit_bf16_matmul(bb, data, weight, row_multiple=row_multiple))
        bb.emit_func_output(out)
    return tvm.transform.Sequential(lowering_passes())(bb.get())


@pytest.mark.parametrize("shape, n", [((1, 13), 20), ((7, 64), 16), ((7, 33), 5), ((2, 3, 13), 20), ((13,), 20),
                                      ((16, 300), 100)])
def test_kernel_as_written_matches_the_bf16_reference(shape, n):
    """M=1, M=7, odd K (padded to even), N not a multiple of 16 (padded, sliced), batched 3-D
    and rank-1 data: within the float32 summation bound K * 2^-24 * (|a| @ |w|) of the float64
    sum of the bf16-rounded operands."""
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((shape[-1], n)).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    mod = bf16_matmul_module(shape, weight)
    kernels = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert not any("activation" in name for name in kernels)  # the rounding is inside the kernel
    got = relax.VirtualMachine(tvm.compile(mod, target=HOST), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    ra, rw = (v.astype(ml_dtypes.bfloat16).astype(np.float64) for v in (x, weight))
    assert got.shape == (*shape[:-1], n)
    assert np.all(np.abs(got - ra @ rw) <= shape[-1] * 2.0**-24 * (np.abs(ra) @ np.abs(rw)))


@pytest.mark.parametrize("shape, padded", [((197, 40), 200), ((2, 7, 40), 16), ((5, 40), 8), ((8, 40), None),
                                           ((3, 40), None), ((40,), None)])
def test_rows_are_padded_to_the_register_tiles_multiple(shape, padded):
    """With ``row_multiple`` 4 (vdpbf16ps tiles): 197 rows are 200 in the kernel (tiles of 4, not
    197 tiles of 1), a batch of 2 x 7 is 16, 5 is 8; a multiple of 4, at most 4 rows, and rank-1
    data are not padded. The padding rows are sliced off: the outputs equal the unpadded kernel's."""
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((shape[-1], 20)).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    mod = bf16_matmul_module(shape, weight, row_multiple=4)
    (kernel,) = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and "bf16_activation" in f.script()]
    activation = next(buf for buf in kernel.body.block.alloc_buffers if buf.name == "bf16_activation")
    assert int(activation.shape[0]) == (padded or int(np.prod(shape[:-1])))
    run = lambda m: relax.VirtualMachine(tvm.compile(m, target=HOST), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_array_equal(run(mod), run(bf16_matmul_module(shape, weight)))


def test_declines_with_a_reason():
    def data(shape, dtype="float32"):
        return relax.Var("x", relax.TensorType(shape, dtype))

    weight = np.ones((8, 4), np.float32)
    assert bf16_matmul_applies(data((2, 8)), weight)
    assert bf16_matmul_declines(data((2, 8)), None) == "the weight is not a constant"
    assert "not [K, N]" in bf16_matmul_declines(data((2, 8)), np.ones((2, 8, 4), np.float32))
    assert "not float32" in bf16_matmul_declines(data((2, 8), "float16"), weight.astype(np.float16))
    assert "not float32" in bf16_matmul_declines(data((2, 8)), weight.astype(np.float64))
    assert "not static" in bf16_matmul_declines(data((2, tvm.tirx.Var("k", "int64"))), weight)
    assert "rank or shape" in bf16_matmul_declines(relax.Var("x", relax.TensorType(None, "float32", ndim=-1)), weight)

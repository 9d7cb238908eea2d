"""Exporter-decomposed RMSNorm (Llama, T5) -> nn.rms_norm."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from rewrite_helpers import apply_rule
from test_skip_layernorm import ATOL, RTOL, compile_and_run


@I.ir_module
class LlamaExport:
    """LlamaRMSNorm as torch.onnx.export writes it (Pow, ReduceMean, Add, Sqrt, Div(1, .), Mul, Mul)."""

    @R.function
    def main(x: R.Tensor((1, 8, 32), "float32"), w: R.Tensor((32,), "float32")) -> R.Tensor((1, 8, 32), "float32"):
        with R.dataflow():
            lv = R.power(x, R.const(2.0, "float32"))
            lv1 = R.mean(lv, axis=[-1], keepdims=True)
            lv2 = R.add(lv1, R.const(1e-6, "float32"))
            lv3 = R.sqrt(lv2)
            lv4 = R.divide(R.const(1.0, "float32"), lv3)
            lv5 = R.multiply(x, lv4)
            gv = R.multiply(w, lv5)
            R.output(gv)
        return gv


def test_llama_export_becomes_rms_norm():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 8, 32), "float32"), w: R.Tensor((32,), "float32")) -> R.Tensor((1, 8, 32), "float32"):
            with R.dataflow():
                gv = R.nn.rms_norm(x, w, axes=[-1], epsilon=9.9999999747524271e-07)  # float32(1e-6)
                R.output(gv)
            return gv

    after, report = apply_rule(LlamaExport, "rmsnorm_decomposed")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.instances[0].absorbed == ["lv", "lv1", "lv2", "lv3", "lv4", "lv5", "gv"]
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, 8, 32)).astype("float32"), rng.standard_normal(32).astype("float32")]
    np.testing.assert_allclose(compile_and_run(after, arrays), compile_and_run(LlamaExport, arrays),
                               rtol=RTOL, atol=ATOL)


def half_precision_norm(restore_dtype: str):
    """Llama on a float16 input: cast to float32, normalize, cast back, multiply by the weight."""
    x = relax.Var("x", relax.TensorType((4, 32), "float16"))
    w = relax.Var("w", relax.TensorType((32,), restore_dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            xf = bb.emit(relax.op.astype(x, "float32"))
            ms = bb.emit(relax.op.mean(bb.emit(relax.op.multiply(xf, xf)), axis=[-1], keepdims=True))
            std = bb.emit(relax.op.sqrt(bb.emit(relax.op.add(ms, relax.const(1e-6, "float32")))))
            normed = bb.emit(relax.op.divide(xf, std))
            out = bb.emit_output(relax.op.multiply(bb.emit(relax.op.astype(normed, restore_dtype)), w))
        bb.emit_func_output(out)
    return bb.get()


def test_float16_input_computed_in_float32():
    before = half_precision_norm("float16")
    after, report = apply_rule(before, "rmsnorm_decomposed")
    assert report.fired["rmsnorm_decomposed"] == 1
    ops = [b.value.op.name for b in after["main"].body.blocks[0].bindings]
    assert "relax.nn.rms_norm" in ops and "relax.mean" not in ops
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((4, 32)).astype("float16"), rng.standard_normal(32).astype("float16")]
    # float16 output: tolerance of a few float16 ulps.
    np.testing.assert_allclose(compile_and_run(after, arrays).astype("float32"),
                               compile_and_run(before, arrays).astype("float32"), rtol=2e-3, atol=2e-3)


def test_must_not_rewrite_when_cast_back_to_another_dtype():
    before = half_precision_norm("bfloat16")
    after, report = apply_rule(before, "rmsnorm_decomposed")
    assert report.near_misses[0].reason == (
        "dtype mismatch: the input is float16, computed in float32, but cast back to bfloat16")
    # The float32 core is still a plain RMSNorm; the cast to bfloat16 and the weight stay as written.
    ops = [b.value.op.name for b in after["main"].body.blocks[0].bindings]
    assert ops[-2:] == ["relax.astype", "relax.multiply"]
    assert report.fired["rmsnorm_decomposed"] <= 1


def chain(eps=1e-6, axis=-1, extra_use=False, shape=(2, 4, 32)):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    params = [x]
    if eps is None:
        params.append(relax.Var("eps", relax.TensorType((), "float32")))
    eps_value = params[-1] if eps is None else relax.const(eps, "float32")
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            ms = bb.emit(relax.op.mean(bb.emit(relax.op.power(x, relax.const(2.0, "float32"))),
                                       axis=[axis], keepdims=True))
            std = bb.emit(relax.op.sqrt(bb.emit(relax.op.add(ms, eps_value))))
            out = relax.op.divide(x, std)
            if extra_use:
                out = relax.op.add(bb.emit(out), std)  # std has a second consumer
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("kwargs, reason", [
    ({"eps": None}, "epsilon is not a constant"),
    ({"axis": 1}, "the mean-square mean is over axes [1] of a rank-3 tensor, not the trailing axes"),
    ({"extra_use": True}, "the intermediate std (lv3) is also used outside the chain"),
])
def test_must_not_rewrite(kwargs, reason):
    before = chain(**kwargs)
    after, report = apply_rule(before, "rmsnorm_decomposed")
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == [reason]


def test_symbolic_rows_become_rms_norm():
    n = tvm.tirx.Var("n", "int64")
    before = chain(shape=(1, n, 32))
    after, report = apply_rule(before, "rmsnorm_decomposed")
    assert report.fired["rmsnorm_decomposed"] == 1
    (binding,) = after["main"].body.blocks[0].bindings
    assert binding.value.op.name == "relax.nn.rms_norm"
    rng = np.random.default_rng(0)
    for rows in (3, 7):  # one module, any sequence length
        x = rng.standard_normal((1, rows, 32)).astype("float32")
        np.testing.assert_allclose(compile_and_run(after, [x]), compile_and_run(before, [x]), rtol=RTOL, atol=ATOL)


def test_must_not_rewrite_a_symbolic_normalized_axis():
    before = chain(shape=(1, tvm.tirx.Var("n", "int64"), tvm.tirx.Var("hidden", "int64")))
    after, report = apply_rule(before, "rmsnorm_decomposed")
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == [
        "the input (1, n, hidden) has the symbolic dim hidden at axis 2 (normalized axis): "
        "the kernel needs it static (bind it)"]

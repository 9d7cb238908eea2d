"""Exporter-decomposed LayerNorm (opset < 17) -> nn.layer_norm."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from rewrite_helpers import apply_rule
from test_skip_layernorm import ATOL, DATA, RTOL, check_exporter_block, compile_and_run


@I.ir_module
class TorchExport:
    """nn.LayerNorm(16) as torch.onnx.export writes it at opset 14, imported by TVM."""

    @R.function
    def main(x: R.Tensor((2, 4, 16), "float32"), gamma: R.Tensor((16,), "float32"),
             beta: R.Tensor((16,), "float32")) -> R.Tensor((2, 4, 16), "float32"):
        with R.dataflow():
            lv = R.mean(x, axis=[-1], keepdims=True)
            lv1 = R.subtract(x, lv)
            lv2 = R.power(lv1, R.const(2.0, "float32"))
            lv3 = R.mean(lv2, axis=[-1], keepdims=True)
            lv4 = R.add(lv3, R.const(1e-12, "float32"))
            lv5 = R.sqrt(lv4)
            lv6 = R.divide(lv1, lv5)
            lv7 = R.multiply(lv6, gamma)
            gv = R.add(lv7, beta)
            R.output(gv)
        return gv


def test_torch_export_becomes_layer_norm():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 4, 16), "float32"), gamma: R.Tensor((16,), "float32"),
                 beta: R.Tensor((16,), "float32")) -> R.Tensor((2, 4, 16), "float32"):
            with R.dataflow():
                gv = R.nn.layer_norm(x, gamma, beta, axes=[-1], epsilon=9.999999960041972e-13)  # float32(1e-12)
                R.output(gv)
            return gv

    after, report = apply_rule(TorchExport, "layernorm_decomposed")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["layernorm_decomposed"] == 1
    [instance] = report.instances
    assert instance.absorbed == ["lv", "lv1", "lv2", "lv3", "lv4", "lv5", "lv6", "lv7", "gv"]
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype("float32") * 3 + 1 for s in [(2, 4, 16), (16,), (16,)]]
    np.testing.assert_allclose(compile_and_run(after, arrays), compile_and_run(TorchExport, arrays),
                               rtol=RTOL, atol=ATOL)


def test_without_affine_params_uses_unit_gamma_and_zero_beta():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((3, 8), "float32")) -> R.Tensor((3, 8), "float32"):
            with R.dataflow():
                lv = R.mean(x, axis=[1], keepdims=True)
                lv1 = R.subtract(x, lv)
                lv2 = R.multiply(lv1, lv1)
                lv3 = R.mean(lv2, axis=[1], keepdims=True)
                lv4 = R.add(lv3, R.const(1e-5, "float32"))
                lv5 = R.sqrt(lv4)
                gv = R.divide(lv1, lv5)
                R.output(gv)
            return gv

    after, report = apply_rule(Before, "layernorm_decomposed")
    assert report.fired["layernorm_decomposed"] == 1
    x = np.random.default_rng(2).standard_normal((3, 8)).astype("float32")
    np.testing.assert_allclose(compile_and_run(after, [x]), compile_and_run(Before, [x]), rtol=RTOL, atol=ATOL)


def test_bert_export_at_opset_14_fuses_every_layer_norm():
    """Embeddings + attention output + FFN output: each decomposed, then fused with its residual."""
    optimized = check_exporter_block(DATA / "bert_block_opset14.onnx",
                                     ["input_ids:1x8", "attention_mask:1x8"],
                                     {"layernorm_decomposed": 3, "skip_layernorm": 3})
    assert optimized.report.variants["skip_layernorm.bias_skip"] == 3


def test_gpt2_export_at_opset_14_fuses_every_layer_norm():
    check_exporter_block(DATA / "gpt2_block_opset14.onnx", ["input_ids:1x8"],
                         {"layernorm_decomposed": 3, "skip_layernorm": 3})


def decomposed(eps=None, axes=(-1,), second_axes=None, extra_use=False, shape=(2, 4, 16)):
    """The TorchExport chain with one thing changed; ``eps=None`` makes epsilon a parameter."""
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    params = [x]
    if eps is None:
        eps_value = relax.Var("eps", relax.TensorType((), "float32"))
        params.append(eps_value)
    else:
        eps_value = relax.const(eps, "float32")
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            mean = bb.emit(relax.op.mean(x, axis=list(axes), keepdims=True))
            centered = bb.emit(relax.op.subtract(x, mean))
            square = bb.emit(relax.op.power(centered, relax.const(2.0, "float32")))
            variance = bb.emit(relax.op.mean(square, axis=list(second_axes or axes), keepdims=True))
            std = bb.emit(relax.op.sqrt(bb.emit(relax.op.add(variance, eps_value))))
            out = relax.op.divide(centered, std)
            if extra_use:
                out = relax.op.add(bb.emit(out), mean)  # the mean has a second consumer
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("kwargs, reason", [
    ({"eps": None}, "epsilon is not a constant"),
    ({"eps": 1e-5, "axes": (1,)}, "the first mean is over axes [1] of a rank-3 tensor, not the trailing axes"),
    ({"eps": 1e-5, "second_axes": (1, 2)}, "the two means reduce different axes"),
    ({"eps": 1e-5, "extra_use": True}, "the intermediate mean (lv) is also used outside the chain"),
])
def test_must_not_rewrite(kwargs, reason):
    before = decomposed(**kwargs)
    after, report = apply_rule(before, "layernorm_decomposed")
    tvm.ir.assert_structural_equal(after, before)
    assert not report.fired
    assert [m.reason for m in report.near_misses] == [reason]


@I.ir_module
class SymbolicExport:
    """TorchExport with a symbolic sequence length: [1, n, 16]."""

    @R.function
    def main(x: R.Tensor((1, "n", 16), "float32"), gamma: R.Tensor((16,), "float32"),
             beta: R.Tensor((16,), "float32")) -> R.Tensor((1, "n", 16), "float32"):
        with R.dataflow():
            lv = R.mean(x, axis=[-1], keepdims=True)
            lv1 = R.subtract(x, lv)
            lv2 = R.power(lv1, R.const(2.0, "float32"))
            lv3 = R.mean(lv2, axis=[-1], keepdims=True)
            lv4 = R.add(lv3, R.const(1e-12, "float32"))
            lv5 = R.sqrt(lv4)
            lv6 = R.divide(lv1, lv5)
            lv7 = R.multiply(lv6, gamma)
            gv = R.add(lv7, beta)
            R.output(gv)
        return gv


def test_symbolic_rows_become_layer_norm():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, "n", 16), "float32"), gamma: R.Tensor((16,), "float32"),
                 beta: R.Tensor((16,), "float32")) -> R.Tensor((1, "n", 16), "float32"):
            with R.dataflow():
                gv = R.nn.layer_norm(x, gamma, beta, axes=[-1], epsilon=9.999999960041972e-13)
                R.output(gv)
            return gv

    after, report = apply_rule(SymbolicExport, "layernorm_decomposed")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["layernorm_decomposed"] == 1
    rng = np.random.default_rng(0)
    for rows in (3, 7):  # one module, any sequence length
        arrays = [rng.standard_normal(s).astype("float32") * 3 + 1 for s in [(1, rows, 16), (16,), (16,)]]
        np.testing.assert_allclose(compile_and_run(after, arrays), compile_and_run(SymbolicExport, arrays),
                                   rtol=RTOL, atol=ATOL)


def test_without_affine_params_on_symbolic_rows_uses_a_static_unit_gamma():
    after, report = apply_rule(decomposed(eps=1e-5, shape=(2, tvm.tirx.Var("n", "int64"), 16)),
                               "layernorm_decomposed")
    assert report.fired["layernorm_decomposed"] == 1
    (binding,) = after["main"].body.blocks[0].bindings
    assert binding.value.op.name == "relax.nn.layer_norm"
    assert [int(d) for d in binding.value.args[1].ty.shape] == [16]


def test_must_not_rewrite_a_symbolic_normalized_axis():
    before = decomposed(eps=1e-5, shape=(2, 4, tvm.tirx.Var("hidden", "int64")))
    after, report = apply_rule(before, "layernorm_decomposed")
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == [
        "the input (2, 4, hidden) has the symbolic dim hidden at axis 2 (normalized axis): "
        "the kernel needs it static (bind it)"]

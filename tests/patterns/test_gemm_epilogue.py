"""GEMM epilogue fusion: matmul + bias + activation + residual become one composite."""

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.passes import FusePatterns
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.patterns.base import dims_text, shape_dims


def fuse(mod):
    report = PatternReport()
    return FusePatterns([get_pattern("gemm_epilogue")], report)(mod), report


def test_matmul_bias_gelu_becomes_one_composite():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 32), "float32"),
                 b: R.Tensor((32,), "float32")):
            with R.dataflow():
                lv = R.matmul(x, w)
                lv1 = R.add(lv, b)
                gv = R.nn.gelu(lv1)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_matmul_relax_add_relax_nn_gelu(
            x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 32), "float32"), b: R.Tensor((32,), "float32")
        ) -> R.Tensor((4, 32), "float32"):
            R.func_attr({"Composite": "gemm_epilogue.matmul_bias_gelu", "Primitive": True})
            with R.dataflow():
                lv = R.matmul(x, w)
                lv1 = R.add(lv, b)
                gv = R.nn.gelu(lv1)
                R.output(gv)
            return gv

        @R.function
        def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 32), "float32"),
                 b: R.Tensor((32,), "float32")) -> R.Tensor((4, 32), "float32"):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_matmul_relax_add_relax_nn_gelu(x, w, b)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["gemm_epilogue"] == 1
    assert report.variants["gemm_epilogue.matmul_bias_gelu"] == 1


def test_exporter_order_bias_first_and_residual_fuse_into_one_chain():
    """PyTorch writes Add(bias, MatMul(...)); the residual add follows the activation."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8, 16), "float32"), w: R.Tensor((16, 16), "float32"),
                 b: R.Tensor((16,), "float32")):
            with R.dataflow():
                lv = R.matmul(x, w)
                lv1 = R.add(b, lv)
                lv2 = R.nn.relu(lv1)
                gv = R.add(lv2, x)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    assert report.variants["gemm_epilogue.matmul_bias_relu_residual"] == 1
    composites = [f for _, f in after.functions_items() if f.attrs and "Composite" in f.attrs]
    assert len(composites) == 1
    assert [b.var.name for b in after["main"].body.blocks[0].bindings] == ["gv"]


def test_every_activation_has_a_variant():
    for activation, op in [("relu", R.nn.relu), ("sigmoid", R.sigmoid), ("silu", R.nn.silu),
                           ("gelu_tanh", R.nn.gelu_tanh)]:
        bb = tvm.relax.BlockBuilder()
        x = tvm.relax.Var("x", tvm.relax.TensorType((4, 8), "float32"))
        w = tvm.relax.Var("w", tvm.relax.TensorType((8, 8), "float32"))
        with bb.function("main", [x, w]):
            with bb.dataflow():
                mm = bb.emit(tvm.relax.op.matmul(x, w))
                out = bb.emit_output(_relax_activation(activation)(mm))
            bb.emit_func_output(out)
        _, report = fuse(bb.get())
        assert report.variants[f"gemm_epilogue.matmul_{activation}"] == 1, activation


def _relax_activation(name):
    from tvm import relax

    return {"relu": relax.op.nn.relu, "sigmoid": relax.op.sigmoid, "silu": relax.op.nn.silu,
            "gelu_tanh": relax.op.nn.gelu_tanh}[name]


def test_clip_activation_fuses():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 32), "float32"),
                 b: R.Tensor((32,), "float32")):
            with R.dataflow():
                lv = R.matmul(x, w)
                lv1 = R.add(lv, b)
                gv = R.clip(lv1, R.prim_value(T_float(0.0)), R.prim_value(T_float(6.0)))
                R.output(gv)
            return gv

    _, report = fuse(Before)
    assert report.variants["gemm_epilogue.matmul_bias_clip"] == 1


def T_float(value):
    return tvm.tirx.FloatImm("float32", value)


def test_must_not_fuse_when_an_intermediate_is_used_elsewhere():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 32), "float32"),
                 b: R.Tensor((32,), "float32")):
            with R.dataflow():
                lv = R.matmul(x, w)
                lv1 = R.add(lv, b)
                lv2 = R.nn.gelu(lv1)
                gv = R.multiply(lv2, lv)  # the raw matmul output has a second consumer
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert not report.fired
    assert any("used outside" in miss.reason for miss in report.near_misses)


def test_must_not_fuse_bias_on_the_wrong_axis():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 32), "float32"),
                 b: R.Tensor((4, 1), "float32")):
            with R.dataflow():
                lv = R.matmul(x, w)
                lv1 = R.add(lv, b)  # broadcast along rows, not a per-column bias
                gv = R.nn.relu(lv1)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert [miss.reason for miss in report.near_misses] == [
        "bias shape (4, 1) is not a vector along the output's last axis (output (4, 32))"]


def test_must_not_fuse_unsupported_activation():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 32), "float32")):
            with R.dataflow():
                lv = R.matmul(x, w)
                gv = R.exp(lv)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert not report.fired


def test_must_not_fuse_integer_matmul():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "int32"), w: R.Tensor((16, 32), "int32"),
                 b: R.Tensor((32,), "int32")):
            with R.dataflow():
                lv = R.matmul(x, w)
                gv = R.add(lv, b)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert report.near_misses and "int32" in report.near_misses[0].reason


# Symbolic dims (a module compiled once for a range of sequence lengths) ------------------------

def _symbolic_matmul_chain(x_shape, w_shape, residual_shape, bias=True):
    """``residual + gelu(x @ w [+ b])`` with the given (possibly symbolic) shapes."""
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    w = relax.Var("w", relax.TensorType(w_shape, "float32"))
    b = relax.Var("b", relax.TensorType(w_shape[-1:], "float32"))
    r = relax.Var("r", relax.TensorType(residual_shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b, r]):
        with bb.dataflow():
            out = bb.emit(relax.op.matmul(x, w))
            if bias:
                out = bb.emit(relax.op.add(out, b))
            out = bb.emit(relax.op.nn.gelu(out))
            out = bb.emit_output(relax.op.add(out, r))
        bb.emit_func_output(out)
    return bb.get()


def test_symbolic_rows_fuse_the_whole_epilogue():
    n = tvm.tirx.Var("n", "int64")
    after, report = fuse(_symbolic_matmul_chain((1, n, 16), (16, 32), (1, n, 32)))
    assert report.variants["gemm_epilogue.matmul_bias_gelu_residual"] == 1
    assert not report.near_misses
    (binding,) = after["main"].body.blocks[0].bindings
    assert dims_text(shape_dims(binding.var)) == "(1, n, 32)"


N, K = tvm.tirx.Var("n", "int64"), tvm.tirx.Var("k", "int64")


@pytest.mark.parametrize("x_shape, w_shape, reason", [
    ((1, N, 16), (16, K),
     "the matmul output (1, n, k) has the symbolic dim k at axis 2 (N): the kernel needs it static (bind it)"),
    ((1, N, K), (K, 32),
     "the matmul input (1, n, k) has the symbolic dim k at axis 2 (K): the kernel needs it static (bind it)"),
])
def test_must_not_fuse_a_symbolic_k_or_n(x_shape, w_shape, reason):
    before = _symbolic_matmul_chain(x_shape, w_shape, (1, N, w_shape[-1]))
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert not report.fired
    assert [miss.reason for miss in report.near_misses] == [reason]


@pytest.mark.parametrize("x_shape, w_shape, residual_shape", [
    ((1, N, 16), (16, 32), (1, tvm.tirx.Var("m", "int64"), 32)),  # [1, n, 32] + [1, m, 32]
    ((4, 16), (16, 1), (4, 32)),  # [4, 1] + [4, 32]: the residual would broadcast the output up
])
def test_residual_of_another_shape_stays_outside(x_shape, w_shape, residual_shape):
    after, report = fuse(_symbolic_matmul_chain(x_shape, w_shape, residual_shape, bias=False))
    assert report.variants["gemm_epilogue.matmul_gelu"] == 1
    assert not report.variants["gemm_epilogue.matmul_gelu_residual"]
    assert after["main"].body.blocks[0].bindings[-1].value.op.name == "relax.add"

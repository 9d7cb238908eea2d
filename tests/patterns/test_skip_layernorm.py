"""Skip LayerNorm: residual add (+ bias add) + layer_norm become one composite (one kernel)."""

from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.frontend.onnx import random_inputs
from tvm_fusion.passes import FusePatterns
from tvm_fusion.patterns import PatternReport, get_pattern
from tvm_fusion.verify import reference_outputs

DATA = Path(__file__).resolve().parents[1] / "data"
# Stated tolerances: float32, rows of 32 reduced in a different order than ONNX Runtime.
RTOL, ATOL = 1e-4, 1e-5


def fuse(mod, name="skip_layernorm"):
    report = PatternReport()
    return FusePatterns([get_pattern(name)], report)(mod), report


def composites(mod):
    return {f.attrs["Composite"]: f for _, f in mod.functions_items() if f.attrs and "Composite" in f.attrs}


def compile_and_run(mod, arrays):
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target("llvm")), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
    return [o.numpy() for o in out] if isinstance(out, (list, tuple, tvm.ir.Array)) else out.numpy()


def check_exporter_block(path, shapes, patterns_fired):
    """Optimize a committed exporter block: what fired, and fused == unfused == ONNX Runtime."""
    prepared = api.prepare(path, load_config(), shapes)
    optimized = api.optimize(prepared)
    report = optimized.report
    for name, count in patterns_fired.items():  # a pattern ("skip_layernorm") or a variant ("skip_layernorm.skip")
        assert (report.variants if "." in name else report.fired)[name] == count, (name, dict(report.variants))
    assert not optimized.report.near_misses
    inputs = random_inputs(prepared.onnx_model, prepared.inputs, seed=0)
    arrays = [inputs[spec.name] for spec in prepared.inputs]
    fused = compile_and_run(optimized.module, arrays)
    unfused = compile_and_run(relax.get_pipeline("zero")(prepared.relax_module), arrays)
    (expected,) = reference_outputs(prepared.onnx_model, inputs).values()
    np.testing.assert_allclose(fused, expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(fused, unfused, rtol=RTOL, atol=ATOL)
    return optimized


def test_bias_and_residual_adds_fuse_with_layer_norm():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32"), b: R.Tensor((16,), "float32"),
                 r: R.Tensor((4, 16), "float32"), g: R.Tensor((16,), "float32"),
                 beta: R.Tensor((16,), "float32")):
            with R.dataflow():
                lv = R.add(b, x)
                lv1 = R.add(lv, r)
                gv = R.nn.layer_norm(lv1, g, beta, axes=[-1])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_add_relax_add_relax_nn_layer_norm(
            b: R.Tensor((16,), "float32"), x: R.Tensor((4, 16), "float32"), r: R.Tensor((4, 16), "float32"),
            g: R.Tensor((16,), "float32"), beta: R.Tensor((16,), "float32"),
        ) -> R.Tensor((4, 16), "float32"):
            R.func_attr({"Composite": "skip_layernorm.bias_skip", "Primitive": True})
            with R.dataflow():
                lv = R.add(b, x)
                lv1 = R.add(lv, r)
                gv = R.nn.layer_norm(lv1, g, beta, axes=[-1])
                R.output(gv)
            return gv

        @R.function
        def main(x: R.Tensor((4, 16), "float32"), b: R.Tensor((16,), "float32"),
                 r: R.Tensor((4, 16), "float32"), g: R.Tensor((16,), "float32"),
                 beta: R.Tensor((16,), "float32")) -> R.Tensor((4, 16), "float32"):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_add_relax_add_relax_nn_layer_norm(b, x, r, g, beta)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.variants["skip_layernorm.bias_skip"] == 1
    [instance] = report.instances
    assert (instance.variant, instance.output, instance.absorbed) == (
        "skip_layernorm.bias_skip", "gv", ["lv", "lv1", "gv"])


@I.ir_module
class PreNorm:
    """GPT-2's pre-norm block: the residual sum feeds the LayerNorm and the next residual add."""

    @R.function
    def main(x: R.Tensor((4, 16), "float32"), r: R.Tensor((4, 16), "float32"),
             g: R.Tensor((16,), "float32"), beta: R.Tensor((16,), "float32")):
        with R.dataflow():
            h = R.add(x, r)
            n = R.nn.layer_norm(h, g, beta, axes=[-1])
            gv = R.add(R.nn.relu(n), h)
            R.output(gv)
        return gv


def test_sum_needed_later_becomes_a_second_output():
    after, report = fuse(PreNorm)
    assert report.variants["skip_layernorm.skip"] == 1
    composite = composites(after)["skip_layernorm.skip"]
    assert isinstance(composite.ret_ty, relax.TupleType) and len(composite.ret_ty.fields) == 2
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype("float32") for s in [(4, 16), (4, 16), (16,), (16,)]]
    np.testing.assert_allclose(compile_and_run(after, arrays), compile_and_run(PreNorm, arrays),
                               rtol=RTOL, atol=ATOL)


def test_gpt2_export_fuses_every_layer_norm_with_its_residual():
    """torch.onnx.export at opset 17 (LayerNormalization op): embeddings + 2 in the layer."""
    optimized = check_exporter_block(DATA / "gpt2_block_opset17.onnx", ["input_ids:1x8"],
                                     {"skip_layernorm": 3})
    assert optimized.report.variants["gemm_epilogue.matmul_bias_residual"] == 0
    assert all(len(i.absorbed) >= 2 for i in optimized.report.instances if i.pattern == "skip_layernorm")


def test_must_not_fuse_when_the_bias_sum_is_used_elsewhere():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32"), b: R.Tensor((16,), "float32"),
                 r: R.Tensor((4, 16), "float32"), g: R.Tensor((16,), "float32"),
                 beta: R.Tensor((16,), "float32")):
            with R.dataflow():
                lv = R.add(x, b)
                lv1 = R.add(lv, r)
                lv2 = R.nn.layer_norm(lv1, g, beta, axes=[-1])
                gv = R.multiply(lv2, lv)  # the bias add has a second consumer
                R.output(gv)
            return gv

    assert "the bias add's result is also used outside the chain" in check_reasons(Before)
    after, report = fuse(Before)
    # Only the residual add goes with the norm; the bias add stays, computed once for both users.
    assert report.variants["skip_layernorm.skip"] == 1 and not report.variants["skip_layernorm.bias_skip"]
    main_ops = [b.value.op.name for b in after["main"].body.blocks[0].bindings
                if isinstance(b.value.op, tvm.ir.Op)]
    assert main_ops == ["relax.add", "relax.multiply"]


def check_reasons(mod, name="skip_layernorm"):
    """Every reason the rule's check gives on ``mod``, also for variants a shorter one replaces."""
    rule, reasons = get_pattern(name), []

    def probe(context):
        reasons.append(rule.check(context))
        return False

    patterns = [relax.transform.FusionPattern(f"probe.{variant}", root, annotations, probe)
                for variant, root, annotations in rule.variants()]
    relax.transform.FuseOpsByPattern(patterns, bind_constants=False, annotate_codegen=False)(mod)
    return [reason for reason in reasons if reason]


@pytest.mark.parametrize("axes, reason", [
    ([0], "normalizes over axes [0] of a rank-3 tensor, not the trailing axes: a row would not be contiguous"),
    ([1], "normalizes over axes [1] of a rank-3 tensor, not the trailing axes: a row would not be contiguous"),
])
def test_must_not_fuse_normalization_over_the_wrong_axis(axes, reason):
    x = relax.Var("x", relax.TensorType((4, 4, 16), "float32"))
    r = relax.Var("r", relax.TensorType((4, 4, 16), "float32"))
    g = relax.Var("g", relax.TensorType((4,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, r, g]):
        with bb.dataflow():
            summed = bb.emit(relax.op.add(x, r))
            out = bb.emit_output(relax.op.nn.layer_norm(summed, g, g, axes=axes))
        bb.emit_func_output(out)
    before = bb.get()
    after, report = fuse(before)
    tvm.ir.assert_structural_equal(after, before)
    assert [m.reason for m in report.near_misses] == [reason]


def test_symbolic_rows_fuse():
    """A symbolic sequence length: the rows vary, the normalized row (16) is static."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, "n", 16), "float32"), r: R.Tensor((1, "n", 16), "float32"),
                 b: R.Tensor((16,), "float32"), g: R.Tensor((16,), "float32")):
            with R.dataflow():
                lv = R.add(x, b)
                lv1 = R.add(lv, r)
                gv = R.nn.layer_norm(lv1, g, g, axes=[-1])
                R.output(gv)
            return gv

    after, report = fuse(Before)
    assert report.variants["skip_layernorm.bias_skip"] == 1
    assert not report.near_misses
    (composite,) = composites(after).values()
    assert [b.value.op.name for b in composite.body.blocks[0].bindings] == [
        "relax.add", "relax.add", "relax.nn.layer_norm"]
    fused = relax.get_pipeline("zero")(after)
    vm = relax.VirtualMachine(tvm.compile(fused, target=tvm.target.Target("llvm")), tvm.cpu())
    rng = np.random.default_rng(0)
    for rows in (3, 9):  # one build, any sequence length
        x, r = (rng.standard_normal((1, rows, 16)).astype("float32") for _ in range(2))
        b, g = (rng.standard_normal(16).astype("float32") for _ in range(2))
        s = x + b + r
        want = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + 1e-5) * g + g
        got = vm["main"](*[tvm.runtime.tensor(a) for a in (x, r, b, g)]).numpy()
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_must_not_fuse_a_symbolic_normalized_axis():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", "h"), "float32"), r: R.Tensor(("n", "h"), "float32"),
                 g: R.Tensor(("h",), "float32")):
            with R.dataflow():
                lv = R.add(x, r)
                gv = R.nn.layer_norm(lv, g, g, axes=[-1])
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert [m.reason for m in report.near_misses] == [
        "the normalized tensor (n, h) has the symbolic dim h at axis 1 (normalized axis): "
        "the kernel needs it static (bind it)"]


def test_must_not_fuse_a_skip_of_another_symbolic_length():
    """x is [1, n, 16] and the skip [1, m, 16]: not provably one shape."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, "n", 16), "float32"), r: R.Tensor((1, "m", 16), "float32"),
                 g: R.Tensor((16,), "float32")):
            with R.dataflow():
                lv = R.add(x, r)
                gv = R.nn.layer_norm(lv, g, g, axes=[-1])
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert [m.reason for m in report.near_misses] == [
        "the normalized tensor's shape is not known (the sum of x (1, n, 16), skip (1, m, 16))"]


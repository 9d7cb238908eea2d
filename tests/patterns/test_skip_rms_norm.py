"""Skip RMSNorm: residual add (+ bias add) + rms_norm become one composite (one kernel)."""

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from test_skip_layernorm import ATOL, DATA, RTOL, check_exporter_block, check_reasons, compile_and_run, composites, fuse


def test_residual_add_fuses_with_rms_norm_and_keeps_the_sum():
    """Llama's block: the sum is normalized and also carried on as the next residual."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4, 32), "float32"), r: R.Tensor((2, 4, 32), "float32"),
                 w: R.Tensor((32,), "float32")):
            with R.dataflow():
                h = R.add(r, x)
                n = R.nn.rms_norm(h, w, axes=[-1], epsilon=1e-6)
                gv = R.add(n, h)
                R.output(gv)
            return gv

    after, report = fuse(Before, "skip_rms_norm")
    assert report.variants["skip_rms_norm.skip"] == 1
    composite = composites(after)["skip_rms_norm.skip"]
    assert [type(b.value.op).__name__ for b in composite.body.blocks[0].bindings] == ["Op", "Op"]
    assert len(composite.ret_ty.fields) == 2
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype("float32") for s in [(2, 4, 32), (2, 4, 32), (32,)]]
    np.testing.assert_allclose(compile_and_run(after, arrays), compile_and_run(Before, arrays),
                               rtol=RTOL, atol=ATOL)


def test_llama_export_fuses_both_residual_norms():
    """torch.onnx.export of a Llama layer: input norm (no residual yet), post-attention and final norms."""
    optimized = check_exporter_block(DATA / "llama_block.onnx", ["input_ids:1x8"],
                                     {"rmsnorm_decomposed": 3, "skip_rms_norm": 2})
    fused = [i.absorbed for i in optimized.report.instances if i.pattern == "skip_rms_norm"]
    assert all(len(absorbed) == 2 for absorbed in fused)  # the residual add and the norm


def test_must_not_fuse_over_a_middle_axis():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4, 32), "float32"), r: R.Tensor((2, 4, 32), "float32"),
                 w: R.Tensor((4,), "float32")):
            with R.dataflow():
                h = R.add(x, r)
                gv = R.nn.rms_norm(h, w, axes=[1])
                R.output(gv)
            return gv

    after, report = fuse(Before, "skip_rms_norm")
    tvm.ir.assert_structural_equal(after, Before)
    assert report.near_misses[0].reason.startswith("normalizes over axes [1] of a rank-3 tensor")


def test_must_not_absorb_a_bias_add_used_elsewhere():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 32), "float32"), b: R.Tensor((32,), "float32"),
                 r: R.Tensor((4, 32), "float32"), w: R.Tensor((32,), "float32")):
            with R.dataflow():
                lv = R.add(x, b)
                lv1 = R.add(lv, r)
                lv2 = R.nn.rms_norm(lv1, w, axes=[-1])
                gv = R.add(lv2, lv)
                R.output(gv)
            return gv

    assert "the bias add's result is also used outside the chain" in check_reasons(Before, "skip_rms_norm")
    _, report = fuse(Before, "skip_rms_norm")
    assert not report.variants["skip_rms_norm.bias_skip"] and report.variants["skip_rms_norm.skip"] == 1


def test_broadcast_residual_is_accepted_and_correct():
    """A [1, S, H] position table added to [B, S, H] (BERT/GPT-2 embeddings) broadcasts per row."""
    x = relax.Var("x", relax.TensorType((2, 4, 32), "float32"))
    pos = relax.Var("pos", relax.TensorType((1, 4, 32), "float32"))
    w = relax.Var("w", relax.TensorType((32,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, pos, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.rms_norm(bb.emit(relax.op.add(x, pos)), w, axes=[-1]))
        bb.emit_func_output(out)
    before = bb.get()
    after, report = fuse(before, "skip_rms_norm")
    assert report.variants["skip_rms_norm.skip"] == 1
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s).astype("float32") for s in [(2, 4, 32), (1, 4, 32), (32,)]]
    np.testing.assert_allclose(compile_and_run(after, arrays), compile_and_run(before, arrays),
                               rtol=RTOL, atol=ATOL)


def test_symbolic_sequence_fuses_and_keeps_the_sum():
    """Llama's residual norm with a symbolic sequence length: the rows vary, the row (32) is static."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, "n", 32), "float32"), r: R.Tensor((1, "n", 32), "float32"),
                 w: R.Tensor((32,), "float32")):
            with R.dataflow():
                h = R.add(x, r)
                lv = R.nn.rms_norm(h, w, axes=[-1])
                gv = R.multiply(lv, h)
                R.output(gv)
            return gv

    after, report = fuse(Before, "skip_rms_norm")
    assert report.variants["skip_rms_norm.skip"] == 1
    assert not report.near_misses
    (composite,) = composites(after).values()
    assert [b.value.op.name for b in composite.body.blocks[0].bindings] == ["relax.add", "relax.nn.rms_norm"]


def test_must_not_fuse_a_symbolic_normalized_axis():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, "n", "h"), "float32"), r: R.Tensor((1, "n", "h"), "float32"),
                 w: R.Tensor(("h",), "float32")):
            with R.dataflow():
                lv = R.add(x, r)
                gv = R.nn.rms_norm(lv, w, axes=[-1])
                R.output(gv)
            return gv

    after, report = fuse(Before, "skip_rms_norm")
    tvm.ir.assert_structural_equal(after, Before)
    assert [m.reason for m in report.near_misses] == [
        "the normalized tensor (1, n, h) has the symbolic dim h at axis 2 (normalized axis): "
        "the kernel needs it static (bind it)"]

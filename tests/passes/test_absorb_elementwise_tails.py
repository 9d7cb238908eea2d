"""Epilogue composites take the element-wise ops after them (passes/absorb_elementwise_tails.py)."""

import numpy as np
import pytest
import tvm
from machine import host_target
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_fusion.config import parse_config
from tvm_fusion.passes import FusePatterns, fusion_pipeline
from tvm_fusion.patterns import PatternReport, get_pattern


def fuse(mod, patterns=("gemm_epilogue",)):
    report = PatternReport()
    return FusePatterns([get_pattern(p) for p in patterns], report)(mod), report


def test_affine_after_the_epilogue_joins_the_composite():
    """matmul + bias, then a scalar scale and shift (PP-LCNetV3's learnable affine): one composite."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 32), "float32"),
                 b: R.Tensor((32,), "float32")):
            with R.dataflow():
                lv = R.matmul(x, w)
                lv1 = R.add(lv, b)
                lv2 = R.multiply(R.const(1.5, "float32"), lv1)
                gv = R.add(lv2, R.const(0.25, "float32"))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_matmul_relax_add_elementwise(
            x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 32), "float32"), b: R.Tensor((32,), "float32"),
            tail_param_0: R.Tensor((), "float32"), tail_param_1: R.Tensor((), "float32"),
        ) -> R.Tensor((4, 32), "float32"):
            R.func_attr({"Composite": "gemm_epilogue.matmul_bias_elementwise", "Primitive": True})
            with R.dataflow():
                lv = R.matmul(x, w)
                lv1 = R.add(lv, b)
                lv2 = R.multiply(tail_param_0, lv1)
                gv = R.add(lv2, tail_param_1)
                R.output(gv)
            return gv

        @R.function
        def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 32), "float32"),
                 b: R.Tensor((32,), "float32")) -> R.Tensor((4, 32), "float32"):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_matmul_relax_add_elementwise(
                    x, w, b, R.const(1.5, "float32"), R.const(0.25, "float32"))
                R.output(gv)
            return gv

    after, report = fuse(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.variants["gemm_epilogue.matmul_bias_elementwise"] == 1
    (instance,) = report.instances
    assert instance.variant == "gemm_epilogue.matmul_bias_elementwise"
    assert instance.absorbed == ["lv", "lv1", "lv2", "gv"]


def test_a_hardswish_dag_and_a_residual_are_absorbed_but_not_what_reads_the_middle():
    """x*clip(x/6+0.5) reads x twice: taken whole. The residual add is taken; the relu after it
    reads a value the graph also returns, so the chain stops before it."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 16), "float32"),
                 b: R.Tensor((16,), "float32"), skip: R.Tensor((4, 16), "float32")):
            with R.dataflow():
                lv = R.matmul(x, w)
                lv1 = R.add(lv, b)
                lv2 = R.multiply(lv1, R.const(1 / 6, "float32"))
                lv3 = R.add(lv2, R.const(0.5, "float32"))
                lv4 = R.clip(lv3, 0, 1)
                lv5 = R.multiply(lv1, lv4)
                lv6 = R.add(lv5, skip)
                lv7 = R.nn.relu(lv6)
                gv = (lv6, lv7)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    (instance,) = report.instances
    assert instance.absorbed == ["lv", "lv1", "lv2", "lv3", "lv4", "lv5", "lv6"]
    ops = [b.value.op.name for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)
           and isinstance(b.value.op, tvm.ir.Op)]
    assert ops == ["relax.nn.relu"]


def test_must_not_absorb_a_tail_whose_middle_is_read_elsewhere():
    """The scaled value is also a graph output: absorbing the scale would leave it computed twice."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 32), "float32"),
                 b: R.Tensor((32,), "float32")):
            with R.dataflow():
                lv = R.matmul(x, w)
                lv1 = R.add(lv, b)
                lv2 = R.multiply(lv1, R.const(2.0, "float32"))
                lv3 = R.nn.relu(lv2)
                gv = (lv1, lv3)
                R.output(gv)
            return gv

    after, report = fuse(Before)
    assert report.variants["gemm_epilogue.matmul_bias"] == 1
    assert not any(k.endswith("_elementwise") for k in report.fired)


def test_must_not_absorb_a_broadcast_that_grows_the_result():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16, 1), "float32"),
                 big: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                lv = R.matmul(x, w)
                lv1 = R.nn.relu(lv)
                lv2 = R.multiply(lv1, R.const(2.0, "float32"))
                gv = R.add(lv2, big)  # [4, 1] + [4, 8]: the kernel would write 8x what it computes
                R.output(gv)
            return gv

    after, report = fuse(Before)
    (instance,) = report.instances
    assert instance.variant == "gemm_epilogue.matmul_relu_elementwise"
    assert instance.absorbed == ["lv", "lv1", "lv2"]
    (binding,) = [b for b in after["main"].body.blocks[0].bindings if b.var.name == "gv"]
    assert binding.value.op.name == "relax.add"


def _scaled_residual_chain(skip_rows):
    """matmul + bias on [1, n, 16] rows, then a scale and a residual add of [1, skip_rows, 32]."""
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((1, n, 16), "float32"))
    w, b = relax.Var("w", relax.TensorType((16, 32), "float32")), relax.Var("b", relax.TensorType((32,), "float32"))
    skip = relax.Var("skip", relax.TensorType((1, n if skip_rows == "n" else skip_rows, 32), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b, skip]):
        with bb.dataflow():
            lv = bb.emit(relax.op.add(relax.op.matmul(x, w), b))
            lv = bb.emit(relax.op.multiply(lv, relax.const(2.0, "float32")))
            gv = bb.emit_output(relax.op.add(lv, skip))
        bb.emit_func_output(gv)
    return bb.get()


def test_symbolic_rows_absorb_the_scale_and_the_residual():
    """A symbolic sequence length: the residual [1, n, 32] is provably the result's shape."""
    after, report = fuse(_scaled_residual_chain("n"))
    (instance,) = report.instances
    assert instance.variant == "gemm_epilogue.matmul_bias_elementwise"
    assert len(instance.absorbed) == 4
    assert len(after["main"].body.blocks[0].bindings) == 1


def test_must_not_absorb_a_residual_of_another_symbolic_length():
    """[1, n, 32] + [1, m, 32]: not provably one shape, so the add stays outside."""
    after, report = fuse(_scaled_residual_chain(tvm.tirx.Var("m", "int64")))
    (instance,) = report.instances
    assert instance.variant == "gemm_epilogue.matmul_bias_elementwise"
    assert len(instance.absorbed) == 3  # matmul, bias add, scale
    assert after["main"].body.blocks[0].bindings[-1].value.op.name == "relax.add"


@pytest.mark.parametrize("groups", [1, 8])
def test_conv_with_affine_hardswish_affine_matches_the_unfused_module(groups):
    """PP-LCNetV3's conv block, through the whole pipeline (fused, scheduled) against zero-pipeline TVM."""
    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((1, 8, 9, 7), "float32"))
    w = relax.const(rng.standard_normal((8, 8 // groups, 3, 3)).astype("float32"))
    b = relax.const(rng.standard_normal((1, 8, 1, 1)).astype("float32"))
    scalar = lambda v: relax.const(np.array([v], "float32"))  # noqa: E731
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, padding=1, groups=groups))
            y = bb.emit(relax.op.add(y, b))
            y = bb.emit(relax.op.multiply(scalar(1.3), y))
            y = bb.emit(relax.op.add(y, scalar(-0.2)))
            gate = bb.emit(relax.op.clip(relax.op.add(relax.op.multiply(y, relax.const(1 / 6, "float32")),
                                                      relax.const(0.5, "float32")), 0, 1))
            y = bb.emit(relax.op.multiply(y, gate))
            y = bb.emit(relax.op.multiply(scalar(0.7), y))
            out = bb.emit_output(relax.op.add(y, scalar(0.05)))
        bb.emit_func_output(out)
    assert_one_kernel_matching_the_unfused_module(bb.get(), ["conv_epilogue"], "conv_epilogue.conv_bias_elementwise",
                                                  rng.standard_normal((1, 8, 9, 7)).astype("float32"))


def test_a_log_mel_tail_joins_the_matmul_and_matches_the_unfused_module():
    """openWakeWord's mel spectrogram: ``10 * log(clip(power @ mel, 1e-10)) / log(10)`` after the
    filterbank matmul, one kernel through the whole pipeline (fused, scheduled)."""
    rng = np.random.default_rng(1)
    x = relax.Var("x", relax.TensorType((1, 5, 257), "float32"))
    mel = relax.const(np.abs(rng.standard_normal((257, 32))).astype("float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, mel))
            y = bb.emit(relax.op.clip(y, 1e-10, float("inf")))
            y = bb.emit(relax.op.log(y))
            y = bb.emit(relax.op.multiply(y, relax.const(10.0, "float32")))
            out = bb.emit_output(relax.op.divide(y, relax.const(float(np.log(10.0)), "float32")))
        bb.emit_func_output(out)
    assert_one_kernel_matching_the_unfused_module(bb.get(), ["clip", "gemm_epilogue"],
                                                  "gemm_epilogue.matmul_clip_elementwise",
                                                  np.abs(rng.standard_normal((1, 5, 257))).astype("float32"))


def assert_one_kernel_matching_the_unfused_module(module, patterns: list[str], variant: str, data: np.ndarray):
    """Through the whole pipeline (fused, scheduled for the host) with ``patterns``: ``variant``
    fired once, one kernel, no Fallback schedule, and the outputs on ``data`` those of
    zero-pipeline TVM."""
    config = parse_config({"target": host_target(), "pipeline": {"patterns": patterns}}, name="test")
    report = PatternReport()
    schedule_log: dict[str, str] = {}
    fused = fusion_pipeline(config, report, schedule_log=schedule_log)(module)
    assert report.variants[variant] == 1
    assert len([f for f in fused.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]) == 1
    assert "Fallback" not in schedule_log.values(), schedule_log
    run = lambda mod: relax.VirtualMachine(tvm.compile(mod, target=config.tvm_target()), tvm.cpu())["main"](  # noqa: E731
        tvm.runtime.tensor(data)).numpy()
    np.testing.assert_allclose(run(fused), run(relax.get_pipeline("zero")(module)), rtol=1e-5, atol=1e-5)

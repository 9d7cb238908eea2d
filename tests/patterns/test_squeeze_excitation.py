"""Squeeze-and-excitation: the gate as one kernel, the rescale folded into the next conv."""

import numpy as np
import onnx
import pytest
import tvm
import tvm_ffi
from onnx import helper
from tvm.script import ir as I
from tvm.script import relax as R

from cnn_helpers import compile_and_compare, make_model, prim_func_names, random_weights
from tvm_fusion.passes import FusePatterns
from tvm_fusion.patterns import PatternReport, get_pattern


def se_block_model(gate_op: str):
    rng = np.random.default_rng(0)
    weights = random_weights(rng, w1=(8, 16, 1, 1), b1=(8,), w2=(16, 8, 1, 1), b2=(16,), w3=(8, 16, 1, 1),
                             b3=(8,))
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"]),
             helper.make_node("Conv", ["p", "w1", "b1"], ["s1"]),
             helper.make_node("Relu", ["s1"], ["r"]),
             helper.make_node("Conv", ["r", "w2", "b2"], ["s2"]),
             helper.make_node(gate_op, ["s2"], ["g"]),
             helper.make_node("Mul", ["x", "g"], ["scaled"]),
             helper.make_node("Conv", ["scaled", "w3", "b3"], ["y"])]
    return make_model(nodes, {"x": (1, 16, 14, 14)}, "y", weights)


@pytest.mark.parametrize("gate_op, gate", [("HardSigmoid", "hardsigmoid"), ("Sigmoid", "sigmoid")])
def test_se_block_is_two_kernels(gate_op, gate):
    # Tolerance: fast-math sigmoid and a mean summed in another order; 1e-4 covers both.
    report, module = compile_and_compare(se_block_model(gate_op))
    assert report.variants[f"squeeze_excitation.se_relu_{gate}"] == 1
    assert report.variants["conv_epilogue.conv_scaled_bias"] == 1
    assert len(prim_func_names(module)) == 2


def test_must_not_fuse_when_the_squeezed_activation_is_used_elsewhere():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 8, 4, 4), "float32"), w1: R.Tensor((4, 8, 1, 1), "float32"),
                 b1: R.Tensor((1, 4, 1, 1), "float32"), w2: R.Tensor((8, 4, 1, 1), "float32"),
                 b2: R.Tensor((1, 8, 1, 1), "float32")):
            with R.dataflow():
                lv = R.mean(x, axis=[2, 3], keepdims=True)
                lv1 = R.nn.conv2d(lv, w1)
                lv2 = R.add(lv1, b1)
                lv3 = R.nn.relu(lv2)
                lv4 = R.nn.conv2d(lv3, w2)
                lv5 = R.add(lv4, b2)
                lv6 = R.sigmoid(lv5)
                gv = (lv6, lv3)  # the squeezed vector is also an output
                R.output(gv)
            return gv

    report = PatternReport()
    after = FusePatterns([get_pattern("squeeze_excitation")], report)(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert any(m.pattern == "squeeze_excitation" and "outside the block" in m.reason
               for m in report.near_misses)


# Symbolic image sizes ---------------------------------------------------------------------

def _se_gate(x, w1, b1, w2, b2):
    from tvm import relax
    pooled = relax.op.mean(x, axis=[2, 3], keepdims=True)
    squeezed = relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(pooled, w1), b1))
    gate = relax.op.sigmoid(relax.op.add(relax.op.nn.conv2d(squeezed, w2), b2))
    return relax.op.multiply(x, gate)


def test_symbolic_height_and_width_fuse_and_match_at_every_size():
    from symbolic_helpers import HEIGHT, WIDTH, pipeline_and_compare, symbolic_module
    rng = np.random.default_rng(0)
    weights = random_weights(rng, w1=(4, 16, 1, 1), b1=(1, 4, 1, 1), w2=(16, 4, 1, 1), b2=(1, 16, 1, 1))
    mod = symbolic_module(_se_gate, {"x": (1, 16, HEIGHT, WIDTH)}, weights)
    report, log = pipeline_and_compare(mod, [(1, 1), (3, 17), (40, 9)])
    assert report.variants["squeeze_excitation.se_relu_sigmoid"] == 1
    assert "SqueezeExcitation" in log.values()


def test_must_not_fuse_symbolic_channels():
    from symbolic_helpers import HEIGHT, WIDTH
    from tvm import relax, tirx
    channels = tirx.Var("channels", "int64")
    shapes = {"x": (1, channels, HEIGHT, WIDTH), "w1": (4, channels, 1, 1), "b1": (1, 4, 1, 1),
              "w2": (channels, 4, 1, 1), "b2": (1, channels, 1, 1)}
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in shapes.items()]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(_se_gate(*params))
        bb.emit_func_output(out)
    report = PatternReport()
    FusePatterns([get_pattern("squeeze_excitation")], report)(bb.get())
    assert not report.fired
    (miss,) = report.near_misses
    assert "symbolic dim channels at axis 1" in miss.reason


def blocked_se_model(last_kernel: int = 1, size: int = 14):
    """conv -> HardSwish -> SE (12 squeezed channels: off any channel block) -> scaled conv
    (1x1 as MobileNetV3's projection, or ``last_kernel`` square and padded), as a MobileNetV3
    block runs it with every conv blocked."""
    rng = np.random.default_rng(2)
    weights = random_weights(rng, w0=(16, 16, 3, 3), b0=(16,), w1=(12, 16, 1, 1), b1=(12,), w2=(16, 12, 1, 1),
                             b2=(16,), w3=(16, 16, last_kernel, last_kernel), b3=(16,))
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
             helper.make_node("HardSwish", ["c0"], ["m"]),
             helper.make_node("GlobalAveragePool", ["m"], ["p"]),
             helper.make_node("Conv", ["p", "w1", "b1"], ["s1"]),
             helper.make_node("Relu", ["s1"], ["r"]),
             helper.make_node("Conv", ["r", "w2", "b2"], ["s2"]),
             helper.make_node("HardSigmoid", ["s2"], ["g"]),
             helper.make_node("Mul", ["m", "g"], ["scaled"]),
             helper.make_node("Conv", ["scaled", "w3", "b3"], ["y"], pads=[last_kernel // 2] * 4)]
    return make_model(nodes, {"x": (1, 16, size, size)}, "y", weights)


def test_se_block_fuses_in_the_blocked_layout():
    """Every conv in NCHW[x]c, the squeeze conv padded to the block: the gate is one blocked
    kernel (pool summed in whole vectors, parallel), its rescale inlined into the next conv."""
    report, module = compile_and_compare(blocked_se_model(), phases=("canonicalize", "layout", "fuse", "lower",
                                                                     "schedule"))
    # Padded: the squeeze conv's filters, and the excitation conv's zero filters for them.
    assert report.variants["blocked_layout.conv2d"] == 4 and report.variants["blocked_layout.padded_channels"] == 2
    assert report.variants["squeeze_excitation.se_relu_hardsigmoid"] == 1
    assert report.variants["conv_epilogue.conv_scaled_bias"] == 1
    gate = next(f for gv, f in module.functions_items() if "mean" in gv.name_hint)
    kinds = set()
    tvm_ffi.structural_walk(gate.body, (tvm.tirx.For, lambda loop: kinds.add(loop.kind)))
    assert {tvm.tirx.ForKind.PARALLEL, tvm.tirx.ForKind.VECTORIZED} <= kinds
    # The scale is a pass of its own: the conv's FMA loop reads the scaled map and the weights only.
    scaled_conv = next(f for gv, f in module.functions_items() if gv.name_hint.startswith("fused_relax_multiply"))
    reductions = []
    tvm_ffi.structural_walk(scaled_conv.body, (tvm.s_tir.SBlock, lambda block: reductions.append(block) if any(
        iv.iter_type == tvm.tirx.IterVar.CommReduce for iv in block.iter_vars) else None))
    (conv,) = reductions
    read = {region.source.name for region in conv.reads} - {region.source.name for region in conv.writes}
    assert len(read) == 2 and any(name.startswith("T_multiply") for name in read)


def _scale_loops(module) -> tuple[list[int], bool]:
    """The SE-scaled conv kernel's parallel loop extents, and whether the scale (a block before
    the conv reading the map and the gate: the multiply, or the pad it was inlined into) is
    computed inside the loop that runs the conv (per task) rather than in a pass of its own."""
    scaled_conv = next(f for gv, f in module.functions_items() if gv.name_hint.startswith("fused_relax_multiply"))
    parallel = []
    tvm_ffi.structural_walk(scaled_conv.body, (tvm.tirx.For, lambda loop: parallel.append(loop) if (
        loop.kind == tvm.tirx.ForKind.PARALLEL) else None))

    def scales_and_convolves(loop) -> bool:
        blocks = []
        tvm_ffi.structural_walk(loop.body, (tvm.s_tir.SBlock, blocks.append))
        scale = any(b.name_hint.startswith(("T_multiply", "pad_temp")) and len(b.reads) == 2 for b in blocks)
        return scale and any(b.name_hint.startswith("conv2d") for b in blocks)

    return [int(loop.extent) for loop in parallel], any(scales_and_convolves(loop) for loop in parallel)


@pytest.mark.parametrize("last_kernel, size, tasks", [
    (1, 14, 14),   # a 1x1 projection after the gate, 14 rows: the rows are the tasks
    (3, 14, 14),   # a padded 3x3 conv: each task pads and scales its three input rows
    (1, 3, 3),     # 3 rows, too few alone: tasks are channel tiles (one here) x rows
])
def test_a_scaled_conv_scales_the_input_rows_of_each_task(last_kernel, size, tasks):
    """One parallel loop, each task scaling (and padding) the input rows its output row reads,
    every channel tile of the task then reading them from cache; not a pass over the map. (The
    direct conv: with Winograd the 3x3 conv's scale is inlined into its input transform, which
    test_a_scaled_3x3_conv_by_winograd_matches checks.)"""
    _, module = compile_and_compare(blocked_se_model(last_kernel, size),
                                    phases=("canonicalize", "layout", "fuse", "lower", "schedule"), winograd=False)
    assert _scale_loops(module) == ([tasks], True)


def test_a_scaled_3x3_conv_by_winograd_matches():
    """The SE gate's scale of a Winograd conv's input, inlined into its input transform: the
    model's two 3x3 convs each one parallel loop over the 4 rows of F(4x4) tiles covering the 14x14
    map (no pass over the map first); outputs as ONNX Runtime's."""
    _, module = compile_and_compare(blocked_se_model(3, 14), phases=("canonicalize", "layout", "fuse", "lower", "schedule"))

    def block_names(func):
        names = []
        tvm_ffi.structural_walk(func.body, (tvm.s_tir.SBlock, lambda block: names.append(block.name_hint)))
        return names

    kernels = [func for func in module.functions.values()
               if isinstance(func, tvm.tirx.PrimFunc) and "winograd_input_rows" in block_names(func)]
    assert len(kernels) == 2
    for kernel in kernels:
        loops = []
        tvm_ffi.structural_walk(kernel.body, (tvm.tirx.For, loops.append))
        assert [int(loop.extent) for loop in loops if loop.kind == tvm.tirx.ForKind.PARALLEL] == [4]

def test_se_block_without_biases_fuses():
    """torch's dynamo exporter drops the squeeze convs' all-zero biases and pools with
    ``ReduceMean(axes=[-1, -2])``: the same gate kernel as the legacy export's."""
    rng = np.random.default_rng(0)
    weights = random_weights(rng, w1=(8, 16, 1, 1), w2=(16, 8, 1, 1), w3=(8, 16, 1, 1), b3=(8,))
    nodes = [helper.make_node("ReduceMean", ["x"], ["p"], axes=[-1, -2], keepdims=1),
             helper.make_node("Conv", ["p", "w1"], ["s1"]),
             helper.make_node("Relu", ["s1"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["s2"]),
             helper.make_node("HardSigmoid", ["s2"], ["g"], alpha=1 / 6),
             helper.make_node("Mul", ["x", "g"], ["scaled"]),
             helper.make_node("Conv", ["scaled", "w3", "b3"], ["y"])]
    report, module = compile_and_compare(make_model(nodes, {"x": (1, 16, 14, 14)}, "y", weights))
    assert report.variants["squeeze_excitation.se_relu_hardsigmoid"] == 1
    assert len(prim_func_names(module)) == 2


def test_a_quantized_se_gate_is_one_kernel_through_its_qdq_pairs(tmp_path):
    """ONNX Runtime's quantize_static writes the gate through Q/DQ pairs and requantized convs
    (passes/pooled_gates.py): one ``pooled_gate`` kernel, and the model's output ONNX Runtime's
    on the same quantized graph."""
    from tvm_fusion.frontend.static_quantization import quantize_to_qdq

    rng = np.random.default_rng(3)
    samples = [{"x": rng.standard_normal((1, 16, 14, 14)).astype(np.float32) * 2} for _ in range(4)]
    path = quantize_to_qdq(se_block_model("HardSigmoid"), tmp_path / "qdq.onnx", samples)
    report, module = compile_and_compare(onnx.load(str(path)), rtol=0, atol=1e-6)
    assert report.variants["squeeze_excitation.pooled_gate"] == 1
    gates = [name for name in prim_func_names(module) if "pooled_gate" in name]
    assert len(gates) == 1

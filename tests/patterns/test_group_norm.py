"""GroupNorm as exporters write it (Reshape, InstanceNormalization, Reshape, Mul, Add) -> nn.group_norm."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from helpers import assert_fused_matches_references
from rewrite_helpers import apply_rule
from test_skip_layernorm import ATOL, RTOL, compile_and_run
from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.frontend.onnx import random_inputs
from tvm_fusion.onnx_export import DOMAIN, evaluator, fused_onnx
from tvm_fusion.verify import reference_outputs


@I.ir_module
class TorchExport:
    """nn.GroupNorm(4, 8) as torch.onnx.export writes it, imported by TVM, constants folded (the
    instance norm's per-group scale and bias are the scalars 1 and 0 here)."""

    @R.function
    def main(x: R.Tensor((2, 8, 5, 6), "float32"), gamma: R.Tensor((8, 1, 1), "float32"),
             beta: R.Tensor((8, 1, 1), "float32")) -> R.Tensor((2, 8, 5, 6), "float32"):
        with R.dataflow():
            lv = R.reshape(x, R.shape([2, 4, 60]))
            lv1 = R.mean(lv, axis=[2], keepdims=True)
            lv2 = R.subtract(lv, lv1)
            lv3 = R.variance(lv, axis=[2], keepdims=True)
            lv4 = R.add(lv3, R.const(1e-5, "float32"))
            lv5 = R.sqrt(lv4)
            lv6 = R.divide(lv2, lv5)
            lv7 = R.multiply(lv6, R.const(1.0, "float32"))
            lv8 = R.add(lv7, R.const(0.0, "float32"))
            lv9 = R.reshape(lv8, R.shape([2, 8, 5, 6]))
            lv10 = R.multiply(lv9, gamma)
            gv = R.add(lv10, beta)
            R.output(gv)
        return gv


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((2, 8, 5, 6), "float32"), gamma: R.Tensor((8, 1, 1), "float32"),
             beta: R.Tensor((8, 1, 1), "float32")) -> R.Tensor((2, 8, 5, 6), "float32"):
        with R.dataflow():
            lv: R.Tensor((8,), "float32") = R.reshape(gamma, R.shape([8]))
            lv1: R.Tensor((8,), "float32") = R.reshape(beta, R.shape([8]))
            gv = R.nn.group_norm(x, lv, lv1, num_groups=4, channel_axis=1, axes=[2, 3],
                                 epsilon=9.9999997473787516e-06)  # float32(1e-5)
            R.output(gv)
        return gv


def arrays_for(mod, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32") * 3 + 1 for p in mod["main"].params]


def test_torch_export_becomes_group_norm():
    after, report = apply_rule(TorchExport, "group_norm")
    tvm.ir.assert_structural_equal(after, Expected)
    assert report.fired["group_norm"] == 1
    [instance] = report.instances
    assert instance.absorbed == ["lv", "lv1", "lv2", "lv3", "lv4", "lv5", "lv6", "lv7", "lv8", "lv9", "lv10", "gv"]
    arrays = arrays_for(TorchExport)
    np.testing.assert_allclose(compile_and_run(after, arrays), compile_and_run(TorchExport, arrays),
                               rtol=RTOL, atol=ATOL)


def test_a_decomposed_instance_norm_becomes_group_norm_before_layernorm_decomposed_sees_it():
    """ReduceMean, Sub, Mul (x * x), ReduceMean, Add eps, Sqrt, Div over the view; no affine."""

    @I.ir_module
    class Decomposed:
        @R.function
        def main(x: R.Tensor((1, 6, 4, 4), "float32")) -> R.Tensor((1, 6, 4, 4), "float32"):
            with R.dataflow():
                lv = R.reshape(x, R.shape([1, 3, 32]))
                lv1 = R.mean(lv, axis=[-1], keepdims=True)
                lv2 = R.subtract(lv, lv1)
                lv3 = R.multiply(lv2, lv2)
                lv4 = R.mean(lv3, axis=[-1], keepdims=True)
                lv5 = R.add(lv4, R.const(1e-6, "float32"))
                lv6 = R.sqrt(lv5)
                lv7 = R.divide(lv2, lv6)
                gv = R.reshape(lv7, R.shape([1, 6, 4, 4]))
                R.output(gv)
            return gv

    x = relax.Var("x", relax.TensorType((1, 6, 4, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(relax.op.nn.group_norm(
                x, relax.const(np.ones(6, "float32")), relax.const(np.zeros(6, "float32")), num_groups=3,
                channel_axis=1, axes=[2, 3], epsilon=float(np.float32(1e-6))))
        bb.emit_func_output(gv)
    expected = bb.get()

    after, report = apply_rule(Decomposed, "group_norm")
    assert report.fired["group_norm"] == 1
    tvm.ir.assert_structural_equal(after, expected)
    arrays = arrays_for(Decomposed, seed=1)
    np.testing.assert_allclose(compile_and_run(after, arrays), compile_and_run(Decomposed, arrays),
                               rtol=RTOL, atol=ATOL)


def torch_import(shape=(1, 8, 5, 6), groups=4, restored=None, group_scale=1.0, leak_mean=False, gamma_shape=None):
    """TorchExport built op by op (gamma and beta constants), with one thing changed."""
    channels = shape[1]
    gamma_shape = gamma_shape or (channels,) + (1,) * (len(shape) - 2)
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            view = bb.emit(relax.op.reshape(x, (shape[0], groups, -1)))
            mean = bb.emit(relax.op.mean(view, axis=[2], keepdims=True))
            centered = bb.emit(relax.op.subtract(view, mean))
            variance = bb.emit(relax.op.variance(view, axis=[2], keepdims=True))
            std = bb.emit(relax.op.sqrt(bb.emit(relax.op.add(variance, relax.const(1e-5, "float32")))))
            normed = bb.emit(relax.op.divide(centered, std))
            scaled = bb.emit(relax.op.multiply(normed, relax.const(group_scale, "float32")))
            shifted = bb.emit(relax.op.add(scaled, relax.const(0.0, "float32")))
            back = bb.emit(relax.op.reshape(shifted, restored or shape))
            gamma, beta = (relax.const(np.full(gamma_shape, value, "float32")) for value in (1.5, 0.5))
            out = bb.emit(relax.op.add(bb.emit(relax.op.multiply(back, gamma)), beta))
            out = bb.emit_output(relax.Tuple([out, mean]) if leak_mean else out)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("kwargs, reason", [
    ({"shape": (1, 6, 2, 2), "groups": 4}, "4 groups do not divide 6 channels"),
    ({"shape": (2, 8), "groups": 4}, "the input has shape (2, 8), not (N, C, spatial...)"),
    ({"restored": (1, 8, 30)}, "the normalized view is reshaped to (1, 8, 30), not back to the input's (1, 8, 5, 6)"),
    ({"group_scale": 2.0}, "the instance norm's scale is not 1 everywhere (an affine per group, not per channel)"),
    ({"leak_mean": True}, "the intermediate mean (lv1) is also used outside the chain"),
])
def test_must_not_rewrite(kwargs, reason):
    before = torch_import(**kwargs)
    after, report = apply_rule(before, "group_norm")
    tvm.ir.assert_structural_equal(after, before)
    assert not report.fired
    assert reason in [m.reason for m in report.near_misses]


def test_a_gamma_that_is_not_per_channel_stays_outside_the_group_norm():
    """A Mul by a (C, H, W) tensor is no per-channel affine: the variant with gamma and beta
    declines, the one without them takes the norm, and the Mul and Add stay as they were."""
    before = torch_import(gamma_shape=(8, 5, 6))
    after, report = apply_rule(before, "group_norm")
    assert report.fired["group_norm"] == 1
    reasons = [m.reason for m in report.near_misses]
    assert "gamma shape (8, 5, 6) is not one value per channel of (1, 8, 5, 6)" in reasons
    assert [b.value.op.name for b in after["main"].body.blocks[0].bindings] == [
        "relax.nn.group_norm", "relax.multiply", "relax.add"]
    arrays = arrays_for(before)
    np.testing.assert_allclose(compile_and_run(after, arrays), compile_and_run(before, arrays), rtol=RTOL, atol=ATOL)


# The ONNX graph as torch.onnx.export writes nn.GroupNorm, end to end --------------------------

def torch_group_norm_model(shape=(1, 32, 12, 10), groups=8, silu=False, decomposed=False) -> onnx.ModelProto:
    """``nn.GroupNorm(groups, C)`` [then SiLU] as torch's TorchScript exporter writes it (opset 17):
    Constant view shape [0, G, -1], Reshape, InstanceNormalization with Constant ones and zeros,
    Reshape to Shape(x), Mul by Unsqueeze(weight), Add Unsqueeze(bias); nodes named like torch's.
    ``decomposed``: the instance norm written out (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div)."""
    rng = np.random.default_rng(0)
    channels = shape[1]

    def const(name, value):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value)))

    nodes = [const("view_shape", np.array([0, groups, -1], np.int64)),
             helper.make_node("Reshape", ["x", "view_shape"], ["grouped"])]
    if decomposed:
        nodes += [const("two", np.float32(2)), const("eps", np.float32(1e-5)),
                  helper.make_node("ReduceMean", ["grouped"], ["mean"], axes=[-1]),
                  helper.make_node("Sub", ["grouped", "mean"], ["centered"]),
                  helper.make_node("Pow", ["centered", "two"], ["square"]),
                  helper.make_node("ReduceMean", ["square"], ["variance"], axes=[-1]),
                  helper.make_node("Add", ["variance", "eps"], ["variance_eps"]),
                  helper.make_node("Sqrt", ["variance_eps"], ["std"]),
                  helper.make_node("Div", ["centered", "std"], ["normed"])]
    else:
        nodes += [const("ones", np.ones(groups, np.float32)), const("zeros", np.zeros(groups, np.float32)),
                  helper.make_node("InstanceNormalization", ["grouped", "ones", "zeros"], ["normed"], epsilon=1e-5)]
    nodes += [helper.make_node("Shape", ["x"], ["x_shape"]),
              helper.make_node("Reshape", ["normed", "x_shape"], ["restored"]),
              const("axes", np.array([1, 2], np.int64)),
              helper.make_node("Unsqueeze", ["weight", "axes"], ["gamma"]),
              helper.make_node("Mul", ["restored", "gamma"], ["scaled"]),
              helper.make_node("Unsqueeze", ["bias", "axes"], ["beta"]),
              helper.make_node("Add", ["scaled", "beta"], ["norm_out" if silu else "y"])]
    if silu:
        nodes += [helper.make_node("Sigmoid", ["norm_out"], ["gate"]),
                  helper.make_node("Mul", ["norm_out", "gate"], ["y"])]
    for index, node in enumerate(nodes):
        node.name = f"/norm/{node.op_type}_{index}"
    graph = helper.make_graph(
        nodes, "group_norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
        [numpy_helper.from_array(rng.normal(1, 0.3, channels).astype(np.float32), "weight"),
         numpy_helper.from_array(rng.normal(0, 0.3, channels).astype(np.float32), "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("decomposed", [False, True])
def test_torch_exported_group_norm_is_one_kernel_matching_onnxruntime(tmp_path, silu, decomposed):
    model = torch_group_norm_model(silu=silu, decomposed=decomposed)
    onnx.save(model, tmp_path / "group_norm.onnx")
    prepared = api.prepare(tmp_path / "group_norm.onnx", load_config(), None)
    optimized = api.optimize(prepared)
    assert optimized.report.fired["group_norm"] == 1
    assert not optimized.report.fired["layernorm_decomposed"]  # the decomposed instance norm is group_norm's
    assert list(optimized.schedule_rules.values()) == ["GroupNorm"]  # one kernel, SiLU included
    inputs = random_inputs(prepared.onnx_model, prepared.inputs, seed=0)
    assert_fused_matches_references(model, prepared, optimized, inputs, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("decomposed", [False, True])
def test_fused_onnx_is_one_group_norm_node_that_matches_onnxruntime(tmp_path, decomposed):
    model = torch_group_norm_model(decomposed=decomposed)
    onnx.save(model, tmp_path / "group_norm.onnx")
    report = api.export_fused_onnx(tmp_path / "group_norm.onnx", None, None, tmp_path / "fused.onnx", check=True)
    assert report.fused_ops == {"GroupNorm": 1}
    assert not report.kept
    assert report.comparisons and all(c.within_tolerance for c in report.comparisons)
    fused = onnx.load(str(tmp_path / "fused.onnx"))
    [node] = [n for n in fused.graph.node if n.domain == DOMAIN]
    assert (node.op_type, list(node.input), list(node.output)) == ("GroupNorm", ["x", "gamma", "beta"], ["y"])
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attributes["num_groups"] == 8 and abs(attributes["epsilon"] - 1e-5) < 1e-9


def test_group_norm_reference_op_without_affine_matches_onnxruntime():
    """The op's definition on its own: the nodes up to the Reshape back (no Mul, no Add), fused by hand."""
    model = torch_group_norm_model(shape=(2, 6, 3, 5), groups=3)
    keep = [n for n in model.graph.node if n.op_type not in ("Unsqueeze", "Mul", "Add")]
    keep[-1].output[0] = "y"
    del model.graph.node[:]
    model.graph.node.extend(keep)
    del model.graph.initializer[:]
    feeds = {"x": np.random.default_rng(3).standard_normal((2, 6, 3, 5)).astype(np.float32) * 4 + 2}
    absorbed = [i for i, n in enumerate(model.graph.node) if n.op_type in ("Reshape", "InstanceNormalization")]
    instance = api.FusedNodes("group_norm", "group_norm", [model.graph.node[i].name for i in absorbed],
                              [model.graph.node[i].op_type for i in absorbed], absorbed)
    result = fused_onnx(model, [instance], feeds)
    assert not result.kept and result.fused == {"GroupNorm": 1}
    [node] = [n for n in result.model.graph.node if n.domain == DOMAIN]
    assert list(node.input) == ["x"]
    (expected,) = reference_outputs(model, feeds).values()
    (actual,) = evaluator(result.model).run(None, feeds)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)


def test_symbolic_height_and_width_rewrite_and_match_at_every_size():
    from symbolic_helpers import HEIGHT, WIDTH, pipeline_and_compare, symbolic_module

    def exported(x, gamma, beta):  # the view's last axis is 4 * height * width
        view = relax.op.reshape(x, (1, 4, -1))
        mean = relax.op.mean(view, axis=[2], keepdims=True)
        std = relax.op.sqrt(relax.op.add(relax.op.variance(view, axis=[2], keepdims=True),
                                         relax.const(1e-5, "float32")))
        normed = relax.op.divide(relax.op.subtract(view, mean), std)
        back = relax.op.reshape(normed, (1, 16, HEIGHT, WIDTH))
        return relax.op.add(relax.op.multiply(back, gamma), beta)

    rng = np.random.default_rng(0)
    weights = {name: rng.normal(size=(16, 1, 1)).astype("float32") for name in ("gamma", "beta")}
    report, log = pipeline_and_compare(symbolic_module(exported, {"x": (1, 16, HEIGHT, WIDTH)}, weights),
                                       [(1, 1), (3, 17), (40, 9)])
    assert report.fired["group_norm"] == 1
    assert list(log.values()) == ["GroupNorm"]


# The standard ONNX op -------------------------------------------------------------------------

def onnx_group_norm_model(opset: int, silu: bool = False, shape=(2, 12, 5, 7), groups=4) -> onnx.ModelProto:
    """One GroupNormalization node: scale and bias per group at opsets 18-20, per channel from 21."""
    rng = np.random.default_rng(1)
    affine = groups if opset < 21 else shape[1]
    nodes = [helper.make_node("GroupNormalization", ["x", "scale", "bias"], ["norm_out" if silu else "y"],
                              num_groups=groups, epsilon=1e-5)]
    if silu:
        nodes += [helper.make_node("Sigmoid", ["norm_out"], ["gate"]), helper.make_node("Mul", ["norm_out", "gate"], ["y"])]
    graph = helper.make_graph(
        nodes, "group_norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
        [numpy_helper.from_array(rng.normal(1, 0.3, affine).astype(np.float32), "scale"),
         numpy_helper.from_array(rng.normal(0, 0.3, affine).astype(np.float32), "bias")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize("silu", [False, True])
def test_onnx_group_normalization_is_one_kernel_matching_onnxruntime(tmp_path, opset, silu):
    """Opset 18's per-group scale included, which onnx's checker calls deprecated (ONNX Runtime
    runs it as its spec says): the model loads, unchanged, and compiles to one GroupNorm kernel."""
    model = onnx_group_norm_model(opset, silu)
    onnx.save(model, tmp_path / "group_norm.onnx")
    prepared = api.prepare(tmp_path / "group_norm.onnx", load_config(), None)
    assert prepared.onnx_model == model  # the checker's view of it was put back
    optimized = api.optimize(prepared)
    assert list(optimized.schedule_rules.values()) == ["GroupNorm"]
    inputs = random_inputs(prepared.onnx_model, prepared.inputs, seed=0)
    assert_fused_matches_references(model, prepared, optimized, inputs, rtol=RTOL, atol=ATOL)

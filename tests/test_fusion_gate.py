"""The per-fusion numeric gate: a wrong fused kernel, injected through a test-only pattern, is
undone (that instance only), reported, recorded in metadata.json, and the artifact still verifies."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from tvm_fusion import api, session
from tvm_fusion.config import load_config
from tvm_fusion.errors import VerificationError
from tvm_fusion.passes import pipeline
from tvm_fusion.patterns import FusionRule, pattern_registry

WIDTH = 64


class AddRelu(FusionRule):
    """Test only: relu(x + constant) as one composite."""

    name = "test_add_relu"

    def variants(self):
        add = is_op("relax.add")(wildcard(), is_const())
        return [("add_relu", is_op("relax.nn.relu")(add), {"add": add})]


def two_add_relus() -> onnx.ModelProto:
    """x -> Add(1) -> Relu -> Add(2) -> Relu: the pattern fires twice."""
    nodes = [helper.make_node("Add", ["x", "one"], ["a"], name="add_first"),
             helper.make_node("Relu", ["a"], ["r"], name="relu_first"),
             helper.make_node("Add", ["r", "two"], ["b"], name="add_second"),
             helper.make_node("Relu", ["b"], ["y"], name="relu_second")]
    graph = helper.make_graph(
        nodes, "two_add_relus", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, WIDTH])],
        [numpy_helper.from_array(np.full(WIDTH, v, np.float32), n) for n, v in (("one", 1.0), ("two", 2.0))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@tvm.transform.module_pass(opt_level=0, name="CorruptAddRelu")
def corrupt_add_relu(mod, _ctx):
    """The wrong kernel: relu(x + c*c - c + 1), right for c = 1, off by 1 for c = 2. Both
    instances share one composite function (the same shapes), so the fault is in the data."""
    for gvar, func in list(mod.functions_items()):
        if (isinstance(func, relax.Function) and func.attrs and "Composite" in func.attrs
                and str(func.attrs["Composite"]).startswith(AddRelu.name)):
            x, c = func.params
            one = relax.const(1.0, "float32")
            wrong = relax.op.nn.relu(relax.op.add(x, relax.op.add(relax.op.subtract(relax.op.multiply(c, c), c), one)))
            mod[gvar] = relax.Function(func.params, relax.SeqExpr([], wrong), func.ret_ty, attrs=func.attrs)
    return relax.transform.Normalize()(mod)


@pytest.fixture
def wrong_fusion(monkeypatch, tmp_path):
    monkeypatch.setitem(pattern_registry(), AddRelu.name, AddRelu())
    lowering = pipeline.lowering_passes

    def corrupting(*args):
        return [corrupt_add_relu, *lowering(*args)]

    # The gate lowers through the pipeline's phases, compile through the session's lowered stage.
    monkeypatch.setattr(pipeline, "lowering_passes", corrupting)
    monkeypatch.setattr(session, "lowering_passes", corrupting)
    path = tmp_path / "two_add_relus.onnx"
    onnx.save(two_add_relus(), path)
    config = dataclasses.replace(load_config(None), patterns=(AddRelu.name,))
    return path, config


def test_gate_undoes_exactly_the_wrong_instance(wrong_fusion, tmp_path):
    path, config = wrong_fusion
    messages: list[str] = []
    result = api.compile_model(path, config, output_dir=tmp_path / "build", progress=messages.append)
    gate = result.metadata["fusion_gate"]
    assert gate["checked"] == 2
    (undone,) = gate["undone"]
    assert undone["pattern"] == AddRelu.name and undone["variant"] == "test_add_relu.add_relu"
    assert undone["onnx_nodes"] == ["add_second", "relu_second"]
    assert undone["max_abs_error"] == pytest.approx(1.0) and undone["allowed"] < 1.0
    assert result.metadata["fusions"] == {AddRelu.name: 1}  # the first stays fused
    assert result.metadata["fusion_variants"] == {"test_add_relu.add_relu": 1}
    assert any("fusion gate: undid test_add_relu.add_relu over add_second, relu_second" in m for m in messages)
    on_disk = json.loads((result.artifact / "metadata.json").read_text())
    assert on_disk["fusion_gate"]["undone"][0]["onnx_nodes"] == ["add_second", "relu_second"]


def test_without_the_gate_the_wrong_kernel_ships_and_verification_catches_it(wrong_fusion, tmp_path):
    path, config = wrong_fusion
    with pytest.raises(VerificationError):
        api.compile_model(path, config, output_dir=tmp_path / "build", fusion_gate=False)


@tvm.transform.module_pass(opt_level=0, name="CorruptAddReluAlways")
def corrupt_add_relu_always(mod, _ctx):
    """The wrong kernel, wrong for every constant: relu(x + c + 1)."""
    for gvar, func in list(mod.functions_items()):
        if (isinstance(func, relax.Function) and func.attrs and "Composite" in func.attrs
                and str(func.attrs["Composite"]).startswith(AddRelu.name)):
            x, c = func.params
            wrong = relax.op.nn.relu(relax.op.add(relax.op.add(x, c), relax.const(1.0, "float32")))
            mod[gvar] = relax.Function(func.params, relax.SeqExpr([], wrong), func.ret_ty, attrs=func.attrs)
    return relax.transform.Normalize()(mod)


def test_calls_of_one_kernel_on_the_same_constants_are_checked_once_and_undone_together(monkeypatch, tmp_path):
    """An unrolled loop's steps are thousands of calls of a few kernels: the gate builds one
    check per kernel and constants, and a failing check undoes every call it stands for."""
    monkeypatch.setitem(pattern_registry(), AddRelu.name, AddRelu())
    lowering = pipeline.lowering_passes

    def corrupting(*args):
        return [corrupt_add_relu_always, *lowering(*args)]

    monkeypatch.setattr(pipeline, "lowering_passes", corrupting)
    monkeypatch.setattr(session, "lowering_passes", corrupting)
    model = two_add_relus()
    model.graph.node[2].input[1] = "one"  # both adds by the same constant
    path = tmp_path / "same_constant.onnx"
    onnx.save(model, path)
    config = dataclasses.replace(load_config(None), patterns=(AddRelu.name,))

    built = []
    compile_ = tvm.compile
    monkeypatch.setattr(tvm, "compile", lambda mod, *a, **k: built.append(mod) or compile_(mod, *a, **k))
    result = api.compile_model(path, config, output_dir=tmp_path / "build")
    gate = result.metadata["fusion_gate"]
    assert gate["checked"] == 2
    assert sorted(u["onnx_nodes"][0] for u in gate["undone"]) == ["add_first", "add_second"]
    wrappers = [gv.name_hint for mod in built for gv, _ in mod.functions_items()
                if re.fullmatch(r"fused_\d+", gv.name_hint)]
    assert wrappers == ["fused_0"]  # one check for both calls

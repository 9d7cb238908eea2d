"""An If that the input values decide: one build per branch, and a ``main`` that runs only the
branch its condition takes (``tvm_fusion/dispatch/branches.py``); the ONNX side, each branch and the
condition as a model of its own (``frontend/if_hoisting.py``); must-not cases where both
branches stay inlined: most weights outside the If, a ranged dim."""

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import helpers
from tvm_fusion import api
from tvm_fusion.dispatch.branches import branch_condition
from tvm_fusion.frontend.if_hoisting import (condition_model, inputs_taking, shared_weight_share, take_branch,
                                             undecided_conditions)
from tvm_fusion.runtime import load


def _linear_branch(name: str, scale: float) -> object:
    """``relu(h @ W + b) * scale``: a layer the gemm epilogue fuses, inside the branch."""
    rng = np.random.default_rng(len(name))
    nodes = [helper.make_node("MatMul", ["h", f"{name}_w"], [f"{name}_mm"], name=f"{name}_matmul"),
             helper.make_node("Add", [f"{name}_mm", f"{name}_b"], [f"{name}_biased"], name=f"{name}_bias"),
             helper.make_node("Relu", [f"{name}_biased"], [f"{name}_act"], name=f"{name}_relu"),
             helper.make_node("Mul", [f"{name}_act", f"{name}_scale"], [f"{name}_out"], name=f"{name}_scale")]
    inits = [numpy_helper.from_array(rng.standard_normal((32, 16)).astype(np.float32), f"{name}_w"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), f"{name}_b"),
             numpy_helper.from_array(np.array(scale, np.float32), f"{name}_scale")]
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT,
                                                                             [4, 16])], inits)


def rate_switch_model(trunk_width: int = 8, rows="4") -> object:
    """``h = x @ T`` (the trunk, shared), then an If on ``sr == 16000`` choosing one of two
    linear layers on ``h``; ``trunk_width`` sets how much of the weight the trunk holds."""
    rng = np.random.default_rng(0)
    trunk = (rng.standard_normal((trunk_width, 32)) / np.sqrt(trunk_width)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "trunk_w"], ["h"], name="trunk"),
             helper.make_node("Equal", ["sr", "rate16k"], ["is16k"], name="is16k"),
             helper.make_node("If", ["is16k"], ["y"], name="by_rate", then_branch=_linear_branch("wide", 2.0),
                              else_branch=_linear_branch("narrow", -1.0))]
    dims = [int(rows) if rows.isdigit() else rows, trunk_width]
    graph = helper.make_graph(
        nodes, "rate_switch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [dims[0], 16])],
        [numpy_helper.from_array(trunk, "trunk_w"), numpy_helper.from_array(np.array(16000, np.int64), "rate16k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _simplified(tmp_path, model, shapes=None):
    prepared = api.prepare(helpers.save(model, tmp_path / "rate_switch.onnx"), None, shapes)
    return prepared, prepared.simplified_with_weights()


def _ops(model) -> list[str]:
    return [node.op_type for node in model.graph.node]


def test_each_branch_is_a_model_of_its_own(tmp_path):
    _, simplified = _simplified(tmp_path, rate_switch_model())
    assert undecided_conditions(simplified) == ["by_rate/cond"]
    for taken, kept, gone in ((True, "wide", "narrow"), (False, "narrow", "wide")):
        branch = take_branch(simplified, "by_rate/cond", taken)
        names = [node.name for node in branch.graph.node]
        assert "Where" not in _ops(branch) and "trunk" in names
        assert any(kept in name for name in names) and not any(gone in name for name in names)
    condition = condition_model(simplified, "by_rate/cond")
    assert [o.name for o in condition.graph.output] == ["by_rate/cond"]
    assert "MatMul" not in _ops(condition) and not any(i.name == "trunk_w" for i in condition.graph.initializer)


def test_inputs_that_take_each_branch_are_found(tmp_path):
    _, simplified = _simplified(tmp_path, rate_switch_model())
    feed = {"x": np.ones((4, 8), np.float32), "sr": np.array(1, np.int64)}
    assert inputs_taking(simplified, "by_rate/cond", feed, False) is feed  # 1 != 16000 already
    taking = inputs_taking(simplified, "by_rate/cond", feed, True)
    assert int(taking["sr"]) == 16000 and taking["x"] is feed["x"]


def test_no_input_takes_a_branch_that_cannot_be_taken(tmp_path):
    """``sr == sr``: the else branch is dead; no value is claimed to reach it."""
    model = rate_switch_model()
    model.graph.node[1].input[1] = "sr"
    _, simplified = _simplified(tmp_path, model)
    feed = {"x": np.ones((4, 8), np.float32), "sr": np.array(1, np.int64)}
    assert inputs_taking(simplified, "by_rate/cond", feed, False) is None


def test_main_runs_only_the_branch_taken_and_matches_onnxruntime(tmp_path, config_path):
    path = helpers.save(rate_switch_model(), tmp_path / "rate_switch.onnx")
    result = api.compile_model(path, config_path(schedule="default"), output_dir=tmp_path / "build")
    # Verified on each branch: the seeded sr (0 or 1) takes the else branch, 16000 the then branch.
    assert result.metadata["verification"]["branch_inputs"] == [{"sr": 16000}]
    assert [c.name for c in result.comparisons] == ["y", "y @ sr=16000"]
    # Only the builds per branch are scheduled: every kernel the metadata names is one of theirs.
    assert result.metadata["schedule_rules"]
    assert all(name.endswith(("_then", "_else", "_condition")) for name in result.metadata["schedule_rules"])
    model = load(result.artifact)
    called: set[str] = set()

    def note(_func, name, before_run, _ret, *_args):
        if before_run:
            called.add(name)
        return relax.VMInstrumentReturnKind.NO_OP

    vm = relax.VirtualMachine(model._machines._module, model._device)
    vm.set_instrument(note)
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    for rate, ran, skipped in ((16000, "_then", "_else"), (8000, "_else", "_then")):
        called.clear()
        inputs = {"x": x, "sr": np.array(rate, np.int64)}
        vm["main"](*model.prepare(inputs))
        assert any(name.endswith(ran) for name in called) and not any(name.endswith(skipped) for name in called)
        np.testing.assert_allclose(model.run(inputs)["y"], helpers.ort_outputs(path, inputs)["y"],
                                   rtol=1e-5, atol=1e-5)


def test_kernel_calls_count_one_arm_of_the_dispatch(tmp_path, config_path):
    prepared = api.prepare(helpers.save(rate_switch_model(), tmp_path / "rate_switch.onnx"),
                           config_path(schedule="default"))
    scheduled = api.ModelSession.of(prepared).scheduled(prepared.config)
    assert scheduled.branch_condition == "by_rate/cond"
    module = scheduled.module
    assert isinstance(module["main"].body.blocks[-1].bindings[-1].value, relax.If)
    arms = [_kernel_calls_of(module, f"main{suffix}") for suffix in ("_then", "_else")]
    condition = _kernel_calls_of(module, "main_condition")
    assert arms[0] == arms[1] >= 1 and api.kernel_calls(module) == condition + arms[0]


def _kernel_calls_of(module, name: str) -> int:
    """``kernel_calls`` of one function of ``module``, as if it were ``main``."""
    functions = {gv: f for gv, f in module.functions_items() if gv.name_hint != "main"}
    return api.kernel_calls(tvm.IRModule({**functions, "main": module[name]}))


@pytest.mark.parametrize("case", ["most weights shared", "ranged dim"])
def test_must_not_build_per_branch(tmp_path, config_path, case):
    """The trunk holding most weights would be built (and stored) twice; a ranged model keeps
    one symbolic build. Both keep the branches inlined, selected by a Where."""
    model = rate_switch_model(trunk_width=256) if case == "most weights shared" else rate_switch_model(rows="rows")
    shapes = ["x:1..8x8"] if case == "ranged dim" else None
    prepared = api.prepare(helpers.save(model, tmp_path / "rate_switch.onnx"), config_path(schedule="default"), shapes)
    if case == "most weights shared":
        assert shared_weight_share(prepared.simplified, "by_rate/cond") > 0.5
    assert branch_condition(prepared) is None
    scheduled = api.ModelSession.of(prepared).scheduled(prepared.config)
    assert scheduled.branch_condition is None and "main_then" not in [gv.name_hint for gv in scheduled.module.get_global_vars()]


def test_profile_of_an_artifact_built_per_branch_names_the_branch_run(tmp_path, config_path):
    """profile rebuilds the artifact's kernels and times its library: the kernels it reports are
    the ones the seeded inputs run (the else branch and the condition), under their names there."""
    path = helpers.save(rate_switch_model(), tmp_path / "rate_switch.onnx")
    artifact = api.compile_model(path, config_path(schedule="default"), output_dir=tmp_path / "build").artifact
    report = api.profile_model(artifact, rounds=2)
    names = [kernel.name for kernel in report.kernels]
    assert names and all(name.endswith(("_else", "_condition")) for name in names)
    assert any(kernel.pattern.startswith("gemm_epilogue") for kernel in report.kernels)

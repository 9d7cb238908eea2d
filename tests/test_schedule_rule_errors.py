"""A schedule rule that raises never aborts a compile: its kernel goes on to the next rule, and
compile, inspect and metadata.json name the rule, the kernel and the error in one line each."""

from __future__ import annotations

import json

import onnx
import pytest
from onnx import TensorProto, helper
from tvm import s_tir
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule

from tvm_fusion import api, cli, schedules

STEPS, FEATURES = 24, 32


def _attention_pooling_model() -> onnx.ModelProto:
    """Weights over time (a softmax over axis 1 of [batch, time, 1]) times features, summed over
    time: the kernel on which SoftmaxOverOuterAxis raised StopIteration (issue 42)."""
    nodes = [helper.make_node("Softmax", ["scores"], ["weights"], axis=1, name="pool_softmax"),
             helper.make_node("Mul", ["weights", "h"], ["weighted"], name="pool_weight"),
             helper.make_node("ReduceSum", ["weighted", "axes"], ["pooled"], keepdims=0, name="pool_sum")]
    graph = helper.make_graph(
        nodes, "pool",
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, STEPS, 1]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, STEPS, FEATURES])],
        [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, [2, FEATURES])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


class StopsOnSoftmax(ScheduleRule):
    """Starts scheduling a softmax kernel, then raises StopIteration (a ``next`` over loops that
    are not there), as SoftmaxOverOuterAxis did; declines every other kernel."""

    def apply(self, func, target, _):
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(get_root_block(sch))
        if not any(sch.get(block).name_hint.startswith("T_softmax") for block in blocks):
            return None
        sch.parallel(sch.get_loops(blocks[-1])[0])
        return next(iter(()))


@pytest.fixture
def pooling_path(tmp_path):
    path = tmp_path / "pool.onnx"
    onnx.save(_attention_pooling_model(), path)
    return path


@pytest.fixture
def planted(monkeypatch):
    """StopsOnSoftmax asked first, before the registry's rules."""
    original = schedules.rules_for_kind
    monkeypatch.setattr(schedules, "rules_for_kind", lambda kind: (StopsOnSoftmax(), *original(kind)))


def _softmax_kernel(metadata: dict) -> str:
    (kernel,) = [name for name in metadata["schedule_rules"] if "softmax" in name]
    return kernel


def test_the_attention_pooling_softmax_compiles_without_a_rule_error(tmp_path, pooling_path, config_path):
    result = api.compile_model(pooling_path, config_path(), output_dir=tmp_path / "build")
    kernel = _softmax_kernel(result.metadata)
    assert result.metadata["schedule_rule_errors"] == []
    assert result.metadata["schedule_rules"][kernel] != "SoftmaxOverOuterAxis"
    assert result.comparisons and all(c.within_tolerance for c in result.comparisons)


def test_compile_goes_on_past_a_raising_rule_and_names_it(tmp_path, pooling_path, config_path, planted):
    said: list[str] = []
    result = api.compile_model(pooling_path, config_path(), output_dir=tmp_path / "build", progress=said.append)
    # (a) built, and its library agrees with ONNX Runtime (compile checks it before it commits)
    assert result.comparisons and all(c.within_tolerance for c in result.comparisons)
    assert result.metadata["verification"]["outputs"][0]["within_tolerance"]
    # (b) metadata.json, as written, names the rule, the kernel and the error
    metadata = json.loads((result.artifact / "metadata.json").read_text())
    kernel = _softmax_kernel(metadata)
    taken = metadata["schedule_rules"][kernel]
    assert taken not in ("StopsOnSoftmax", "SoftmaxOverOuterAxis")
    assert metadata["schedule_rule_errors"] == [
        {"kernel": kernel, "rule": "StopsOnSoftmax", "error": "StopIteration", "scheduled_by": taken}]
    warnings = [m for m in said if "StopsOnSoftmax" in m]
    assert warnings == [f"WARNING: schedule rule StopsOnSoftmax failed on kernel {kernel} (StopIteration); "
                        f"{taken} scheduled it instead (report the model)"]


def test_inspect_names_a_raising_rule(pooling_path, config_path, planted):
    report = api.inspect_model(pooling_path, config_path())
    (error,) = report.schedule_rule_errors
    assert (error.rule, error.error) == ("StopsOnSoftmax", "StopIteration") and "softmax" in error.kernel
    assert report.to_json()["schedule_rule_errors"] == [
        {"kernel": error.kernel, "rule": "StopsOnSoftmax", "error": "StopIteration",
         "scheduled_by": error.scheduled_by}]


@pytest.mark.parametrize("command", ["compile", "inspect"])
def test_the_cli_prints_one_line_not_a_traceback(capsys, tmp_path, pooling_path, config_path, planted, command):
    argv = [command, str(pooling_path), "--config", str(config_path())]
    if command == "compile":
        argv += ["-o", str(tmp_path / "build")]
    code = cli.main(["-q", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Traceback" not in out + err
    (line,) = [line for line in out.splitlines() if "StopsOnSoftmax" in line]
    assert line.startswith("WARNING: schedule rule StopsOnSoftmax failed on kernel ")
    assert "softmax" in line and "(StopIteration)" in line and "scheduled it instead" in line

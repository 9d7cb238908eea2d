"""Compile-time application: only records of the same workload, target key and TVM version apply."""

from __future__ import annotations

import base64
import json

import pytest
import tvm
import tvm_ffi
from machine import other_target
from tuning_helpers import ADD, GELU, add_record, other_schedule

from tvm_fusion import api
from tvm_fusion.tuning.store_contents import RECORD_FILE, WORKLOAD_FILE, target_key

OTHER_MACHINE = other_target()


@pytest.fixture
def log_root(tmp_path):
    return tmp_path / "logs"


@pytest.fixture
def store(log_root, mlp_prepared):
    return log_root / target_key(mlp_prepared.config.tvm_target())


def optimized(prepared, log_root, notes=None):
    return api.optimize(prepared, tuning_log=log_root, progress=(notes.append if notes is not None else print))


def test_faster_record_schedules_its_kernel_and_hand_best_stays_hand(mlp_path, mlp_config, mlp_prepared,
                                                                     mlp_tasks, store, log_root, tmp_path):
    target = mlp_prepared.config.tvm_target()
    add_record(store, mlp_tasks[ADD], mlp_tasks[ADD].hand_schedule, 5e-6, target)
    add_record(store, mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 2e-6, target)
    add_record(store, mlp_tasks[GELU], mlp_tasks[GELU].hand_schedule, 5e-6, target)
    add_record(store, mlp_tasks[GELU], other_schedule(mlp_tasks[GELU]), 9e-6, target)

    result = optimized(mlp_prepared, log_root)
    assert result.schedule_rules == {ADD: "tuned", GELU: "MatmulEpilogue"}
    assert list(result.tuned) == [ADD]
    assert result.tuned[ADD].latency_us == pytest.approx(2.0) and result.tuned[ADD].trials == 2
    tuned_body = other_schedule(mlp_tasks[ADD]).mod["main"].body
    assert tvm_ffi.structural_equal(result.module[ADD].body, tuned_body, map_free_vars=True)
    assert result.module[ADD].attrs["tirx.is_scheduled"]

    compiled = api.compile_model(mlp_path, mlp_config, ["x:4x16"], output_dir=tmp_path / "build",
                                 tuning_log=log_root)  # verified against ONNX Runtime
    assert compiled.metadata["tuning"]["tuned_kernels"] == [ADD]
    assert compiled.metadata["tuning"]["hand_schedule_measured_fastest"] == [GELU]
    assert compiled.metadata["tuning"]["target_key"] == store.name


def test_records_of_another_target_are_reported_not_applied(mlp_prepared, mlp_tasks, store, log_root):
    other = tvm.target.Target(OTHER_MACHINE)
    add_record(store, mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 1e-9, other)
    notes: list[str] = []
    result = optimized(mlp_prepared, log_root, notes)
    assert result.tuned == {} and result.schedule_rules[ADD] == "MatmulEpilogue"
    assert any(f"target '{target_key(OTHER_MACHINE)}'" in n and "not applied" in n for n in notes), notes


def test_logs_only_for_another_machine_class_are_reported(mlp_prepared, mlp_tasks, log_root):
    other = tvm.target.Target(OTHER_MACHINE)
    add_record(log_root / target_key(other), mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 1e-9, other)
    notes: list[str] = []
    result = optimized(mlp_prepared, log_root, notes)
    assert result.tuned == {}
    assert any(f"only for {target_key(OTHER_MACHINE)}: hand schedules" in n for n in notes), notes


def _rewrite_tvm_version(store, version: str) -> None:
    lines = (store / WORKLOAD_FILE).read_text().splitlines()
    shash, encoded = json.loads(lines[0])
    raw = base64.b64decode(encoded)
    graph = json.loads(raw[8:])
    graph["metadata"]["tvm_version"] = version
    body = json.dumps(graph).encode()
    lines[0] = json.dumps([shash, base64.b64encode(len(body).to_bytes(8, "little") + body).decode()])
    (store / WORKLOAD_FILE).write_text("\n".join(lines) + "\n")


def test_records_from_another_tvm_version_are_reported_not_applied(mlp_prepared, mlp_tasks, store, log_root):
    add_record(store, mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 1e-9, mlp_prepared.config.tvm_target())
    _rewrite_tvm_version(store, "0.26.0")
    notes: list[str] = []
    result = optimized(mlp_prepared, log_root, notes)
    assert result.tuned == {}
    assert any("from TVM 0.26.0" in n and "not applied" in n for n in notes), notes


def test_damaged_line_is_reported_and_good_records_still_apply(mlp_prepared, mlp_tasks, store, log_root):
    target = mlp_prepared.config.tvm_target()
    add_record(store, mlp_tasks[GELU], other_schedule(mlp_tasks[GELU]), 1e-9, target)
    with open(store / RECORD_FILE, "a") as stream:
        stream.write('[0, [[["GetSBlock", [], ["ro\n')
    notes: list[str] = []
    result = optimized(mlp_prepared, log_root, notes)
    assert list(result.tuned) == [GELU]
    assert any(f"{RECORD_FILE}:2: not JSON" in n for n in notes), notes


def test_without_a_matching_log_the_pipeline_is_unchanged(mlp_prepared, mlp_tasks, log_root):
    other = tvm.target.Target(OTHER_MACHINE)
    add_record(log_root / target_key(other), mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 1e-9, other)
    untouched = api.optimize(mlp_prepared, tuning_log=False)
    for log in (log_root, log_root / "missing"):
        result = optimized(mlp_prepared, log, [])
        tvm.ir.assert_structural_equal(result.module, untouched.module)
        assert result.schedule_rules == untouched.schedule_rules


def test_record_whose_trace_does_not_replay_falls_back_to_the_next_best(mlp_prepared, mlp_tasks, store, log_root):
    target = mlp_prepared.config.tvm_target()
    add_record(store, mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 2e-6, target)
    index, body = json.loads((store / RECORD_FILE).read_text().splitlines()[0])
    body[0][0][0][0] = "NoSuchInstruction"  # valid JSON, broken trace, and the fastest
    body[1] = [1e-9]
    with open(store / RECORD_FILE, "a") as stream:
        stream.write(json.dumps([index, body]) + "\n")
    notes: list[str] = []
    result = optimized(mlp_prepared, log_root, notes)
    assert list(result.tuned) == [ADD] and result.tuned[ADD].latency_us == pytest.approx(2.0)
    assert any(f"{RECORD_FILE}:2: record does not replay" in n for n in notes), notes


def test_best_record_that_is_an_older_hand_schedule_is_not_applied(mlp_prepared, mlp_tasks, store, log_root):
    """A fixed (unsampled) trace that is not today's hand schedule: the rules changed since tuning."""
    from tvm_fusion.schedules.cpu import Fallback

    stale = Fallback().apply(mlp_tasks[ADD].mod["main"], None, False)
    add_record(store, mlp_tasks[ADD], stale, 1e-9, mlp_prepared.config.tvm_target())
    notes: list[str] = []
    result = optimized(mlp_prepared, log_root, notes)
    assert result.tuned == {} and result.schedule_rules[ADD] == "MatmulEpilogue"
    assert any(f"{ADD}: its best record is an older hand schedule" in n for n in notes), notes



def test_records_tuned_at_a_static_size_schedule_the_bucket_of_that_size(mlp_path, mlp_config, mlp_prepared,
                                                                        mlp_tasks, store, log_root):
    """MetaSchedule tunes static kernels only; a shape bucket is a static build, so records
    tuned at its size apply to its kernels, and the symbolic kernels keep the hand schedules."""
    import dataclasses

    from tvm_fusion.frontend.dims import ranges_of

    add_record(store, mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 2e-6, mlp_prepared.config.tvm_target())
    dynamic = api.prepare(mlp_path, mlp_config, ["x:1..8x16"])
    (dim,) = ranges_of(dynamic.inputs)
    bucketed = dataclasses.replace(dynamic, config=dataclasses.replace(dynamic.config, buckets=(((dim, 4),),)))
    result = optimized(bucketed, log_root)
    assert result.schedule_rules[f"{ADD}_at_{dim}4"] == "tuned"
    assert result.schedule_rules[ADD] == "MatmulEpilogue"
    assert list(result.tuned) == [f"{ADD}_at_{dim}4"]

"""The tuning-log store: target keys, damaged lines, concurrent writers, merge, prune, diff."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tvm
import tvm_ffi
from machine import HOST_MCPU, OTHER_MCPU, host_target, other_target
from tuning_helpers import ADD, GELU, add_record, other_schedule

from tvm_fusion.errors import TuningLogError
from tvm_fusion.tuning import logs
from tvm_fusion.tuning.store import TuningStore
from tvm_fusion.tuning.store_contents import RECORD_FILE, WORKLOAD_FILE, read_store, target_key, workload_id


def test_target_key_separates_machine_classes():
    base = host_target()
    assert target_key(base) == f"llvm-{HOST_MCPU}-2c"
    keys = {target_key(base), target_key({**base, "mcpu": OTHER_MCPU}), target_key({**base, "num-cores": 8}),
            target_key({**base, "mattr": ["+avx2"]}), target_key({"kind": "llvm", "num-cores": 2})}
    assert len(keys) == 5


@pytest.fixture
def store(tmp_path, mlp_tasks, mlp_prepared):
    """A store with one hand record per kernel and two sampled (tuned-like) records of different speed for ADD."""
    directory = tmp_path / "logs" / target_key(mlp_prepared.config.tvm_target())
    target = mlp_prepared.config.tvm_target()
    add_record(directory, mlp_tasks[ADD], mlp_tasks[ADD].hand_schedule, 4e-6, target)
    add_record(directory, mlp_tasks[GELU], mlp_tasks[GELU].hand_schedule, 6e-6, target)
    add_record(directory, mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 3e-6, target)
    add_record(directory, mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 9e-6, target)
    TuningStore(directory).update_kernels({workload_id(t.mod): {"name": name, "models": ["mlp"]}
                                           for name, t in mlp_tasks.items()})
    return directory


def test_a_written_store_loads_in_metaschedule_json_database(store):
    from tvm.s_tir import meta_schedule as ms

    database = ms.database.JSONDatabase(str(store / WORKLOAD_FILE), str(store / RECORD_FILE),
                                        allow_missing=False)
    assert len(database) == 4
    contents = read_store(store)
    assert contents.problems == [] and len(contents.records) == 4 and len(contents.workloads) == 2


def test_damaged_lines_are_reported_and_skipped(store):
    lines = (store / RECORD_FILE).read_text().splitlines()
    lines[1] = lines[1][: len(lines[1]) // 2]           # truncated, as by a kill mid-write
    lines.insert(3, "[7, garbled")                       # garbled
    lines.append(json.dumps([5, json.loads(lines[0])[1]]))  # refers to a workload that is not there
    (store / RECORD_FILE).write_text("\n".join(lines) + "\n")
    contents = read_store(store)
    where = [(p.file.endswith(RECORD_FILE), p.line) for p in contents.problems]
    assert where == [(True, 2), (True, 4), (True, 6)]
    assert "truncated" in contents.problems[0].reason and "workload line 6" in contents.problems[2].reason
    assert str(contents.problems[0]).startswith(f"{store / RECORD_FILE}:2: ")
    assert len(contents.records) == 3  # every good record kept


def test_damaged_workload_line_drops_only_its_records(store):
    lines = (store / WORKLOAD_FILE).read_text().splitlines()
    (store / WORKLOAD_FILE).write_text(lines[0] + "\n" + lines[1][:100] + "\n")
    contents = read_store(store)
    assert [(p.file.endswith(WORKLOAD_FILE), p.line) for p in contents.problems][0] == (True, 2)
    assert {r.workload_index for r in contents.records} == {0}
    assert len(contents.records) == 3


def test_append_after_a_truncated_tail_keeps_the_new_record(store, mlp_tasks, mlp_prepared):
    path = store / RECORD_FILE
    path.write_bytes(path.read_bytes() + b'[0, [[["GetSBlo')  # writer killed mid-line
    add_record(store, mlp_tasks[GELU], other_schedule(mlp_tasks[GELU]), 1e-6, mlp_prepared.config.tvm_target())
    contents = read_store(store)
    assert [p.line for p in contents.problems] == [5]
    assert len(contents.records) == 5 and min(r.mean_secs for r in contents.records) == pytest.approx(1e-6)


WRITER = """
import sys
sys.path[:0] = [{tests!r}, {tuning_tests!r}]
from tuning_helpers import ADD, GELU, add_record, other_schedule
from tvm_fusion import api
from tvm_fusion.session import ModelSession
from tvm_fusion.tuning.tasks import kernel_tasks
prepared = api.prepare({model!r}, {config!r}, ["x:4x16"])
target = prepared.config.tvm_target()
tasks = {{t.name: t for t in kernel_tasks(ModelSession.of(prepared).tuning_module(prepared.config), target)}}
name = sys.argv[2]
for i in range(int(sys.argv[3])):
    add_record(sys.argv[1], tasks[name], other_schedule(tasks[name]), float(sys.argv[4]) + i * 1e-9, target)
"""


def test_two_writers_on_one_store_do_not_corrupt_it(tmp_path, mlp_path, mlp_config, mlp_tasks):
    """Each writer commits a different kernel first: without the lock their workload line
    numbers would disagree and records would point at the wrong workload (and not replay)."""
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent.parent)
    code = WRITER.format(tests=tests, tuning_tests=str(Path(__file__).resolve().parent),
                         model=str(mlp_path), config=str(mlp_config))
    directory = tmp_path / "shared"
    writers = [subprocess.Popen([sys.executable, "-c", code, str(directory), name, "15", secs])
               for name, secs in ((ADD, "1e-6"), (GELU, "2e-6"))]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    contents = read_store(directory)
    assert contents.problems == []
    assert len(contents.workloads) == 2 and len(contents.records) == 30
    for record in contents.records:  # each record sits on the workload it was measured for
        on_add = tvm_ffi.structural_equal(contents.workloads[record.workload_index].mod, mlp_tasks[ADD].mod)
        assert on_add == (record.mean_secs < 1.5e-6)


def test_merge_keeps_the_best_record_per_workload(tmp_path, mlp_tasks, mlp_prepared):
    target = mlp_prepared.config.tvm_target()
    key = target_key(target)
    machine_a, machine_b = tmp_path / "a" / key, tmp_path / "b" / key
    add_record(machine_a, mlp_tasks[ADD], mlp_tasks[ADD].hand_schedule, 5e-6, target)
    add_record(machine_a, mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 7e-6, target)
    add_record(machine_b, mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 2e-6, target)
    add_record(machine_b, mlp_tasks[GELU], mlp_tasks[GELU].hand_schedule, 8e-6, target)
    other = other_target(num_cores=16)
    add_record(machine_b, mlp_tasks[GELU], mlp_tasks[GELU].hand_schedule, 1e-6, tvm.target.Target(other))

    report = logs.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "merged")
    merged = read_store(tmp_path / "merged" / key)
    assert merged.problems == []
    best = {kernel_of(merged, r, mlp_tasks): r.mean_secs for r in merged.records}
    assert best == {ADD: pytest.approx(2e-6), GELU: pytest.approx(8e-6)}
    assert len(merged.records) == 2
    # The record measured on another machine class went to that class's store, not this one.
    foreign = read_store(tmp_path / "merged" / target_key(other))
    assert [r.target_key for r in foreign.records] == [target_key(other)]
    assert report.read == 5


def kernel_of(contents, record, tasks) -> str:
    workload = contents.workloads[record.workload_index].mod
    return next(name for name, task in tasks.items() if tvm_ffi.structural_equal(task.mod, workload))


def test_prune_drops_failed_foreign_and_slower_records(store, mlp_tasks, mlp_prepared):
    target = mlp_prepared.config.tvm_target()
    add_record(store, mlp_tasks[GELU], other_schedule(mlp_tasks[GELU]), 1e10, target)  # failed run
    add_record(store, mlp_tasks[GELU], mlp_tasks[GELU].hand_schedule, 1e-7,
               tvm.target.Target(other_target()))
    (report,) = logs.prune(store)
    assert report.kept == 2
    assert report.dropped == {"other target": 1, "failed measurement": 1, "beyond the best 1": 2}
    pruned = read_store(store)
    assert pruned.problems == []
    assert sorted(r.mean_secs for r in pruned.records) == [pytest.approx(3e-6), pytest.approx(6e-6)]


def test_show_and_diff_report_per_kernel(store, tmp_path, mlp_tasks, mlp_prepared):
    rows, notes = logs.show(store.parent)
    assert notes == []
    by_kernel = {row.kernel: row for row in rows}
    assert by_kernel[ADD].trials == 3 and by_kernel[ADD].best_us == pytest.approx(3.0)
    assert by_kernel[GELU].trials == 1 and by_kernel[GELU].status == "ok"

    other = tmp_path / "other" / store.name
    add_record(other, mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 1.5e-6, mlp_prepared.config.tvm_target())
    rows = {r.kernel: r for r in logs.diff(store, other)}
    assert rows[ADD].speedup == pytest.approx(2.0) and (rows[ADD].trials_a, rows[ADD].trials_b) == (3, 1)
    assert rows[GELU].best_b_us is None


def test_bad_paths_and_keep_are_clear_errors(tmp_path, store):
    with pytest.raises(TuningLogError, match="does not exist"):
        logs.show(tmp_path / "nope")
    with pytest.raises(TuningLogError, match="keep at least 1"):
        logs.prune(store, keep=0)
    assert workload_id(read_store(store).workloads[0].mod).isdigit()

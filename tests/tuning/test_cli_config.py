"""The `[tuning]` config section and the `tune` / `tuning-log` command lines (parsing, output, errors)."""

from __future__ import annotations

import pytest
from tuning_helpers import ADD, GELU, add_record, other_schedule

from tvm_fusion import cli
from tvm_fusion.config import DEFAULT_CONFIG, load_config
from tvm_fusion.errors import ConfigError
from tvm_fusion.tuning.store import TuningStore
from tvm_fusion.tuning.store_contents import read_store, target_key, workload_id


def test_bundled_config_tunes_into_the_user_store_and_reads_the_shipped_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("TVM_FUSION_TUNING_LOGS", str(tmp_path / "mine"))
    tuning = load_config(None).tuning
    assert tuning.log_dir == str(tmp_path / "mine")
    assert tuning.read_dirs() == [str(tmp_path / "mine"), str((DEFAULT_CONFIG.parent.parent / "tuning_logs"))]
    monkeypatch.delenv("TVM_FUSION_TUNING_LOGS")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert load_config(None).tuning.log_dir == str(tmp_path / "data" / "tvm_fusion" / "tuning_logs")
    assert tuning.trials >= tuning.per_task_trials >= tuning.trials_per_iter >= 1
    assert "*transpose*" in tuning.exclude


@pytest.mark.parametrize("line, key", [("trials = 0", "tuning.trials"), ("per_task_trials = 1.5", "tuning.per_task_trials"),
                                       ("time_limit_s = -1", "tuning.time_limit_s"), ('exclude = "take"', "tuning.exclude"),
                                       ("log_dir = 3", "tuning.log_dir"), ("budget = 3", "tuning.budget")])
def test_bad_tuning_values_name_the_key(tmp_path, line, key):
    path = tmp_path / "bad.toml"
    path.write_text(f'[target]\nkind = "llvm"\n[tuning]\n{line}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"key '{key}'" in str(info.value) and str(path) in str(info.value)


def test_log_dir_is_relative_to_the_config_file(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "c.toml"
    path.write_text('[target]\nkind = "llvm"\n[tuning]\nlog_dir = "../logs"\ntime_limit_s = 90\n')
    tuning = load_config(path).tuning
    assert tuning.log_dir == str(tmp_path / "logs") and tuning.time_limit_s == 90.0
    assert tuning.read_dirs() == [str(tmp_path / "logs")]  # a config's own log_dir is read alone


@pytest.fixture
def store(tmp_path, mlp_tasks, mlp_prepared):
    target = mlp_prepared.config.tvm_target()
    directory = tmp_path / "logs" / target_key(target)
    add_record(directory, mlp_tasks[ADD], mlp_tasks[ADD].hand_schedule, 4e-6, target)
    add_record(directory, mlp_tasks[ADD], other_schedule(mlp_tasks[ADD]), 2e-6, target)
    add_record(directory, mlp_tasks[GELU], other_schedule(mlp_tasks[GELU]), 1e10, target)
    TuningStore(directory).update_kernels({workload_id(t.mod): {"name": n, "models": ["mlp"], "hand_us": 4.0}
                                           for n, t in mlp_tasks.items()})
    return directory


def test_tuning_log_show_prune_merge_diff(store, tmp_path, capsys):
    assert cli.main(["tuning-log", "show", str(store.parent)]) == 0
    shown = capsys.readouterr().out
    add_row = next(line for line in shown.splitlines() if f" {ADD} " in line)
    assert add_row.split()[3:8] == ["2", "0", "2", "4", "ok"]  # trials, failed, best us, hand us, status

    assert cli.main(["tuning-log", "merge", str(store.parent), "-o", str(tmp_path / "merged")]) == 0
    assert "1" in capsys.readouterr().out
    assert cli.main(["tuning-log", "diff", str(store), str(tmp_path / "merged" / store.name)]) == 0
    assert f"{ADD}" in capsys.readouterr().out

    assert cli.main(["tuning-log", "prune", str(store)]) == 0
    assert "kept 1, dropped 1 failed measurement, 1 beyond the best 1" in capsys.readouterr().out
    assert len(read_store(store).records) == 1


def test_tuning_log_errors_exit_non_zero(tmp_path, capsys):
    assert cli.main(["tuning-log", "show", str(tmp_path / "missing")]) == 8
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["tune", "model.onnx", "--rpc-tracker", "localhost"])
    assert info.value.code == 2
    assert "is not HOST:PORT" in capsys.readouterr().err
    assert cli.main(["tune", "model.onnx", "--rpc-key", "board"]) == 1
    assert "--rpc-tracker and --rpc-key go together" in capsys.readouterr().err

"""What ships with the package: configs by name, the user-level tuning store, the demo model,
and a wheel that carries them (built here, read without installing it)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tvm_fusion import bundled, cli
from tvm_fusion.build import load_tuning
from tvm_fusion.config import DEFAULT_CONFIG, load_config, shipped_configs
from tvm_fusion.errors import ConfigError
from tvm_fusion.tuning.store_contents import target_key

ROOT = Path(__file__).resolve().parent.parent


def test_every_config_in_configs_loads_by_name():
    names = bundled.config_names()
    assert names == sorted(path.stem for path in (ROOT / "configs").glob("*.toml"))
    assert {"x86_64-host", "x86_64-avx2", "aarch64", "cuda-sm90"} <= set(names)
    for name in names:
        by_name, by_file = load_config(name), load_config(ROOT / "configs" / f"{name}.toml")
        assert by_name.target == by_file.target and by_name.name == name
        assert load_config(f"{name}.toml").path == by_name.path


def test_default_config_is_the_shipped_host_config():
    assert load_config(None).path == str(DEFAULT_CONFIG) == str(bundled.config_path("x86_64-host"))


def test_unknown_name_lists_the_shipped_configs():
    with pytest.raises(ConfigError) as info:
        load_config("x86_64-avx3")
    assert "x86_64-avx3" in info.value.message
    for name in bundled.config_names():
        assert name in info.value.hint


def test_a_file_in_the_current_directory_wins_over_a_shipped_name(tmp_path, monkeypatch):
    (tmp_path / "x86_64-avx2").write_text('[target]\nkind = "llvm"\nmcpu = "haswell"\n')
    monkeypatch.chdir(tmp_path)
    assert load_config("x86_64-avx2").target["mcpu"] == "haswell"
    assert load_config("x86_64-avx2.toml").target["mcpu"] == "x86-64-v3"  # no such file here: the shipped one


def test_a_missing_path_is_not_taken_for_a_name(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "x86_64-avx2.toml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("sub/x86_64-avx2")


def test_configs_command_lists_every_shipped_config(capsys):
    assert cli.main(["configs"]) == 0
    out = capsys.readouterr().out
    for config in shipped_configs():
        assert config.name in out and config.target in out
    assert "cuda sm_90" in out and "llvm x86-64-v3" in out
    assert str(bundled.config_dir()) in out


def test_user_store_is_read_before_the_shipped_logs(tmp_path, monkeypatch):
    """A target with a store of the user's reads that one; else the shipped store for the target."""
    config = load_config(None)
    key_dir = tmp_path / "shipped" / "some-key"
    key_dir.mkdir(parents=True)
    user = tmp_path / "user"
    tuning = type(config.tuning)(log_dir=str(user), shipped_dir=str(tmp_path / "shipped"))
    assert tuning.read_dirs() == [str(user), str(tmp_path / "shipped")]
    key = target_key(config.tvm_target())
    (tmp_path / "shipped" / key).mkdir()
    (tmp_path / "shipped" / key / "database_workload.json").write_text("")
    (tmp_path / "shipped" / key / "database_tuning_record.json").write_text("")
    records = load_tuning(dataclasses.replace(config, tuning=tuning))
    assert records is not None and records.directory == tmp_path / "shipped" / key
    (user / key).mkdir(parents=True)
    (user / key / "database_workload.json").write_text("")
    (user / key / "database_tuning_record.json").write_text("")
    assert load_tuning(dataclasses.replace(config, tuning=tuning)).directory == user / key


def test_demo_model_ships():
    assert bundled.demo_model().is_file() and bundled.demo_model().name == "bert_tiny.onnx"


def test_wheel_carries_configs_logs_demo_model_and_the_runner(tmp_path):
    """Built from a copy of the tree, so the build leaves nothing in the checkout."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info",
                                                                "__pycache__", ".pytest_cache"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("tvm_fusion-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in bundled.config_names():
        assert f"tvm_fusion/_bundled/configs/{name}.toml" in names
    shipped_logs = [p.relative_to(ROOT).as_posix() for p in (ROOT / "tuning_logs").rglob("*")
                    if p.is_file() and not p.name.startswith(".")]
    assert shipped_logs and all(f"tvm_fusion/_bundled/{p}" in names for p in shipped_logs)
    assert "tvm_fusion/_bundled/examples/models/bert_tiny.onnx" in names
    assert "tvm_fusion/targets/vm_runner.cc" in names and "tvm_fusion/targets/CMakeLists.txt" in names

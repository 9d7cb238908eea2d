"""ModelSession: each stage runs once, and every command gets its stages from it."""

from __future__ import annotations

import dataclasses

import pytest

from tvm_fusion import api
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.session import ModelSession


@pytest.fixture
def counted(monkeypatch):
    """How often onnxslim and the Relax import run (the module attributes the session calls)."""
    calls = {"simplify": 0, "import": 0}
    for attribute, name in (("simplify", "simplify"), ("import_model", "import")):
        original = getattr(onnx_frontend, attribute)

        def counting(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(onnx_frontend, attribute, counting)
    return calls


def test_a_compile_simplifies_and_imports_once(counted, mlp_path, config_path, tmp_path):
    """With the fusion gate on (the default), which used to import a second, node-named copy."""
    result = api.compile_model(mlp_path, config_path(), ["x:4x16"], output_dir=tmp_path)
    assert result.metadata["fusion_gate"]["checked"] >= 1
    assert counted == {"simplify": 1, "import": 1}


def test_two_targets_share_one_import(counted, mlp_path, config_path, tmp_path):
    configs = [api.resolve_config(config_path()),
               dataclasses.replace(api.resolve_config(config_path(schedule="none")), name="unscheduled")]
    results = api.compile_targets(mlp_path, configs, ["x:4x16"], output_dir=tmp_path)
    assert [r.error for r in results] == [None, None]
    assert counted == {"simplify": 1, "import": 1}


def test_a_bucket_is_imported_once_more(counted, mlp_path, config_path, tmp_path):
    """A bucket is a static build of its own: one more import at its exact size, no other."""
    api.compile_model(mlp_path, config_path(), ["x:1..8x16"], output_dir=tmp_path, buckets=["batch=4"])
    assert counted == {"simplify": 2, "import": 2}


def test_stages_are_cached(mlp_path, config_path):
    session = ModelSession(mlp_path, ["x:4x16"])
    prepared = session.prepared(config_path())
    assert session.prepared(config_path()) is prepared
    assert session.fused(prepared).module is session.fused(prepared).module
    scheduled = session.scheduled(prepared.config, tuning_log=False)
    assert session.scheduled(prepared.config, tuning_log=False) is scheduled
    assert scheduled.report.fired  # the MLP's matmul + bias + GELU


def test_inspect_reports_on_the_graph_compile_fuses(mlp_path, config_path, tmp_path):
    """inspect and compile read one stage, so their fusion counts cannot disagree."""
    inspected = api.inspect_model(mlp_path, config_path(), ["x:4x16"])
    compiled = api.compile_model(mlp_path, config_path(), ["x:4x16"], output_dir=tmp_path, fusion_gate=False)
    assert dict(inspected.report.fired) == dict(compiled.report.fired)
    assert inspected.kernels == compiled.metadata["kernels"]

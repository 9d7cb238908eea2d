"""Deploying without Python: `tvm-fusion export-runner` writes vm_runner.cc and a CMake build
against the TVM runtime alone; the built runner gives the outputs tvm_fusion.load gives."""

from __future__ import annotations

import numpy as np
import pytest

import helpers
import tvm_fusion
from tvm_fusion import api, cli
from tvm_fusion.targets.emulation import run_with_runner
from tvm_fusion.targets.native_runner import FILES, build_runner


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return build_runner(tmp_path_factory.mktemp("runner"))


def test_export_runner_writes_the_sources_and_the_defaults(capsys, tmp_path):
    assert cli.main(["-q", "export-runner", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted([*FILES, "paths.cmake"])
    assert "cmake -S" in out
    defaults = (tmp_path / "r" / "paths.cmake").read_text()
    for key in ("TVM_RUNTIME_LIB_DIR", "TVM_FFI_LIB_DIR", "TVM_FFI_INCLUDE_DIR", "DLPACK_INCLUDE_DIR"):
        assert f"set({key} " in defaults


def test_runner_matches_the_python_runtime_on_the_mlp(runner, mlp_artifact):
    x = np.random.default_rng(4).standard_normal((4, 16)).astype(np.float32)
    metadata = helpers.read_metadata(mlp_artifact)
    got = run_with_runner([str(runner)], mlp_artifact / "model.so", metadata, {"x": x})
    np.testing.assert_allclose(got["y"], tvm_fusion.load(mlp_artifact).run({"x": x})["y"], rtol=1e-6, atol=1e-7)


def test_runner_matches_the_python_runtime_on_the_bundled_bert(runner, tmp_path, config_path):
    artifact = api.compile_model(helpers.EXAMPLES / "bert_tiny.onnx", config_path(), ["input_ids:1x32"],
                                 tmp_path).artifact
    model = tvm_fusion.load(artifact)
    inputs = model.filled_inputs({}, "random", seed=3)
    got = run_with_runner([str(runner)], artifact / "model.so", model.metadata, inputs)
    expected = model.run(inputs)
    assert list(got) == list(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)

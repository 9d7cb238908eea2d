"""``compile --precision int8``: ONNX Runtime quantizes the float model to int8 QDQ, that model is
compiled and verified against ONNX Runtime on it, kept beside the artifact, and the artifact's
accuracy against the float model is reported; with a calibration folder, or seeded random
inputs and a warning; and the flag's misuses get one clear message each."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest

from tvm_fusion import api, cli
from tvm_fusion.errors import ConfigError

MLP_SHAPE = "x:4x16"


@pytest.fixture(scope="module")
def int8_build(tmp_path_factory, mlp_path):
    out = tmp_path_factory.mktemp("int8")
    said: list[str] = []
    result = api.compile_model(mlp_path, None, [MLP_SHAPE], output_dir=out, precision="int8", progress=said.append)
    return result, out, said


def test_the_quantized_model_is_compiled_verified_and_kept(int8_build):
    result, out, said = int8_build
    quantized = out / "mlp.int8.onnx"
    assert quantized.is_file()
    ops = {node.op_type for node in onnx.load(str(quantized)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    metadata = result.metadata
    assert metadata["precision"] == "int8"
    assert metadata["int8"]["quantized_model"] == str(quantized)
    assert "quantize_static" in metadata["int8"]["quantizer"]
    assert metadata["int8"]["calibration"] == "8 seeded random inputs (seed 0)"
    assert result.comparisons and all(c.within_tolerance for c in result.comparisons)  # against ONNX Runtime on it
    assert any("WARNING: --precision int8 without --calibration" in line for line in said)


def test_its_accuracy_against_the_float_model_is_reported(int8_build):
    result, _, said = int8_build
    (row,) = result.metadata["int8_accuracy_against_float"]
    assert row["output"] == "y"
    # int8 rounding: near the float model, not equal to it (the report would hide nothing else)
    assert 0 < row["max_abs_error"] < 0.5 and row["cosine_similarity"] > 0.99
    assert any("int8 against ONNX Runtime float32 on the float model" in line for line in said)


def test_a_calibration_folder_is_used(tmp_path, mlp_path):
    samples = tmp_path / "samples"
    samples.mkdir()
    rng = np.random.default_rng(1)
    for i in range(3):
        np.savez(samples / f"s{i}.npz", x=rng.standard_normal((4, 16)).astype(np.float32))
    said: list[str] = []
    result = api.compile_model(mlp_path, None, [MLP_SHAPE], output_dir=tmp_path / "out", precision="int8",
                               calibration=samples, progress=said.append)
    assert result.metadata["int8"]["calibration"] == f"3 samples from {samples}"
    assert not any("without --calibration" in line for line in said)


def test_calibration_without_int8_is_refused(tmp_path, mlp_path):
    with pytest.raises(ConfigError, match="--calibration is for --precision int8"):
        api.compile_model(mlp_path, None, [MLP_SHAPE], output_dir=tmp_path, calibration=tmp_path)


def test_int8_needs_static_shapes(tmp_path, mlp_path):
    with pytest.raises(ConfigError, match="needs static input shapes"):
        api.compile_model(mlp_path, None, ["x:1..8x16"], output_dir=tmp_path, precision="int8")
    assert not any(tmp_path.iterdir())


def test_a_bad_calibration_sample_exits_non_zero_naming_it(tmp_path, mlp_path, capsys):
    samples = tmp_path / "samples"
    samples.mkdir()
    np.savez(samples / "bad.npz", x=np.zeros((4, 15), np.float32))
    code = cli.main(["compile", str(mlp_path), "--input-shape", MLP_SHAPE, "-o", str(tmp_path / "out"),
                     "--precision", "int8", "--calibration", str(samples)])
    err = capsys.readouterr().err
    assert code != 0 and "bad.npz" in err and "[4, 15]" in err
    assert not (tmp_path / "out" / "mlp.int8.onnx").exists()


def test_a_full_disk_while_quantizing_exits_non_zero_leaving_no_half_model(tmp_path, mlp_path, capsys, monkeypatch):
    """The disk fills up while the quantized model is written (simulated): one message naming the
    model file and what to do, a non-zero exit, and no model file, whole or half."""
    real_save = onnx.save

    def half_save(model, path, *args, **kwargs):
        if str(path).endswith("quantized.onnx"):
            Path(path).write_bytes(b"half a model")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(model, path, *args, **kwargs)

    monkeypatch.setattr(onnx, "save", half_save)
    monkeypatch.setattr(onnx, "save_model", half_save)
    out = tmp_path / "out"
    code = cli.main(["compile", str(mlp_path), "--input-shape", MLP_SHAPE, "-o", str(out), "--precision", "int8"])
    err = capsys.readouterr().err
    assert code != 0
    assert f"cannot write the int8 model {out / 'mlp.int8.onnx'}: No space left on device" in err
    assert "free disk space" in err
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_int8_is_a_compile_flag(command, mlp_path, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main([command, str(mlp_path), "--input-shape", MLP_SHAPE, "--precision", "int8"])
    assert raised.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_the_artifact_runs_like_any_other(int8_build, tmp_path):
    result, _, _ = int8_build
    metadata = json.loads((result.artifact / "metadata.json").read_text())
    assert metadata["precision"] == "int8"
    code = cli.main(["-q", "run", str(result.artifact), "--fill", "random"])
    assert code == 0

"""The ``tvm-fusion`` CLI: each command's output, and one clear error + exit code per mistake."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import helpers
from tvm_fusion import cli
from tvm_fusion.errors import ArtifactError, ConfigError, ModelError, ShapeError

MLP_SHAPE = ["--input-shape", "x:4x16"]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error(err: str) -> None:
    """Exactly one error (message + fix line), no traceback."""
    assert err.count("tvm-fusion: error:") == 1, err
    assert "Traceback" not in err
    assert "\n  fix: " in err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- compile ---------------------------------------------------------------------------------

def test_compile_writes_artifact_and_prints_fusions_and_verification(capsys, tmp_path, mlp_path, config_path):
    code, out, err = run_cli(capsys, "compile", mlp_path, "--config", config_path(), *MLP_SHAPE,
                             "-o", tmp_path / "build")
    assert code == 0, err
    artifact = tmp_path / "build" / f"mlp.{config_path().stem}"
    assert sorted(p.name for p in artifact.iterdir()) == ["metadata.json", "model.so"]
    assert f"artifact: {artifact}" in out
    assert re.search(r"^gelu_erf\s+1$", out, re.M), out
    assert re.search(r"^gemm_epilogue\s+2$", out, re.M), out
    assert re.search(r"^kernels per call: \d+$", out, re.M)
    assert "result (rtol=0.001, atol=0.0001)" in out
    assert re.search(r"^y\s+\S+\s+\S+\s+ok$", out, re.M), out
    meta = helpers.read_metadata(artifact)
    assert meta["inputs"] == [{"name": "x", "shape": [4, 16], "dtype": "float32"}]
    # progress messages went to stderr, not into the report on stdout
    assert "verifying against ONNX Runtime" in err and "verifying" not in out
    # nothing else was left in the output directory
    assert [p.name for p in (tmp_path / "build").iterdir()] == [artifact.name]


def test_compile_no_verify(capsys, tmp_path, mlp_path, config_path):
    code, out, err = run_cli(capsys, "-q", "compile", mlp_path, "--config", config_path(), *MLP_SHAPE,
                             "-o", tmp_path, "--no-verify")
    assert code == 0, err
    assert "verification: skipped (--no-verify)" in out
    assert helpers.read_metadata(tmp_path / f"mlp.{config_path().stem}")["verification"] is None
    assert not re.search(r"^\[\s*\d+\.\ds\]", err, re.M), err  # -q: no progress lines


def test_compile_non_onnx_file(capsys, tmp_path, config_path):
    bogus = tmp_path / "model.onnx"
    bogus.write_text("definitely not a protobuf")
    code, out, err = run_cli(capsys, "-q", "compile", bogus, "--config", config_path(), "-o", tmp_path / "b")
    assert code == ModelError.exit_code == 3
    assert_one_error(err)
    assert str(bogus) in err and "is not an ONNX model" in err
    assert not (tmp_path / "b").exists()


def test_compile_missing_model(capsys, tmp_path, config_path):
    code, out, err = run_cli(capsys, "-q", "compile", tmp_path / "nope.onnx", "--config", config_path())
    assert code == 3
    assert_one_error(err)
    assert "nope.onnx does not exist" in err


def test_compile_unbound_dynamic_dim(capsys, tmp_path, mlp_path, config_path):
    code, out, err = run_cli(capsys, "-q", "compile", mlp_path, "--config", config_path(dims={}),
                             "-o", tmp_path / "b")
    assert code == ShapeError.exit_code == 4
    assert_one_error(err)
    assert "input 'x' dim 0 ('batch') is dynamic and unbound" in err
    assert "--input-shape x:Nx16" in err
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("flag,text", [("x:4x", "cannot parse --input-shape 'x:4x'"),
                                       ("y:4x16", "names 'y', which is not an input"),
                                       ("x:4x15", "dim 1 is fixed to 16")])
def test_compile_bad_shape_flag(capsys, tmp_path, mlp_path, config_path, flag, text):
    code, out, err = run_cli(capsys, "-q", "compile", mlp_path, "--config", config_path(),
                             "--input-shape", flag, "-o", tmp_path)
    assert code == 4
    assert_one_error(err)
    assert text in err


def test_compile_bad_config(capsys, tmp_path, mlp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[pipeline]\nschedule = 'fastest'\n")
    code, out, err = run_cli(capsys, "-q", "compile", mlp_path, "--config", config, *MLP_SHAPE, "-o", tmp_path / "b")
    assert code == ConfigError.exit_code == 2
    assert_one_error(err)
    assert f"{config}: key 'pipeline.schedule'" in err and "default, none" in err


def test_compile_unsupported_op_keeps_previous_artifact(capsys, tmp_path, unsupported_path, mlp_artifact,
                                                       config_path):
    # An earlier artifact of the same name must survive a failed compile.
    previous = tmp_path / f"unsupported.{config_path().stem}"
    shutil.copytree(mlp_artifact, previous)
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, "-q", "compile", unsupported_path, "--config", config_path(), "-o", tmp_path)
    assert code == 3
    assert_one_error(err)
    assert "Celu (nodes: celu_first, celu_second)" in err and "com.example.FancyOp (nodes: fancy_node)" in err
    assert snapshot(tmp_path) == before


def test_keyboard_interrupt_exit_code(capsys, monkeypatch, mlp_path):
    import tvm_fusion.api

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tvm_fusion.api, "compile_model", interrupted)
    code, out, err = run_cli(capsys, "-q", "compile", mlp_path)
    assert code == 130 and "interrupted" in err


# --- subprocess: the exit code reaches the shell ---------------------------------------------

def test_console_script_exit_code(tmp_path, unsupported_path, config_path):
    import subprocess

    script = Path(sys.executable).with_name("tvm-fusion")
    assert script.is_file()
    proc = subprocess.run([str(script), "-q", "compile", str(unsupported_path), "--config", str(config_path()),
                           "-o", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert_one_error(proc.stderr)
    assert "Celu" in proc.stderr and proc.stdout == ""


def test_python_module_exit_code(tmp_path, mlp_path):
    import subprocess

    config = tmp_path / "bad.toml"
    config.write_text("[target]\nkind = 'llvm'\nnum-cores = -1\n")
    proc = subprocess.run([sys.executable, "-m", "tvm_fusion.cli", "-q", "compile", str(mlp_path),
                           "--config", str(config)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert_one_error(proc.stderr)
    assert "target.num-cores" in proc.stderr
    assert not (tmp_path / "build").exists()


# --- run -------------------------------------------------------------------------------------

def test_run_fill_random_repeat(capsys, tmp_path, mlp_artifact):
    code, out, err = run_cli(capsys, "-q", "run", mlp_artifact, "--fill", "random", "--repeat", "3",
                             "--save", tmp_path)
    assert code == 0, err
    y = np.load(tmp_path / "y.npy")
    assert y.shape == (4, 8) and np.all(np.isfinite(y)) and y.std() > 0  # random, not zeros
    match = re.search(r"^y: shape \[4, 8\] dtype float32 mean (\S+) std (\S+)$", out, re.M)
    assert match, out
    assert float(match.group(1)) == pytest.approx(float(y.mean()), rel=1e-4, abs=1e-6)
    assert float(match.group(2)) == pytest.approx(float(y.std()), rel=1e-4)
    assert re.search(r"^latency: min (\S+) / median (\S+) / p90 \S+ / p99 \S+ / max (\S+) ms over 3 runs, "
                     r"[\d,]+ calls/s$", out, re.M), out


def test_run_fill_zeros_matches_onnxruntime(capsys, tmp_path, mlp_artifact, mlp_path):
    code, out, err = run_cli(capsys, "-q", "run", mlp_artifact, "--fill", "zeros", "--save", tmp_path)
    assert code == 0, err
    expected = helpers.ort_outputs(mlp_path, {"x": np.zeros((4, 16), np.float32)})["y"]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), expected, rtol=1e-4, atol=1e-6)


def test_run_input_file_and_save(capsys, tmp_path, mlp_artifact, mlp_path):
    x = np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code, out, err = run_cli(capsys, "-q", "run", mlp_artifact, "--input", f"x={tmp_path / 'x.npy'}",
                             "--save", tmp_path / "outputs")
    assert code == 0, err
    assert "median latency" not in out  # only with --repeat > 1
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["names.json", "outputs.npz", "y.npy"]
    expected = helpers.ort_outputs(mlp_path, {"x": x})["y"]
    np.testing.assert_allclose(np.load(tmp_path / "outputs" / "y.npy"), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.load(tmp_path / "outputs" / "outputs.npz")["y"],
                                  np.load(tmp_path / "outputs" / "y.npy"))
    assert json.loads((tmp_path / "outputs" / "names.json").read_text()) == {"y.npy": "y"}


def test_run_without_inputs_fills_them_randomly_and_says_so(capsys, tmp_path, mlp_artifact):
    code, out, err = run_cli(capsys, "run", mlp_artifact, "--save", tmp_path / "default")
    assert code == 0, err
    assert "no --input given: random inputs (x)" in err and "--fill zeros" in err
    code, _, err = run_cli(capsys, "-q", "run", mlp_artifact, "--fill", "random", "--save", tmp_path / "asked")
    assert code == 0 and "random inputs" not in err
    np.testing.assert_array_equal(np.load(tmp_path / "default" / "y.npy"), np.load(tmp_path / "asked" / "y.npy"))


def test_run_save_output_names_that_are_not_file_names(capsys, tmp_path, config_path):
    """paddle2onnx names outputs like ``save_infer_model/scale_0.tmp_1``."""
    names = ["save_infer_model/scale_0.tmp_1", "save_infer_model/scale_1.tmp_1", "../up", ".hidden"]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 3]) for name in names]
    nodes = [helper.make_node("Relu" if i % 2 else "Sigmoid", ["x"], [name]) for i, name in enumerate(names)]
    model = helpers.save(helpers._model(helper.make_graph(nodes, "g", [x], outputs)), tmp_path / "slashes.onnx")
    assert run_cli(capsys, "-q", "compile", model, "--config", config_path(), "-o", tmp_path / "build")[0] == 0
    (artifact,) = (tmp_path / "build").iterdir()
    code, _, err = run_cli(capsys, "-q", "run", artifact, "--fill", "random", "--save", tmp_path / "saved")
    assert code == 0, err
    saved = tmp_path / "saved"
    mapping = json.loads((saved / "names.json").read_text())
    assert sorted(mapping.values()) == sorted(names)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+\.npy", file) and not file.startswith(".") for file in mapping)
    assert sorted(p.name for p in saved.iterdir()) == sorted([*mapping, "names.json", "outputs.npz"])
    archive = np.load(saved / "outputs.npz")
    for file, name in mapping.items():
        np.testing.assert_array_equal(np.load(saved / file), archive[name])


@pytest.mark.parametrize("case", ["shape", "dtype", "unknown", "missing_file", "not_npy", "no_equals"])
def test_run_bad_input(capsys, tmp_path, mlp_artifact, case):
    good = np.zeros((4, 16), np.float32)
    arrays = {"shape": ("x", np.zeros((2, 16), np.float32)), "dtype": ("x", good.astype(np.float64)),
              "unknown": ("z", good)}
    if case in arrays:
        name, value = arrays[case]
        np.save(tmp_path / "in.npy", value)
        argv = ["--input", f"{name}={tmp_path / 'in.npy'}"]
    elif case == "missing_file":
        argv = ["--input", f"x={tmp_path / 'absent.npy'}"]
    elif case == "not_npy":
        (tmp_path / "in.npy").write_text("1 2 3\n")
        argv = ["--input", f"x={tmp_path / 'in.npy'}"]
    elif case == "no_equals":
        argv = ["--input", "x.npy"]
    expected = {
        "shape": "input 'x' has shape [2, 16], the model was built for 4x16",
        "dtype": "input 'x' has dtype float64, expected float32",
        "unknown": "unknown ['z']",
        "missing_file": f"cannot read --input x={tmp_path / 'absent.npy'}",
        "not_npy": f"cannot read --input x={tmp_path / 'in.npy'}",
        "no_equals": "--input 'x.npy' is not NAME=FILE.npy",
    }[case]
    code, out, err = run_cli(capsys, "-q", "run", mlp_artifact, *argv, "--save", tmp_path / "saved")
    assert code == ArtifactError.exit_code == 6
    assert_one_error(err)
    assert expected in err
    assert out == "" and not (tmp_path / "saved").exists()


def test_run_unknown_input_hint_lists_model_inputs(capsys, tmp_path, mlp_artifact):
    np.save(tmp_path / "z.npy", np.zeros((4, 16), np.float32))
    code, _, err = run_cli(capsys, "-q", "run", mlp_artifact, "--input", f"z={tmp_path / 'z.npy'}",
                           "--fill", "zeros")
    assert code == 6
    assert "the model takes: x float32[4, 16]" in err


def test_run_not_an_artifact(capsys, tmp_path):
    code, _, err = run_cli(capsys, "-q", "run", tmp_path, "--fill", "zeros")
    assert code == 6
    assert_one_error(err)
    assert f"{tmp_path} is not a tvm_fusion artifact" in err


# --- inspect ---------------------------------------------------------------------------------

def test_inspect_prints_fired_patterns(capsys, mlp_path, config_path):
    code, out, err = run_cli(capsys, "-q", "inspect", mlp_path, "--config", config_path(), *MLP_SHAPE)
    assert code == 0, err
    assert "model: mlp" in out
    assert "ONNX nodes: 9 as exported" in out
    assert re.search(r"^gelu_erf\s+1$", out, re.M) and re.search(r"^gemm_epilogue\s+2$", out, re.M), out
    assert re.search(r"^erf\s+1\s+0$", out, re.M), out  # the decomposed GELU is gone after fusion


def test_inspect_json(capfd, mlp_path, config_path):
    code = cli.main(["-q", "inspect", str(mlp_path), "--config", str(config_path()), *MLP_SHAPE, "--json"])
    out, err = capfd.readouterr()  # fd-level: nothing else may write to stdout
    assert code == 0, err
    data = json.loads(out)
    assert data["model"] == "mlp"
    assert data["report"]["fired"]["gelu_erf"] == 1 and data["report"]["fired"]["gemm_epilogue"] == 2
    assert isinstance(data["report"]["near_misses"], list)
    assert data["onnx_ops"] == {"Add": 3, "MatMul": 2, "Mul": 2, "Div": 1, "Erf": 1}
    assert data["relax_ops"]["erf"] == 1 and "erf" not in data["fused_ops"]
    assert isinstance(data["kernels"], int) and isinstance(data["stock_kernels"], int)


def test_inspect_unsupported_op(capsys, unsupported_path, config_path):
    code, out, err = run_cli(capsys, "-q", "inspect", unsupported_path, "--config", config_path(), "--json")
    assert code == 3 and out == ""
    assert_one_error(err)
    assert "Celu (nodes: celu_first, celu_second)" in err


# --- bench -----------------------------------------------------------------------------------

def test_bench_json(capsys, tmp_path, mlp_path, config_path):
    out_json = tmp_path / "results" / "out.json"
    code, out, err = run_cli(capsys, "-q", "bench", mlp_path, "--config", config_path(), *MLP_SHAPE,
                             "--repeat", "3", "--warmup", "1", "--json", out_json)
    assert code == 0, err
    for runtime in ("onnxruntime", "tvm_fusion", "stock_tvm"):
        assert re.search(rf"^{runtime}(\s+\S+){{10}}$", out, re.M), out
    assert "3 interleaved rounds" in out and "(x:4x16)" in out
    data = json.loads(out_json.read_text())
    assert [p.name for p in out_json.parent.iterdir()] == ["out.json"]  # no staging file left
    assert data["rounds"] == 3 and data["model"] == "mlp" and data["inputs"] == {"x": [4, 16]}
    for name, samples in data["samples_ms"].items():  # every timed run, and statistics that agree
        stats = data["stats"][name]
        assert len(samples) == 3 and stats["count"] == 3
        assert stats["min_ms"] == min(samples) <= stats["median_ms"] <= stats["p90_ms"] <= stats["max_ms"] == max(samples)
        assert data["medians_ms"][name] == pytest.approx(stats["median_ms"])
        assert stats["per_s"] == pytest.approx(1e3 / (sum(samples) / 3))
    assert set(data["load_average"]) == {"before", "after"}
    medians, ratios = data["medians_ms"], data["ratio_to_onnxruntime"]
    assert set(medians) == set(ratios) == {"onnxruntime", "tvm_fusion", "stock_tvm"}
    assert all(value > 0 for value in medians.values())
    for name, ratio in ratios.items():
        assert ratio == pytest.approx(medians[name] / medians["onnxruntime"], rel=1e-12)
    assert ratios["onnxruntime"] == 1.0
    assert set(data["max_abs_error"]) == set(data["max_rel_error"]) == {"tvm_fusion", "stock_tvm"}
    assert all(0 <= e < 1e-4 for e in data["max_abs_error"].values())
    assert all(c == pytest.approx(1.0, abs=1e-9) for c in data["cosine_similarity"].values())
    assert data["peer_precision"] == {}  # no peer


def test_bench_peer_openvino(capsys, tmp_path, mlp_path, config_path):
    """OpenVINO runs in the same rounds, is checked against ONNX Runtime, and the JSON carries it
    beside the machine's probed peaks."""
    out_json = tmp_path / "out.json"
    code, out, err = run_cli(capsys, "-q", "bench", mlp_path, "--config", config_path(), *MLP_SHAPE,
                             "--repeat", "3", "--warmup", "1", "--no-stock", "--peer", "openvino",
                             "--json", out_json)
    assert code == 0, err
    for row in ("openvino", "openvino_default"):
        assert re.search(rf"^{row}(\s+\S+){{10}}$", out, re.M), out
    assert re.search(r"^this machine \(\S+\): \d+ GFLOP/s FMA peak, [\d.]+ GB/s triad", out, re.M), out
    data = json.loads(out_json.read_text())
    assert set(data["medians_ms"]) == set(data["ratio_to_onnxruntime"]) == {"onnxruntime", "tvm_fusion",
                                                                           "openvino", "openvino_default"}
    assert data["medians_ms"]["openvino"] > 0 and data["medians_ms"]["openvino_default"] > 0
    assert 0 <= data["max_abs_error"]["openvino"] < 1e-4
    # OpenVINO's own choice: bf16 where the CPU has it, f32 on AVX2-only hosts; said either way.
    chose = data["peer_precision"]
    assert chose["openvino"] == "f32" and chose["openvino_default"].split()[0] in ("bf16", "f16", "f32")
    assert re.search(rf"^inference precision: openvino f32 \(pinned\), openvino_default "
                     rf"{re.escape(chose['openvino_default'])} \(its default\)$", out, re.M), out
    for metric in ("max_abs_error", "max_rel_error", "cosine_similarity"):
        assert set(data[metric]) == {"tvm_fusion", "openvino", "openvino_default"}
        assert all(math.isfinite(v) for v in data[metric].values())
    peak = data["peak"]
    assert peak["threads"] == data["threads"] and peak["gflops"] > 0 and peak["gbytes_per_s"] > 0
    assert peak["ridge_flop_per_byte"] == pytest.approx(peak["gflops"] / peak["gbytes_per_s"])


def test_bench_peer_openvino_not_installed(capsys, monkeypatch, mlp_path, config_path):
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` raises ImportError
    code, out, err = run_cli(capsys, "-q", "bench", mlp_path, "--config", config_path(), *MLP_SHAPE,
                             "--peer", "openvino")
    assert code == 7 and out == ""
    assert_one_error(err)
    assert "openvino" in err and "pip install 'tvm_fusion[peers]'" in err


def test_bench_failure_keeps_previous_json(capsys, tmp_path, unsupported_path, config_path):
    out_json = tmp_path / "out.json"
    out_json.write_text('{"previous": true}\n')
    code, out, err = run_cli(capsys, "-q", "bench", unsupported_path, "--config", config_path(),
                             "--repeat", "3", "--json", out_json)
    assert code == 3
    assert_one_error(err)
    assert out_json.read_text() == '{"previous": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_console_script_compile_success(tmp_path, mlp_path, config_path):
    """A real process (fd-level stdout/stderr): report on stdout, our progress lines on stderr,
    each once and unmangled by the capture of TVM's native log."""
    import subprocess

    script = Path(sys.executable).with_name("tvm-fusion")
    proc = subprocess.run([str(script), "compile", str(mlp_path), "--config", str(config_path()),
                           "--input-shape", "x:4x16", "-o", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / f"mlp.{config_path().stem}" / "model.so").is_file()
    assert re.search(r"^gelu_erf\s+1$", proc.stdout, re.M) and "[" not in proc.stdout
    progress = [line for line in proc.stderr.splitlines() if re.match(r"^\[\s*\d+\.\ds\] ", line)]
    messages = [line.split("] ", 1)[1] for line in progress]
    for expected in ("simplifying shape subgraphs at x:4x16", "verifying against ONNX Runtime"):
        assert messages.count(expected) == 1, proc.stderr
    assert not any(m.startswith("tvm: [") for m in messages), proc.stderr  # our own lines, re-captured
    assert messages[-1].startswith("done in")


def test_latency_statistics_and_the_noise_warning():
    from tvm_fusion.runtime.latency import LatencyStats, noise_warning

    steady = LatencyStats.of([0.001] * 18 + [0.0011, 0.0012])
    assert (steady.min_ms, steady.median_ms, steady.max_ms) == pytest.approx((1.0, 1.0, 1.2))
    assert steady.count == 20 and not steady.noisy
    jumpy = LatencyStats.of([0.001] * 10 + [0.002] * 10)
    assert jumpy.p90_ms == pytest.approx(2.0) and jumpy.noisy
    assert noise_warning({"a": steady}, cores=2, load_before=0.5, load_after=0.7) is None
    said = noise_warning({"a": steady, "b": jumpy}, cores=2, load_before=0.5, load_after=3.5)
    assert "p90 over 1.2x the median for b" in said and "load average 3.5 on 2 cores" in said
    with pytest.raises(ValueError):
        LatencyStats.of([])


def test_long_kernel_names_are_cut_in_the_middle():
    from tvm_fusion.report import cut_middle

    names = [f"fused_relax_nn_conv2d_relax_add_relax_add_relax_nn_relu{i}" for i in (5, 6)]
    cut = [cut_middle(name, 48) for name in names]
    assert all(len(c) == 48 for c in cut) and cut[0] != cut[1]  # the differing ends survive
    assert cut[0].startswith("fused_relax_nn_conv2d") and cut[0].endswith("relax_nn_relu5") and "~" in cut[0]
    assert cut_middle("short", 48) == "short"

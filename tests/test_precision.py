"""``precision``: the config key and ``--precision``, the refusal where the target lacks the ISA,
and a bf16 build end to end, judged by the bf16 gate (tvm_fusion/accuracy/bf16_gate.py)."""

from __future__ import annotations

import dataclasses
import json

import helpers
import numpy as np
import pytest
import tvm

import tvm_fusion
from tvm_fusion import api, cli
from tvm_fusion.cli.parser import build_parser
from tvm_fusion.commands import compile as compile_command
from tvm_fusion.commands.bf16_kernels import Bf16KernelGate
from tvm_fusion.config import load_config, parse_config, with_precision
from tvm_fusion.errors import ConfigError, TvmFusionError
from tvm_fusion.kernels.cpu_features import has_bf16_kernels
from tvm_fusion.metadata import config_from_json
from tvm_fusion.tuning.store_contents import workload_id
from tvm_fusion.tuning.tasks import kernel_tasks

MLP_SHAPE = "x:4x16"  # the shared mlp model's input (conftest.py)
BF16_CPU = "sapphirerapids"  # has AMX-BF16
PLAIN_CPU = "znver3"  # AVX2 only
HOST_HAS_BF16 = has_bf16_kernels(tvm.target.Target.from_device(tvm.cpu()))


def config_for(mcpu: str, precision: str | None = None, kind: str = "llvm"):
    target = {"kind": kind, "mcpu": mcpu} if kind == "llvm" else {"kind": "cuda", "arch": "sm_80"}
    pipeline = {} if precision is None else {"precision": precision}
    return parse_config({"target": target, "pipeline": pipeline}, name=f"{mcpu}-test", path="test.toml")


def test_float32_is_the_default_and_builds_no_bf16_kernels():
    cfg = config_for(BF16_CPU)
    assert cfg.precision == "float32" and not cfg.bf16_kernels()
    assert load_config(None).precision == "float32"


def test_bf16_and_auto_on_a_cpu_with_amx_bf16():
    assert config_for(BF16_CPU, "bf16").bf16_kernels()
    assert config_for(BF16_CPU, "auto").bf16_kernels()


def test_auto_without_the_isa_is_float32():
    cfg = config_for(PLAIN_CPU, "auto")
    assert cfg.precision == "auto" and not cfg.bf16_kernels()


def test_bf16_on_a_cpu_without_bf16_dot_products_is_refused_naming_the_isas():
    with pytest.raises(ConfigError) as info:
        config_for(PLAIN_CPU, "bf16")
    error = info.value
    assert error.exit_code == 2
    assert error.message.startswith("test.toml: key 'pipeline.precision': precision bf16 needs AVX512_BF16")
    assert "(avx512bf16)" in error.message and "(amx-bf16)" in error.message and PLAIN_CPU in error.message
    assert "\n" not in error.message and "float32" in error.hint


def test_the_flag_is_checked_against_the_target_too():
    cfg = config_for(PLAIN_CPU)
    assert with_precision(cfg, None) is cfg and with_precision(cfg, "auto").precision == "auto"
    with pytest.raises(ConfigError, match=r"^--precision: precision bf16 needs AVX512_BF16"):
        with_precision(cfg, "bf16")
    with pytest.raises(ConfigError, match="'fp16' is not a precision"):
        with_precision(cfg, "fp16")


def test_bf16_on_a_gpu_target_is_refused():
    with pytest.raises(ConfigError, match="precision bf16 is for CPU targets"):
        config_for("", "bf16", kind="cuda")
    assert not config_for("", "auto", kind="cuda").bf16_kernels()


def test_the_cli_refuses_bf16_for_such_a_target_with_one_line(capsys, tmp_path, mlp_path):
    config = tmp_path / "avx2.toml"
    config.write_text(f'[target]\nkind = "llvm"\nmcpu = "{PLAIN_CPU}"\n')
    code = cli.main(["-q", "compile", str(mlp_path), "--config", str(config), "--input-shape", MLP_SHAPE,
                     "--precision", "bf16", "-o", str(tmp_path / "build")])
    err = capsys.readouterr().err
    assert code == ConfigError.exit_code
    assert err.splitlines()[0].startswith("tvm-fusion: error: --precision: precision bf16 needs AVX512_BF16")
    assert not (tmp_path / "build").exists() or not any((tmp_path / "build").iterdir())


@pytest.mark.parametrize("command", ["compile", "bench", "profile", "tune"])
def test_precision_flag_parses(command):
    parser = build_parser()
    assert parser.parse_args([command, "m.onnx"]).precision is None  # None: the config's
    assert parser.parse_args([command, "m.onnx", "--precision", "bf16"]).precision == "bf16"
    assert parser.parse_args([command, "m.onnx", "--precision", "auto"]).precision == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([command, "m.onnx", "--precision", "fp16"])


def test_the_saved_config_keeps_the_precision_and_the_declined_matmuls():
    cfg = dataclasses.replace(config_for(BF16_CPU, "bf16"), bf16_declined=("onnx2",))
    assert config_from_json(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg


@pytest.fixture(scope="module")
def bf16_and_float32(tmp_path_factory, mlp_path, config_factory):
    if not HOST_HAS_BF16:
        pytest.skip("the host CPU has neither AVX512_BF16 nor AMX-BF16: no bf16 kernel runs here")
    out = tmp_path_factory.mktemp("precision")
    return (api.compile_model(mlp_path, config_factory(), [MLP_SHAPE], out / "bf16", precision="bf16"),
            api.compile_model(mlp_path, config_factory(), [MLP_SHAPE], out / "float32"))


def test_a_bf16_build_reports_its_metrics_within_the_gate(bf16_and_float32):
    bf16, _ = bf16_and_float32
    meta = bf16.metadata
    assert meta["precision"] == "bf16" and meta["built_from"]["config"]["precision"] == "bf16"
    gate = meta["verification"]["bf16_gate"]
    assert gate == {"rtol": 2.0 ** -5, "atol": 2.0 ** -5, "min_cosine": 0.999, "min_top1": 1.0}
    (output,) = meta["verification"]["outputs"]
    assert output["passed"] and output["cosine"] >= gate["min_cosine"]
    # bf16 operands: an error above float32 rounding, within the gate's element rule
    assert 1e-6 < output["max_abs"] <= 2 * gate["atol"] * 4
    assert output["top1_agreement"] == 1.0 and output["top1_rows"] == 4  # y is a 2-D MatMul head: [4, 8]
    assert meta["bf16_kernels"] and set(meta["bf16_kernels"]) <= set(meta["schedule_rules"])


def test_the_float32_build_is_unaffected(bf16_and_float32):
    bf16, float32 = bf16_and_float32
    meta = float32.metadata
    assert meta["precision"] == "float32" and "bf16_gate" not in meta["verification"]
    assert "bf16_kernels" not in meta
    (output,) = meta["verification"]["outputs"]
    assert "cosine" not in output and output["max_abs"] < 1e-4
    assert float32.metadata["fusions"] == bf16.metadata["fusions"]


def test_the_bf16_artifact_runs_its_own_numbers(bf16_and_float32):
    bf16, float32 = bf16_and_float32
    x = np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32)
    ours, reference = tvm_fusion.load(bf16.artifact).run({"x": x})["y"], tvm_fusion.load(float32.artifact).run({"x": x})["y"]
    assert ours.dtype == np.float32 and 0 < np.abs(ours - reference).max() < 0.1


def exact_config(tmp_path):
    config = helpers.write_config(tmp_path / "exact.toml", "default")
    # A cosine of exactly 1: no bf16 build of this model, nor any matmul of it alone, reaches it.
    config.write_text(config.read_text().replace("seed = 0", "seed = 0\nbf16_min_cosine = 1.0"))
    return config


def test_auto_keeps_each_matmul_float32_that_fails_the_gate_alone(tmp_path, mlp_path):
    if not HOST_HAS_BF16:
        pytest.skip("the host CPU lacks AMX-BF16: auto builds float32 without trying bf16")
    result = api.compile_model(mlp_path, exact_config(tmp_path), [MLP_SHAPE], tmp_path / "build", precision="auto")
    meta = result.metadata
    assert meta["precision"] == "float32" and meta["built_from"]["config"]["precision"] == "auto"
    gate = meta["bf16_gate_per_kernel"]
    assert gate["judged"] == 2 and len(gate["declined"]) == 2 and not meta["bf16_kernels"]
    assert "precision_fallback" not in meta  # declined per kernel: no whole-model rebuild


def test_auto_builds_float32_where_bf16_fails_the_gate(tmp_path, mlp_path, monkeypatch):
    """The last resort: outputs that fail the gate though no matmul was declined alone (here the
    per-kernel gate is skipped, as for a matmul it cannot judge) and the emulation finds none to
    keep float32 (as where no ONNX product matches a kernel) rebuild the model in float32."""
    if not HOST_HAS_BF16:
        pytest.skip("the host CPU lacks AMX-BF16: auto builds float32 without trying bf16")
    monkeypatch.setattr(compile_command, "judge_bf16_kernels", lambda *_args: Bf16KernelGate())
    monkeypatch.setattr(compile_command, "emulated_declines", lambda *_args: [])
    result = api.compile_model(mlp_path, exact_config(tmp_path), [MLP_SHAPE], tmp_path / "build", precision="auto")
    meta = result.metadata
    assert meta["precision"] == "float32" and meta["built_from"]["config"]["precision"] == "float32"
    assert meta["precision_fallback"]["reason"].startswith("bf16 failed the accuracy gate (y: cosine ")
    # The float32 rebuild, staged at the same path, is what was run and verified.
    assert meta["verification"]["outputs"][0]["max_abs"] < 1e-4


def test_auto_keeps_float32_what_the_emulation_finds_the_outputs_need(tmp_path, mlp_path, monkeypatch):
    """Outputs that fail though no matmul failed alone: the emulation in ONNX Runtime keeps
    float32 those whose rounding moves them (here both, for a cosine of exactly 1), and the
    rebuild, with no bf16 kernel left, is the float32 build, not a whole-model fallback."""
    if not HOST_HAS_BF16:
        pytest.skip("the host CPU lacks AMX-BF16: auto builds float32 without trying bf16")
    monkeypatch.setattr(compile_command, "judge_bf16_kernels", lambda *_args: Bf16KernelGate())
    result = api.compile_model(mlp_path, exact_config(tmp_path), [MLP_SHAPE], tmp_path / "build", precision="auto")
    meta = result.metadata
    assert meta["precision"] == "float32" and meta["built_from"]["config"]["precision"] == "auto"
    gate = meta["bf16_gate_per_kernel"]
    assert [d["judged_by"] for d in gate["declined"]] == ["emulation", "emulation"] and not meta["bf16_kernels"]
    assert gate["emulation_margins"] == [0.5] and "precision_fallback" not in meta


def test_bf16_kernels_are_other_tuning_workloads_than_their_float32_twins(mlp_path):
    """Built for a named bf16 CPU, so it runs on any host: tuning records key on the kernel's
    structure, and a bf16 kernel's never equals its float32 twin's."""
    session = api.ModelSession(mlp_path, [MLP_SHAPE])
    bf16 = config_for(BF16_CPU, "bf16")
    target = bf16.tvm_target()
    ids = {cfg.precision: {workload_id(task.mod) for task in kernel_tasks(session.tuning_module(cfg), target)}
           for cfg in (bf16, dataclasses.replace(bf16, precision="float32"))}
    assert ids["bf16"] and ids["float32"] and not ids["bf16"] & ids["float32"]


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_an_artifact_is_timed_at_its_own_precision(command, mlp_artifact):
    run = api.bench_model if command == "bench" else api.profile_model
    with pytest.raises(TvmFusionError, match=r"--precision would .* other kernels"):
        run(mlp_artifact, precision="bf16")


def test_avx512_bf16_without_amx_builds_bf16_kernels():
    """Zen 4 has AVX512_BF16 but no AMX: its bf16 kernels are vdpbf16ps register tiles."""
    assert config_for("znver4", "bf16").bf16_kernels()
    assert config_for("znver4", "auto").bf16_kernels()

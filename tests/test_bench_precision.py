"""``bench --precision bf16``: tvm_fusion at float32 and at bf16 in the same interleaved rounds,
each with its error against ONNX Runtime float32, so that one run shows what bf16 gains and
what it costs; and the refusal where the target has no bf16 kernel."""

from __future__ import annotations

import json
import math
import re

import pytest
import tvm

from tvm_fusion import api, cli
from tvm_fusion.config import load_config
from tvm_fusion.errors import ConfigError
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.kernels.cpu_features import has_bf16_kernels
from tvm_fusion.verify import reference_outputs

MLP_SHAPE = "x:4x16"  # the shared mlp model's input (conftest.py)
HOST_HAS_BF16 = has_bf16_kernels(tvm.target.Target.from_device(tvm.cpu()))
needs_bf16 = pytest.mark.skipif(not HOST_HAS_BF16, reason="the host CPU has neither AVX512_BF16 nor AMX-BF16: no bf16 kernel runs here")


@pytest.fixture(scope="module")
def bf16_bench(tmp_path_factory, mlp_path, config_factory):
    """One CLI ``bench --precision bf16`` of the MLP: (its table, its JSON)."""
    if not HOST_HAS_BF16:
        pytest.skip("the host CPU has neither AVX512_BF16 nor AMX-BF16: no bf16 kernel runs here")
    out_json = tmp_path_factory.mktemp("bench_bf16") / "out.json"
    code = cli.main(["-q", "bench", str(mlp_path), "--config", str(config_factory()), "--input-shape", MLP_SHAPE,
                     "--precision", "bf16", "--repeat", "4", "--warmup", "1", "--no-stock", "--json", str(out_json)])
    assert code == 0
    return out_json.read_text(), json.loads(out_json.read_text())


@needs_bf16
def test_both_rows_are_timed_in_the_same_rounds(bf16_bench):
    _, data = bf16_bench
    assert set(data["medians_ms"]) == {"onnxruntime", "tvm_fusion", "tvm_fusion_bf16"}
    # every runner runs once a round: as many samples each as rounds
    assert {name: len(samples) for name, samples in data["samples_ms"].items()} == dict.fromkeys(data["medians_ms"], 4)
    assert all(value > 0 for value in data["medians_ms"].values())
    assert data["bf16_kernels"], "the bf16 row has bf16 kernels, named"


@needs_bf16
def test_each_row_has_its_error_against_onnxruntime_float32(bf16_bench, mlp_path, config_factory):
    """The float32 row stays at float32 rounding; the bf16 row errs above it, within the bf16
    gate's defaults (element bound at most (atol + rtol) x the output's peak, cosine)."""
    _, data = bf16_bench
    cfg = load_config(config_factory())
    prepared = api.prepare(mlp_path, cfg, [MLP_SHAPE])
    inputs = onnx_frontend.random_inputs(prepared.onnx_model, onnx_frontend.inputs_at(prepared.inputs, {}), cfg.seed)
    peak = max(float(abs(out).max()) for out in reference_outputs(prepared.onnx_model, inputs).values())
    tolerance = cfg.bf16_tolerance()
    for metric in ("max_abs_error", "max_rel_error", "cosine_similarity"):
        assert set(data[metric]) == {"tvm_fusion", "tvm_fusion_bf16"}
        assert all(math.isfinite(v) for v in data[metric].values())
    assert data["max_abs_error"]["tvm_fusion"] < 1e-4
    assert 1e-6 < data["max_abs_error"]["tvm_fusion_bf16"] <= (tolerance.atol + tolerance.rtol) * peak
    assert data["cosine_similarity"]["tvm_fusion_bf16"] >= tolerance.min_cosine


@needs_bf16
def test_the_table_names_the_bf16_row_and_its_kernels(capsys, mlp_path, config_factory):
    code = cli.main(["-q", "bench", str(mlp_path), "--config", str(config_factory()), "--input-shape", MLP_SHAPE,
                     "--precision", "bf16", "--repeat", "2", "--warmup", "1", "--no-stock"])
    out = capsys.readouterr().out
    assert code == 0
    for row in ("tvm_fusion", "tvm_fusion_bf16"):
        assert re.search(rf"^{row}(\s+\S+){{10}}$", out, re.M), out
    assert re.search(r"^tvm_fusion_bf16: [1-9]\d* kernels sum bf16 products", out, re.M), out


def test_float32_benches_one_row_of_ours(mlp_path, config_factory):
    report = api.bench_model(mlp_path, config_factory(), MLP_SHAPE, repeat=1, warmup=0, include_stock=False)
    assert set(report.medians_ms) == {"onnxruntime", "tvm_fusion"} and report.bf16_kernels == []


def test_bf16_for_a_target_without_amx_is_refused(capsys, tmp_path, mlp_path):
    """Runs on any host: the target, not the host, decides (docs/precision.md)."""
    config = tmp_path / "avx2.toml"
    config.write_text('[target]\nkind = "llvm"\nmcpu = "znver3"\n')
    code = cli.main(["-q", "bench", str(mlp_path), "--config", str(config), "--input-shape", MLP_SHAPE,
                     "--precision", "bf16", "--repeat", "1"])
    out, err = capsys.readouterr()
    assert code == ConfigError.exit_code == 2 and out == ""
    assert err.splitlines()[0].startswith("tvm-fusion: error: --precision: precision bf16 needs AVX512_BF16")

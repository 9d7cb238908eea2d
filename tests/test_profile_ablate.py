"""profile --mine and ablate on small graphs whose answers are known (structure, never timings), and
profile of an artifact: its own kernels, or a clear refusal when they cannot be rebuilt."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion import api, cli
from tvm_fusion.config import load_config
from tvm_fusion.errors import ArtifactError, ModelError, ShapeError, TvmFusionError
from tvm_fusion.commands.profile.build import build_profiled
from tvm_fusion.session import ModelSession
from tvm_fusion.commands.profile.mining import KernelCall, kernel_graph, mine_chains
from tvm_fusion.commands.profile.report import KernelProfile

import helpers
from helpers import mlp_model, read_metadata, save


def _kernel(name: str, kind: str, us: float) -> KernelProfile:
    return KernelProfile(name, "single op", "-", kind, 1, us, us, 0.0, 0, 0, 0.0, 0.0, 0.0, "memory", 0.0, [])


def test_mining_follows_single_consumer_edges_and_counts_the_saved_bytes():
    # conv -> injective -> reduction (a model output); the injective's output also feeds "other",
    # so only conv -> injective can keep its intermediate out of DRAM.
    calls = [KernelCall("conv", 1000, []), KernelCall("inj", 400, [0]), KernelCall("red", 8, [1], model_output=True),
             KernelCall("other", 8, [1], model_output=True)]
    kernels = {k.name: k for k in (_kernel("conv", "conv", 50.0), _kernel("inj", "injective", 10.0),
                                   _kernel("red", "reduction", 5.0), _kernel("other", "injective", 1.0))}
    chains = mine_chains(calls, kernels, gbytes_per_s=10.0, per_launch_us=2.0)
    (chain,) = chains
    assert chain.label == "conv -> injective"
    assert chain.saved_bytes == 2 * 1000
    assert chain.us == 60.0
    assert chain.gain_us == 2 * 1000 / 10e3 + 2.0  # bytes at 10 GB/s, plus one launch


def test_mining_ranks_by_gain_and_extends_to_three_kernels():
    calls = [KernelCall("a", 100, []), KernelCall("b", 10_000, [0]), KernelCall("c", 8, [1], model_output=True)]
    kernels = {n: _kernel(n, k, 100.0) for n, k in (("a", "matmul"), ("b", "injective"), ("c", "reduction"))}
    chains = mine_chains(calls, kernels, gbytes_per_s=1.0, per_launch_us=0.0)
    assert [c.label for c in chains] == ["matmul -> injective -> reduction", "injective -> reduction",
                                         "matmul -> injective"]
    assert [c.saved_bytes for c in chains] == [20_200, 20_000, 200]


def test_kernel_graph_of_an_unfused_matmul_then_reduction(tmp_path):
    """MatMul -> ReduceSum: no pattern takes it and TVM does not fuse a reduction after a
    matmul: one chain, the [4, 32] float32 product written and read back."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
         helper.make_node("ReduceSum", ["m", "axes"], ["y"], name="sum", keepdims=1)],
        "mm_sum", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 1])],
        [numpy_helper.from_array(np.ones((16, 32), np.float32), "w"),
         numpy_helper.from_array(np.array([-1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "mm_sum.onnx"
    onnx.save(model, path)
    prepared = api.prepare(path)
    profiled = build_profiled(ModelSession.of(prepared), prepared.config, tuning_log=False)
    calls = kernel_graph(profiled.lowered)
    assert [c.inputs for c in calls] == [[], [0]] and calls[1].model_output
    assert calls[0].output_bytes == 4 * 32 * 4
    assert profiled.covers[calls[0].kernel] == ["mm"] and profiled.covers[calls[1].kernel] == ["sum"]
    kernels = {c.kernel: _kernel(c.kernel, kind, 1.0) for c, kind in zip(calls, ("matmul", "reduction"))}
    (chain,) = mine_chains(calls, kernels, 10.0, 0.0)
    assert chain.saved_bytes == 2 * 4 * 32 * 4


def test_ablation_builds_each_fired_pattern_off_in_turn(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), path)
    config = dataclasses.replace(load_config(None), patterns=("gelu_erf", "silu", "gemm_epilogue"))
    result = api.ablate_model(path, config, ["x:4x16"], rounds=2, warmup=0)
    names = [v.name for v in result.variants]
    assert names == ["all patterns", "without gelu_erf", "without gemm_epilogue", "no patterns"]
    assert result.not_fired == ["silu"]
    kernels = {v.name: v.kernels for v in result.variants}
    # Two fused linears (the first with its GELU); without the GELU rewrite the decomposed GELU
    # stays outside; without gemm_epilogue, TVM's FuseOps groups matmul with its epilogue itself.
    assert kernels["all patterns"] == 2
    assert kernels["without gelu_erf"] > kernels["all patterns"]
    assert all(v.median_ms > 0 for v in result.variants)
    assert result.lines()[0].startswith("gelu_erf: ") and result.lines()[0].endswith("% of the latency on this model")
    assert set(result.to_json()) == {"model", "threads", "rounds", "not_fired", "variants", "summary"}


# profile ARTIFACT: the kernels an artifact runs, rebuilt from what its metadata names ----------

RESNET = Path(__file__).resolve().parents[1] / "examples" / "models" / "resnet_tiny.onnx"


@pytest.fixture(scope="module")
def resnet_artifact(tmp_path_factory, config_factory) -> Path:
    folder = tmp_path_factory.mktemp("resnet")
    model = folder / "resnet_tiny.onnx"
    shutil.copyfile(RESNET, model)
    return api.compile_model(model, config_factory(), ["input:1x3x32x32"], output_dir=folder).artifact


def test_profile_of_an_artifact_times_its_own_library(resnet_artifact, tmp_path, capsys):
    report = tmp_path / "profile.json"
    code = cli.main(["-q", "profile", str(resnet_artifact), "--rounds", "2", "--top", "3", "--json", str(report)])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith(f"artifact: {resnet_artifact}") and "model: resnet_tiny" in out and "gap: end to end" in out
    result = json.loads(report.read_text())
    assert result["artifact"] == str(resnet_artifact) and result["model"] == "resnet_tiny"
    metadata = read_metadata(resnet_artifact)
    library = tvm.runtime.load_module(str(resnet_artifact / "model.so"))
    assert all(library.implements_function(k["name"], True) for k in result["kernels"])
    assert {k["pattern"] for k in result["kernels"]} >= {"conv_epilogue.conv_bias_relu", "gemm_epilogue.matmul_bias"}
    assert len(result["kernels"]) <= metadata["kernels"] and result["gap"]["end_to_end_ms"] > 0
    stats = result["end_to_end"]  # the same statistics bench and run print, on the same runs
    assert stats["median_ms"] == pytest.approx(result["gap"]["end_to_end_ms"])
    assert stats["count"] >= 2 and stats["min_ms"] <= stats["median_ms"] <= stats["max_ms"]
    assert re.search(r"^end to end: min \S+ / median \S+ / p90 .* calls/s$", out, re.M), out


def edited_artifact(copy_artifact, edit) -> Path:
    """A copy of the compiled MLP with ``edit(metadata)`` applied to its metadata.json."""
    artifact = copy_artifact()
    metadata = read_metadata(artifact)
    edit(metadata)
    (artifact / "metadata.json").write_text(json.dumps(metadata))
    return artifact


def test_profile_of_an_artifact_whose_model_file_is_gone(copy_artifact, tmp_path, capsys):
    gone = tmp_path / "moved" / "mlp.onnx"
    artifact = edited_artifact(copy_artifact, lambda m: m["built_from"].update(model_path=str(gone)))
    assert cli.main(["-q", "profile", str(artifact)]) == ModelError.exit_code
    err = capsys.readouterr().err
    assert f"the model file {gone}, which the artifact {artifact} was built from, is missing" in err
    assert f"put the model back at {gone}" in err and "tvm-fusion compile" in err


def test_profile_of_an_artifact_whose_model_file_changed(copy_artifact, tmp_path, capsys):
    changed = save(mlp_model(seed=1), tmp_path / "mlp.onnx")  # other weights under the same name
    artifact = edited_artifact(copy_artifact, lambda m: m["built_from"].update(model_path=str(changed)))
    assert cli.main(["-q", "profile", str(artifact)]) == ModelError.exit_code
    err = capsys.readouterr().err
    assert f"the model file {changed} has changed since the artifact {artifact} was built from it" in err
    assert "restore the model" in err


def test_profile_refuses_an_artifact_built_for_a_range_naming_the_typical_size(copy_artifact):
    def make_ranged(metadata):
        metadata["inputs"][0]["shape"] = ["batch", 16]
        metadata["dims"] = {"batch": {"name": "batch", "min": 1, "max": 64, "step": 1}}

    artifact = edited_artifact(copy_artifact, make_ranged)
    with pytest.raises(ShapeError) as info:
        api.profile_model(artifact)
    assert "profile runs the model at one size" in info.value.message and "batch 1..64" in info.value.message
    assert "typical size batch=8" in info.value.hint


def test_profile_of_an_artifact_takes_no_config_shapes_or_tuning_log(mlp_artifact, config_path):
    with pytest.raises(TvmFusionError, match="drop --config, --input-shape"):
        api.profile_model(mlp_artifact, config_path(), ["x:4x16"])
    with pytest.raises(TvmFusionError, match="drop --tuning-log/--no-tuning-log"):
        api.profile_model(mlp_artifact, tuning_log=False)


def test_profile_of_an_artifact_that_does_not_name_its_model(copy_artifact):
    artifact = edited_artifact(copy_artifact, lambda m: m.pop("built_from"))
    with pytest.raises(ArtifactError, match="does not say which model file and config"):
        api.profile_model(artifact)


def test_profile_of_an_artifact_whose_kernels_cannot_be_rebuilt(copy_artifact):
    """The rebuilt module makes other kernel calls than the artifact (here: its metadata says so)."""
    artifact = edited_artifact(copy_artifact, lambda m: m.update(kernels=m["kernels"] + 1))
    with pytest.raises(ArtifactError, match="gives other kernels"):
        api.profile_model(artifact, rounds=1)


def test_the_config_an_artifact_records_loads_back_equal(config_path):
    from tvm_fusion.metadata import config_from_json

    config = dataclasses.replace(load_config(config_path()), dim_defaults={"batch": 1, "sequence": (1, 512, 1)})
    assert config_from_json(json.loads(json.dumps(dataclasses.asdict(config)))) == config


# bench ARTIFACT: the artifact's own library beside the model it was built from ------------------

def test_bench_of_an_artifact_times_its_own_library(mlp_artifact):
    said = []
    report = api.bench_model(mlp_artifact, repeat=3, warmup=1, progress=said.append)
    assert set(report.samples_ms) == {"onnxruntime", "tvm_fusion", "stock_tvm"}
    assert report.max_abs_error["tvm_fusion"] < 1e-4
    assert f"benchmarking {mlp_artifact}, built from" in said[0]
    assert "building tvm_fusion" not in said  # nothing was rebuilt: the artifact's library is timed


def test_bench_of_an_artifact_built_for_a_range_runs_its_typical_size(mlp_path, config_path, tmp_path):
    artifact = api.compile_model(mlp_path, config_path(), ["x:1..8x16"], output_dir=tmp_path).artifact
    report = api.bench_model(artifact, repeat=2, warmup=0, include_stock=False, sizes={"batch": 3})
    assert report.inputs == {"x": [3, 16]} and report.max_abs_error["tvm_fusion"] < 1e-4


def test_bench_of_an_artifact_takes_no_config_shapes_or_tuning_log(mlp_artifact, config_path):
    with pytest.raises(TvmFusionError, match="bench uses those; --config, --input-shape would bench"):
        api.bench_model(mlp_artifact, config_path(), ["x:4x16"])


@pytest.fixture(scope="module")
def one_thread_artifact(tmp_path_factory) -> Path:
    """resnet_tiny built to run on one thread: a pool of two threads waiting on each other is
    slowed a hundredfold while another test keeps a core busy, and the comparison below is
    about which library each command times, not about the machine's load."""
    folder = tmp_path_factory.mktemp("resnet_one_thread")
    model = folder / "resnet_tiny.onnx"
    shutil.copyfile(RESNET, model)
    config = helpers.write_config(folder / "one_thread.toml", "default", extra="[runtime]\nthreads = 1\n")
    return api.compile_model(model, config, ["input:1x3x32x32"], output_dir=folder).artifact


def test_run_bench_and_profile_of_one_artifact_agree(one_thread_artifact, capsys):
    """The three commands time the same library, so their fastest runs agree within 2x: the
    minimum is what a wrong build or thread count moves, and what another test's load on the
    machine moves least (their medians are only held within 3x, for that load)."""
    artifact = one_thread_artifact
    assert cli.main(["-q", "run", str(artifact), "--repeat", "40"]) == 0
    run_line = re.search(r"latency: min ([\d.]+) / median ([\d.]+)", capsys.readouterr().out)
    bench = api.bench_model(artifact, repeat=40, include_stock=False).stats["tvm_fusion"]
    profile = api.profile_model(artifact, rounds=40).end_to_end
    fastest = {"run": float(run_line.group(1)), "bench": bench.min_ms, "profile": profile.min_ms}
    medians = {"run": float(run_line.group(2)), "bench": bench.median_ms, "profile": profile.median_ms}
    assert max(fastest.values()) <= 2.0 * min(fastest.values()), fastest
    assert max(medians.values()) <= 3.0 * min(medians.values()), medians

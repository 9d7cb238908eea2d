"""One artifact for a range of sizes: compile, metadata, runs at several sizes, refusals.

Every compile here is verified against ONNX Runtime at the range's low end, typical size and
high end (rtol/atol from the test config); the runs below add sizes in between.
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

import helpers
from tvm_fusion import api, load
from tvm_fusion.errors import ArtifactError, ModelError
from tvm_fusion.frontend.dims import DimRange

BERT = helpers.EXAMPLES / "bert_tiny.onnx"
GPT2 = helpers.EXAMPLES / "gpt2_tiny.onnx"
RESNET = helpers.EXAMPLES / "resnet_tiny.onnx"
DBNET = helpers.EXAMPLES / "dbnet_tiny.onnx"


def onnxruntime_outputs(path, feeds):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.fixture(scope="module")
def bert_dynamic(tmp_path_factory, config_factory):
    """bert_tiny for every sequence length in 1..128, with a shape bucket (static kernels) at 37."""
    out = tmp_path_factory.mktemp("dynamic")
    result = api.compile_model(BERT, config_factory(), ["input_ids:1x1..128"], out, buckets=["sequence=37"])
    return result


def test_a_range_compiles_once_and_is_verified_at_both_ends_between_and_at_its_bucket(bert_dynamic):
    verification = bert_dynamic.metadata["verification"]
    assert verification["sizes"] == [{"sequence": 1}, {"sequence": 11}, {"sequence": 128}, {"sequence": 37}]
    assert all(output["within_tolerance"] for output in verification["outputs"])
    assert [o["name"] for o in verification["outputs"]] == [
        "last_hidden_state @ sequence=1", "last_hidden_state @ sequence=11", "last_hidden_state @ sequence=128",
        "last_hidden_state @ sequence=37"]


def test_a_bucket_is_a_static_build_main_dispatches_to_on_its_exact_size(bert_dynamic):
    """The bucket's kernels are static (no symbolic var in their signatures) and fewer or as
    many as the dynamic module's; the library holds both mains behind ``main``."""
    import tvm
    from tvm import relax

    (bucket,) = bert_dynamic.metadata["buckets"]
    assert bucket["sizes"] == {"sequence": 37}
    assert 0 < bucket["kernels"] <= bert_dynamic.metadata["kernels"]
    assert bucket["fusion_gate"]["checked"] > 0
    rules = bert_dynamic.metadata["schedule_rules"]
    assert any(name.endswith("_at_sequence37") for name in rules)
    assert any(not name.endswith("_at_sequence37") for name in rules)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(bert_dynamic.artifact / "model.so")), tvm.cpu())
    for name in ("main", "main_dynamic", "main_at_sequence37"):
        assert vm.module.implements_function(name), name


def test_metadata_records_the_ranges_and_symbolic_shapes(bert_dynamic):
    metadata = json.loads((bert_dynamic.artifact / "metadata.json").read_text())
    assert metadata["dims"] == {"sequence": {"name": "sequence", "min": 1, "max": 128, "step": 1}}
    assert [i["shape"] for i in metadata["inputs"]] == [[1, "sequence"], [1, "sequence"]]
    assert metadata["outputs"][0]["shape"] == [1, "sequence", 256]


def test_the_fusions_of_the_static_model_fire_on_the_symbolic_one(bert_dynamic):
    fired = bert_dynamic.metadata["fusions"]
    for pattern in ("attention", "gelu_erf", "gemm_epilogue", "skip_layernorm"):
        assert fired.get(pattern, 0) >= 2, (pattern, fired)


@pytest.mark.parametrize("sequence", [2, 37, 100])
def test_the_artifact_runs_at_sizes_inside_the_range(bert_dynamic, sequence):
    rng = np.random.default_rng(sequence)
    feeds = {"input_ids": rng.integers(0, 512, (1, sequence)).astype(np.int64),
             "attention_mask": np.ones((1, sequence), np.int64)}
    feeds["attention_mask"][0, sequence // 2:] = 0
    got = load(bert_dynamic.artifact).run(feeds)["last_hidden_state"]
    (want,) = onnxruntime_outputs(BERT, feeds)
    assert got.shape == (1, sequence, 256)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


def test_a_plain_tvm_runtime_runs_the_library_at_any_size_in_the_range(bert_dynamic):
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(tvm.runtime.load_module(str(bert_dynamic.artifact / "model.so")), tvm.cpu())
    for sequence in (3, 37, 64):  # 37: the bucket
        ids = np.arange(sequence, dtype=np.int64).reshape(1, sequence)
        mask = np.ones((1, sequence), np.int64)
        got = vm["main"](tvm.runtime.tensor(ids), tvm.runtime.tensor(mask)).numpy()
        want = onnxruntime_outputs(BERT, {"input_ids": ids, "attention_mask": mask})[0]
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


def test_a_size_outside_the_range_names_input_dim_and_range(bert_dynamic):
    model = load(bert_dynamic.artifact)
    with pytest.raises(ArtifactError) as info:
        model.run({"input_ids": np.zeros((1, 129), np.int64), "attention_mask": np.ones((1, 129), np.int64)})
    assert "'input_ids' dim 1 ('sequence') is 129, outside the range 1..128" in info.value.message


def test_inputs_sharing_a_dim_must_agree_on_its_size(bert_dynamic):
    with pytest.raises(ArtifactError) as info:
        load(bert_dynamic.artifact).run({"input_ids": np.zeros((1, 8), np.int64),
                                         "attention_mask": np.ones((1, 9), np.int64)})
    assert "'attention_mask' dim 1 ('sequence') is 9, but input 'input_ids' has 'sequence' = 8" in info.value.message


def test_cli_run_fills_inputs_at_a_given_size_and_refuses_one_outside(bert_dynamic, capsys):
    from tvm_fusion.cli import main

    assert main(["run", str(bert_dynamic.artifact), "--fill", "zeros", "--dim", "sequence=5"]) == 0
    assert "last_hidden_state: shape [1, 5, 256]" in capsys.readouterr().out
    assert main(["run", str(bert_dynamic.artifact), "--fill", "zeros", "--dim", "sequence=500"]) != 0
    assert "outside the range 1..128" in capsys.readouterr().err
    assert main(["run", str(bert_dynamic.artifact), "--fill", "zeros"]) != 0
    assert "pass --dim sequence=SIZE" in capsys.readouterr().err


def test_gpt2_with_a_causal_mask_built_from_the_sequence_length_compiles_for_a_range(tmp_path, config_path):
    """GPT-2 computes position ids with Range(0, sequence) and its mask with Expand: both must
    stay symbolic (TVM's converters lose the shape)."""
    result = api.compile_model(GPT2, config_path(), ["input_ids:1x1..128"], tmp_path, fusion_gate=False)
    assert result.metadata["verification"]["sizes"] == [{"sequence": 1}, {"sequence": 11}, {"sequence": 128}]
    feeds = {"input_ids": np.arange(60, dtype=np.int64).reshape(1, 60)}
    got = load(result.artifact).run(feeds)["last_hidden_state"]
    np.testing.assert_allclose(got, onnxruntime_outputs(GPT2, feeds)[0], rtol=1e-3, atol=1e-4)


def test_a_cnn_compiles_for_a_range_of_image_sizes(tmp_path, config_path):
    result = api.compile_model(RESNET, config_path(), ["input:1x3x16..96x16..96"], tmp_path, fusion_gate=False,
                               buckets=["height=32,width=48"])
    assert result.metadata["dims"] == {"height": {"name": "height", "min": 16, "max": 96, "step": 1},
                                       "width": {"name": "width", "min": 16, "max": 96, "step": 1}}
    assert result.metadata["verification"]["sizes"][-1] == {"height": 32, "width": 48}
    # the bucket, one dim of it only (the dynamic kernels), and neither
    for height, width in ((32, 48), (32, 70), (33, 70)):
        x = np.random.default_rng(0).standard_normal((1, 3, height, width)).astype(np.float32)
        got = load(result.artifact).run({"input": x})
        np.testing.assert_allclose(list(got.values())[0], onnxruntime_outputs(RESNET, {"input": x})[0],
                                   rtol=1e-3, atol=1e-4)


def test_the_prepared_module_records_the_range_bounds(config_path):
    prepared = api.prepare(BERT, config_path(), ["input_ids:1x4..64"])
    assert prepared.inputs[0].shape == (1, DimRange("sequence", 4, 64))
    attrs = prepared.relax_module["main"].attrs
    assert dict(attrs["tir_var_lower_bound"]) == {"sequence": 4}
    assert dict(attrs["tir_var_upper_bound"]) == {"sequence": 64}


def test_commands_that_time_kernels_refuse_a_range_with_the_typical_size(config_path):
    with pytest.raises(Exception) as info:
        api.profile_model(BERT, config_path(), ["input_ids:1x1..128"])
    assert "profile runs the model at one size" in str(info.value) and "sequence=11" in str(info.value)


def test_a_plain_range_a_detector_cannot_take_says_to_give_it_a_step(tmp_path, config_path):
    """dbnet's FPN adds a 2x-upsampled map to one of half the stride: equal only when the image
    side is a multiple of 32, which a plain range cannot say."""
    with pytest.raises(ModelError) as info:
        api.compile_model(DBNET, config_path(), ["input:1x3x32..320x32..320"], tmp_path)
    assert "symbolic height, width" in info.value.message
    assert "32..640/32" in info.value.hint


def test_a_stepped_range_compiles_a_detector_for_every_multiple_of_its_stride(tmp_path, config_path):
    """With a bucket: the dispatching main sits in front of the one taking step counts."""
    result = api.compile_model(DBNET, config_path(), ["input:1x3x32..320/32x32..320/32"], tmp_path,
                               fusion_gate=False, buckets=["height=64,width=96"])
    assert result.metadata["dims"]["height"] == {"name": "height", "min": 32, "max": 320, "step": 32}
    assert [i["shape"] for i in result.metadata["inputs"]] == [[1, 3, "height", "width"]]
    assert result.metadata["verification"]["sizes"][-1] == {"height": 64, "width": 96}
    model = load(result.artifact)
    for height, width in ((64, 160), (64, 96)):  # the dynamic kernels; the bucket
        x = np.random.default_rng(0).standard_normal((1, 3, height, width)).astype(np.float32)
        got = list(model.run({"input": x}).values())[0]
        np.testing.assert_allclose(got, onnxruntime_outputs(DBNET, {"input": x})[0], rtol=1e-3, atol=1e-4)
    with pytest.raises(ArtifactError) as info:
        model.run({"input": np.zeros((1, 3, 64, 100), np.float32)})
    assert "'input' dim 3 ('width') is 100, not a multiple of 32 in 32..320/32" in info.value.message

"""Loading artifacts back: in a fresh process, integrity checks, and plain-TVM compatibility."""

from __future__ import annotations

import json

import numpy as np
import pytest

import helpers
import tvm_fusion
from tvm_fusion.errors import ArtifactError
from tvm_fusion.runtime import LIBRARY_NAME, METADATA_NAME

FRESH_LOAD = """
import sys
import numpy as np
import tvm_fusion
model = tvm_fusion.load(sys.argv[1])
outputs = model.run({"x": np.load(sys.argv[2])})
np.savez(sys.argv[3], **outputs)
"""

PLAIN_TVM = """
import json, sys
import numpy as np
import tvm
from tvm import relax
folder = sys.argv[1]
meta = json.load(open(folder + "/metadata.json"))
vm = relax.VirtualMachine(tvm.runtime.load_module(folder + "/" + meta["library"]), tvm.cpu())
arrays = np.load(sys.argv[2])
result = vm["main"](*[tvm.runtime.tensor(arrays[spec["name"]], tvm.cpu()) for spec in meta["inputs"]])
values = [result] if hasattr(result, "numpy") else list(result)
np.savez(sys.argv[3], **{spec["name"]: v.numpy() for spec, v in zip(meta["outputs"], values)})
assert not any(name.startswith("tvm_fusion") for name in sys.modules), "tvm_fusion was imported"
"""


def artifact_error(folder) -> ArtifactError:
    with pytest.raises(ArtifactError) as info:
        tvm_fusion.load(folder)
    assert info.value.exit_code == 6
    return info.value


@pytest.fixture
def x_input():
    return np.random.default_rng(11).standard_normal((4, 16)).astype(np.float32)


def test_load_in_fresh_process_matches_onnxruntime(tmp_path, mlp_artifact, mlp_path, x_input):
    np.save(tmp_path / "x.npy", x_input)
    proc = helpers.run_python(FRESH_LOAD, str(mlp_artifact), str(tmp_path / "x.npy"), str(tmp_path / "out.npz"),
                              cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "out.npz")
    assert list(got.keys()) == ["y"]
    np.testing.assert_allclose(got["y"], helpers.ort_outputs(mlp_path, {"x": x_input})["y"],
                               rtol=1e-4, atol=1e-5)


def test_artifact_is_plain_tvm(tmp_path, mlp_artifact, mlp_path, x_input):
    np.savez(tmp_path / "in.npz", x=x_input)
    proc = helpers.run_python(PLAIN_TVM, str(mlp_artifact), str(tmp_path / "in.npz"), str(tmp_path / "out.npz"),
                              cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["y"],
                               helpers.ort_outputs(mlp_path, {"x": x_input})["y"], rtol=1e-4, atol=1e-5)


def test_run_takes_a_dict_a_list_in_input_order_or_one_array(mlp_artifact, x_input):
    model = tvm_fusion.load(mlp_artifact)
    by_name = model.run({"x": x_input})["y"]
    np.testing.assert_array_equal(model.run([x_input])["y"], by_name)
    np.testing.assert_array_equal(model.run((x_input,))["y"], by_name)
    np.testing.assert_array_equal(model.run(x_input)["y"], by_name)
    for wrong, said in (([x_input, x_input], "got 2 array(s)"), ("x", "got str")):
        with pytest.raises(ArtifactError) as info:
            model.run(wrong)
        assert said in info.value.message and "the model takes 1: x" in info.value.message


def test_inputs_off_alignment_strided_or_changed_after_prepare_run_as_a_copy(mlp_artifact, x_input):
    """The kernels take 64-byte aligned buffers (an input off it crashed the call when handed
    over as it was): each input is copied into a buffer of the call's own, aligned, which a
    sliced, transposed or later-changed array of the caller does not reach."""
    model = tvm_fusion.load(mlp_artifact)
    expected = model.run({"x": x_input})["y"]
    backing = np.zeros(x_input.size + 1, np.float32)
    off_alignment = backing[1:].reshape(x_input.shape)
    off_alignment[:] = x_input
    assert off_alignment.ctypes.data % 64 != 0
    np.testing.assert_array_equal(model.run({"x": off_alignment})["y"], expected)
    np.testing.assert_array_equal(model.run({"x": np.asfortranarray(x_input)})["y"], expected)
    mine = x_input.copy()
    (tensor,) = model.prepare({"x": mine})
    mine[:] = 0
    np.testing.assert_array_equal(tensor.numpy(), x_input)
    assert np.from_dlpack(tensor).ctypes.data % 64 == 0
    np.testing.assert_array_equal(model.run_prepared([tensor]).numpy(), expected)


def test_load_in_process_checks_inputs(mlp_artifact, x_input):
    model = tvm_fusion.load(mlp_artifact)
    assert model.inputs == [{"name": "x", "shape": [4, 16], "dtype": "float32"}]
    assert list(model.run({"x": x_input})) == ["y"]
    with pytest.raises(ArtifactError, match=r"input 'x' has shape \[4, 15\]"):
        model.run({"x": x_input[:, :15]})
    with pytest.raises(ArtifactError, match="missing \\['x'\\]"):
        model.run({})


def test_tampered_library(copy_artifact):
    folder = copy_artifact()
    with open(folder / LIBRARY_NAME, "ab") as stream:
        stream.write(b"\0")
    err = artifact_error(folder)
    assert str(folder / LIBRARY_NAME) in err.message and "sha256" in err.message
    assert "modified or damaged" in err.message and "rebuild" in err.hint


def test_missing_metadata(copy_artifact):
    folder = copy_artifact()
    (folder / METADATA_NAME).unlink()
    err = artifact_error(folder)
    assert f"{folder} is not a tvm_fusion artifact" in err.message and METADATA_NAME in err.message


def test_missing_library(copy_artifact):
    folder = copy_artifact()
    (folder / LIBRARY_NAME).unlink()
    err = artifact_error(folder)
    assert str(folder / LIBRARY_NAME) in err.message and "is missing" in err.message


@pytest.mark.parametrize("damage", ["truncated", "not_an_object", "no_sha", "no_inputs", "bad_inputs",
                                    "bad_outputs", "bad_target", "unknown_dim_name", "inverted_dim_range",
                                    "pinned_to_text"])
def test_damaged_metadata(copy_artifact, damage):
    folder = copy_artifact()
    path = folder / METADATA_NAME
    text = path.read_text()
    meta = json.loads(text)
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    else:
        if damage == "not_an_object":
            meta = [meta]
        elif damage == "no_sha":
            del meta["library_sha256"]
        elif damage == "no_inputs":
            del meta["inputs"]
        elif damage == "bad_inputs":
            meta["inputs"] = [{"name": "x", "shape": [4, 16]}]  # no dtype
        elif damage == "bad_outputs":
            meta["outputs"] = "y"
        elif damage == "unknown_dim_name":  # a symbolic dim with no range in "dims"
            meta["inputs"][0]["shape"] = ["batch", 16]
        elif damage == "inverted_dim_range":
            meta["inputs"][0]["shape"] = ["batch", 16]
            meta["dims"] = {"batch": {"name": "batch", "min": 8, "max": 2, "step": 1}}
        elif damage == "pinned_to_text":  # --input-value's value must be a number
            meta["inputs"][0]["value"] = "16000"
        else:
            meta["target"] = "llvm"
        path.write_text(json.dumps(meta))
    err = artifact_error(folder)
    assert f"{path} is damaged" in err.message and "rebuild" in err.hint

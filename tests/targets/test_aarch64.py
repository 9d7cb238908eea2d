"""aarch64: cross-compiled artifacts, checked as ELF files and executed under qemu-user.

The runner is tvm_fusion/targets/vm_runner.cc, cross-compiled against libtvm_runtime.so from PyPI's
aarch64 wheel of the same TVM version (scripts/setup_targets.sh), and run by qemu-aarch64.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from target_helpers import MLP_SHAPE, assert_verified, config

import helpers
from tvm_fusion import api, targets
from tvm_fusion.errors import ArtifactError
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.verify import reference_outputs

GPT2 = helpers.EXAMPLES / "gpt2_tiny.onnx"


@pytest.fixture(scope="module")
def mlp_aarch64(aarch64_tools, tmp_path_factory, mlp_path):
    return api.compile_model(mlp_path, config("aarch64"), [MLP_SHAPE], tmp_path_factory.mktemp("arm"))


@pytest.fixture(scope="module")
def gpt2_aarch64(aarch64_tools, tmp_path_factory):
    (result,) = api.compile_targets(GPT2, [config("aarch64")], None, tmp_path_factory.mktemp("arm_gpt2"))
    assert result.error is None, result.error
    return result


def test_artifact_is_an_aarch64_library_with_its_kernels(mlp_aarch64):
    library = mlp_aarch64.artifact / "model.so"
    assert targets.elf_machine(library) == "aarch64"
    symbols = targets.exported_symbols(library)
    assert "__tvm_ffi__library_bin" in symbols  # the VM executable
    kernels = {s for s in symbols if s.startswith("__tvm_ffi_fused")}
    assert len(kernels) == mlp_aarch64.metadata["kernels"] == 2


def test_metadata_names_platform_and_cross_toolchain(mlp_aarch64):
    meta = mlp_aarch64.metadata
    assert meta["target"]["mtriple"] == "aarch64-linux-gnu"
    assert meta["platform"] == {"cpu": "aarch64", "arch": "neoverse-n1", "requires_cpu_flags": [], "device": None}
    assert "aarch64-linux-gnu-gcc" in meta["toolchain"]
    assert_verified(meta, 1e-3, 1e-4)
    assert meta["verification"]["ran"] == "qemu-aarch64"
    assert meta["outputs"] == [{"name": "y", "shape": [4, 8], "dtype": "float32"}]


def test_emulated_run_matches_onnxruntime_on_new_inputs(mlp_aarch64, mlp_path):
    x = np.random.default_rng(11).standard_normal((4, 16)).astype(np.float32)
    produced = targets.run_emulated(mlp_aarch64.artifact / "model.so", mlp_aarch64.metadata, {"x": x})
    expected = reference_outputs(onnx.load(str(mlp_path)), {"x": x})
    np.testing.assert_allclose(produced["y"], expected["y"], rtol=1e-3, atol=1e-4)


def test_bundled_gpt2_runs_under_emulation_and_matches(gpt2_aarch64):
    """A real exported transformer (flattened linears, GELU-tanh, attention) on aarch64."""
    meta = gpt2_aarch64.metadata
    assert gpt2_aarch64.verification == "matches ONNX Runtime (run under qemu-aarch64)"
    assert_verified(meta, 1e-3, 1e-4)
    assert meta["fusions"]["gemm_epilogue"] >= 1
    model = onnx.load(str(GPT2))
    specs = [onnx_frontend.TensorSpec(s["name"], tuple(s["shape"]), s["dtype"]) for s in meta["inputs"]]
    inputs = onnx_frontend.random_inputs(model, specs, seed=3)  # not the seed compile verified with
    produced = targets.run_emulated(gpt2_aarch64.artifact / "model.so", meta, inputs)
    expected = reference_outputs(model, inputs)
    for name, value in expected.items():
        np.testing.assert_allclose(produced[name], value, rtol=1e-3, atol=1e-4)


def test_loading_on_x86_is_a_clear_error(mlp_aarch64):
    import platform

    import tvm_fusion

    if platform.machine() == "aarch64":
        pytest.skip("this machine is aarch64: the artifact loads natively")
    with pytest.raises(ArtifactError) as info:
        tvm_fusion.load(mlp_aarch64.artifact)
    message = str(info.value)
    assert "aarch64 library" in message and "qemu" in message


def test_missing_cross_compiler_names_the_package(tmp_path, mlp_path, monkeypatch):
    """The aarch64 target fails with the package to install; the x86 target still builds."""
    from tvm_fusion.targets import ToolchainError, Tool

    # platform_of (targets.platforms) picks the linker.
    monkeypatch.setattr(targets.platforms, "AARCH64_GCC",
                        Tool("no-such-aarch64-gcc", "gcc-aarch64-linux-gnu", "links"))
    results = api.compile_targets(mlp_path, [config("aarch64"), config("x86_64-avx2")], [MLP_SHAPE], tmp_path)
    assert isinstance(results[0].error, ToolchainError) and results[0].artifact is None
    assert "apt-get install -y gcc-aarch64-linux-gnu" in str(results[0].error)
    assert results[1].error is None and results[1].artifact.is_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["mlp.x86_64-avx2"]

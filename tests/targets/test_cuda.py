"""CUDA targets (sm_80, sm_90): every kernel gets a GPU schedule, and the artifact carries a fatbin.

No GPU here: these tests build and inspect. scripts/gpu_check.sh runs the artifacts on a GPU.
"""

from __future__ import annotations

import pytest
from target_helpers import MLP_SHAPE, config

import helpers
from tvm_fusion import api, cli, targets
from tvm_fusion.errors import ArtifactError
from tvm_fusion.passes import fusion_pipeline
from tvm_fusion.patterns import PatternReport

CUDA = ["cuda-sm80", "cuda-sm90"]
BUNDLED = sorted(helpers.EXAMPLES.glob("*.onnx"))


@pytest.fixture(scope="module")
def cuda_build(cuda_tools, tmp_path_factory, mlp_path):
    out = tmp_path_factory.mktemp("cuda")
    return {r.target: r for r in api.compile_targets(mlp_path, [config(n) for n in CUDA], [MLP_SHAPE], out)}


@pytest.mark.parametrize("name", CUDA)
def test_artifact_embeds_a_fatbin_for_its_arch_and_no_source(cuda_build, name):
    result = cuda_build[name]
    arch = "sm_" + name.removeprefix("cuda-sm")
    library = result.artifact / "model.so"
    assert targets.elf_machine(library) == "x86_64"  # the host side
    modules = targets.embedded_cuda_modules(library)
    assert [fmt for fmt, _ in modules] == ["fatbin"]  # no CUDA source left to compile at load time
    fatbin = modules[0][1]
    assert fatbin.startswith(targets.FATBIN_MAGIC)
    assert targets.fatbin_archs(fatbin) == [arch]  # cuobjdump -lelf
    device_code = result.metadata["device_code"]
    assert device_code["format"] == "fatbin" and device_code["arch"] == arch
    assert device_code["kernels"] == 2 and device_code["bytes"] == len(fatbin)
    assert "nvcc" in result.metadata["toolchain"] and result.metadata["platform"]["device"] == "cuda"


def test_compile_says_it_could_not_verify(cuda_build):
    for name in CUDA:
        result = cuda_build[name]
        assert result.error is None and result.verification.startswith("NOT VERIFIED")
        verification = result.metadata["verification"]
        assert verification["status"] == "not run" and "CUDA GPU" in verification["reason"]
        # Output shapes come from the module's signature when it cannot be run.
        assert result.metadata["outputs"] == [{"name": "y", "shape": [4, 8], "dtype": "float32"}]


def test_source_module_would_have_been_exported_without_the_packer(cuda_tools, tmp_path, mlp_path):
    """TVM's own export keeps CUDA source: what the packer replaces is really there."""
    from tvm_fusion.config import load_config

    cfg = load_config(config("cuda-sm90"))
    prepared = api.prepare(mlp_path, cfg, [MLP_SHAPE])
    executable = api.build(api.optimize(prepared).module, cfg)
    executable.export_library(str(tmp_path / "plain.so"))
    assert [fmt for fmt, _ in targets.embedded_cuda_modules(tmp_path / "plain.so")] == ["cuda"]


def test_loading_without_a_gpu_is_a_clear_error(cuda_build):
    import tvm_fusion

    if targets.cuda_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ArtifactError, match="needs a CUDA GPU"):
        tvm_fusion.load(cuda_build["cuda-sm90"].artifact)


@pytest.mark.parametrize("name", CUDA)
@pytest.mark.parametrize("model", BUNDLED, ids=lambda p: p.stem)
def test_every_kernel_of_the_bundled_models_gets_a_gpu_schedule(model, name):
    from tvm_fusion.config import load_config

    cfg = load_config(config(name))
    log: dict[str, str] = {}
    prepared = api.prepare(model, cfg, small_shapes(model, cfg.dim_defaults))
    module = fusion_pipeline(cfg, PatternReport(), schedule_log=log)(prepared.relax_module)
    kernels = [gv.name_hint for gv, f in module.functions_items() if hasattr(f, "body") and gv.name_hint != "main"]
    assert kernels and sorted(log) == sorted(kernels)
    assert targets.unscheduled_gpu_kernels(module) == []
    # Our fused GEMM kernels get a reduction schedule (Matmul, or GEMV/Reduction for one row),
    # not the one-thread-per-output fallback.
    gemms = [k for k in kernels if k.startswith("fused_relax_matmul")]
    has_gemm = any(node.op_type in ("MatMul", "Gemm") for node in prepared.onnx_model.graph.node)
    assert bool(gemms) == has_gemm  # dbnet_tiny (a fully convolutional detector) has none
    assert all(log[k] in ("Matmul", "GEMV", "Reduction") for k in gemms)


def small_shapes(model, dims: dict[str, int]) -> list[str]:
    """--input-shape flags: the config's [inputs] sizes, 64 for any other dynamic dim (image sides)."""
    import onnx

    flags = []
    for value in onnx.load(str(model)).graph.input:
        shape = [d.dim_value or dims.get(d.dim_param, 64) for d in value.type.tensor_type.shape.dim]
        flags.append(f"{value.name}:{'x'.join(map(str, shape))}")
    return flags


def test_unscheduled_kernels_are_found():
    """The check that guards against GPU code silently becoming host code can fail."""
    from tvm_fusion.config import load_config

    cfg = load_config(config("cuda-sm90"))
    prepared = api.prepare(helpers.EXAMPLES / "bert_tiny.onnx", cfg)
    lowered = fusion_pipeline(cfg, PatternReport(), phases=("canonicalize", "fuse", "lower"))(prepared.relax_module)
    unscheduled = targets.unscheduled_gpu_kernels(lowered)
    assert len(unscheduled) == sum(1 for _, f in lowered.functions_items() if hasattr(f, "body")) - 1  # all but main


def test_unscheduled_cuda_build_fails_and_other_targets_build(tmp_path, mlp_path, capsys):
    """schedule = "none" on a GPU would build host code; compile refuses that target only."""
    text = config("cuda-sm90").read_text().replace('schedule = "default"', 'schedule = "none"')
    naive = tmp_path / "cuda-naive.toml"
    naive.write_text(text)
    code = cli.main(["-q", "compile", str(mlp_path), "--config", str(naive), "--config",
                     str(config("x86_64-avx2")), "--input-shape", MLP_SHAPE, "-o", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == ArtifactError.exit_code
    assert "target cuda-naive" in captured.err and "no GPU schedule for" in captured.err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mlp.x86_64-avx2"]
    assert "matches ONNX Runtime" in captured.out


def test_missing_nvcc_names_the_package(tmp_path, mlp_path, monkeypatch):
    from tvm_fusion.targets import Tool, ToolchainError

    # platform_of (targets.platforms) picks the device compiler.
    monkeypatch.setattr(targets.platforms, "NVCC", Tool("no-such-nvcc", "pip:nvidia-cuda-nvcc", "compiles kernels"))
    results = api.compile_targets(mlp_path, [config("cuda-sm80"), config("x86_64-avx2")], [MLP_SHAPE], tmp_path,
                                  verify=False)
    assert isinstance(results[0].error, ToolchainError)
    assert "pip install nvidia-cuda-nvcc" in str(results[0].error)
    assert results[1].error is None and results[1].verification == "skipped (--no-verify)"

"""x86-64 targets: AVX-512 and AVX2 artifacts built in one go; each one this CPU can run matches ONNX Runtime.

The suite runs on AVX2-only and on AVX-512 machines: the AVX-512 artifact is verified natively on
the latter and reported as not verified (never run, never a crash) on the former.
"""

from __future__ import annotations

import hashlib
import subprocess

import numpy as np
import pytest
from machine import host_has_avx512
from target_helpers import MLP_SHAPE, assert_verified, config

from tvm_fusion import api, targets
from tvm_fusion.errors import ArtifactError
from tvm_fusion.verify import reference_outputs

X86 = ["x86_64-avx512", "x86_64-avx2"]
RUNNABLE_HERE = X86 if host_has_avx512() else ["x86_64-avx2"]


@pytest.fixture(scope="module")
def x86_build(tmp_path_factory, mlp_path):
    out = tmp_path_factory.mktemp("x86")
    return {r.target: r for r in api.compile_targets(mlp_path, [config(n) for n in X86], [MLP_SHAPE], out)}


def test_both_targets_build_and_verify(x86_build):
    for name in X86:
        result = x86_build[name]
        assert result.error is None
        meta = result.metadata
        if name in RUNNABLE_HERE:
            assert result.verification == "matches ONNX Runtime"
            assert_verified(meta, 1e-3, 1e-4)
        else:
            assert result.verification.startswith("NOT VERIFIED") and "avx512f" in result.verification
        assert meta["config"] == name and meta["target"]["mtriple"] == "x86_64-linux-gnu"
        assert meta["platform"]["cpu"] == "x86_64" and meta["platform"]["device"] is None
        assert meta["toolchain"]["gcc"].startswith("gcc")
        library = result.artifact / meta["library"]
        assert meta["library_sha256"] == hashlib.sha256(library.read_bytes()).hexdigest()
        assert targets.elf_machine(library) == "x86_64"
    assert x86_build["x86_64-avx512"].metadata["platform"]["arch"] == "x86-64-v4"
    assert "avx512f" in x86_build["x86_64-avx512"].metadata["platform"]["requires_cpu_flags"]
    assert x86_build["x86_64-avx2"].metadata["platform"]["arch"] == "x86-64-v3"
    assert "avx512f" not in x86_build["x86_64-avx2"].metadata["platform"]["requires_cpu_flags"]


def test_each_artifact_uses_its_vector_width(x86_build):
    """The AVX-512 library computes on zmm registers; the AVX2 one never touches them."""

    def disassembly(name: str) -> str:
        library = x86_build[name].artifact / "model.so"
        return subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True).stdout

    assert "%zmm" in disassembly("x86_64-avx512")
    avx2 = disassembly("x86_64-avx2")
    assert "%ymm" in avx2 and "%zmm" not in avx2


def test_loaded_artifacts_match_onnxruntime_on_new_inputs(x86_build, mlp_path):
    import onnx

    import tvm_fusion

    x = np.random.default_rng(7).standard_normal((4, 16)).astype(np.float32)
    expected = reference_outputs(onnx.load(str(mlp_path)), {"x": x})["y"]
    for name in RUNNABLE_HERE:
        produced = tvm_fusion.load(x86_build[name].artifact).run({"x": x})["y"]
        np.testing.assert_allclose(produced, expected, rtol=1e-3, atol=1e-4)
    for name in set(X86) - set(RUNNABLE_HERE):
        with pytest.raises(ArtifactError, match="cannot run on this machine"):
            tvm_fusion.load(x86_build[name].artifact)


def test_import_and_fusion_run_once_for_all_targets(tmp_path, mlp_path, monkeypatch):
    from tvm_fusion import session
    from tvm_fusion.frontend import onnx as onnx_frontend

    calls = {"import": 0, "phases": []}
    real_import, real_pipeline = onnx_frontend.import_model, session.fusion_pipeline

    def counting_import(*args, **kwargs):
        calls["import"] += 1
        return real_import(*args, **kwargs)

    def recording_pipeline(cfg, report, phases=("canonicalize", "layout", "fuse", "lower", "schedule"), **kwargs):
        calls["phases"].append(tuple(phases))
        return real_pipeline(cfg, report, phases=phases, **kwargs)

    monkeypatch.setattr(onnx_frontend, "import_model", counting_import)
    monkeypatch.setattr(session, "fusion_pipeline", recording_pipeline)
    configs = [config(n) for n in X86]
    results = api.compile_targets(mlp_path, configs, [MLP_SHAPE], tmp_path, verify=False)
    assert [r.error for r in results] == [None, None]
    assert calls["import"] == 1
    # The graph phases once per conv block width (AVX2 blocks 8 channels, AVX-512 16), the
    # fusion gate's check of the composites once for both targets, one schedule per target.
    widths = {session.graph_phases_key(api.resolve_config(c))[1] for c in configs}
    assert calls["phases"].count(("canonicalize", "layout", "fuse")) == len(widths)
    assert calls["phases"].count(("lower", "schedule")) == 1
    assert calls["phases"].count(("schedule",)) == 2
    fusions = results[0].metadata["fusions"]
    assert fusions == results[1].metadata["fusions"]
    assert (fusions["gelu_erf"], fusions["gemm_epilogue"]) == (1, 2)


def test_avx512_artifact_on_a_cpu_without_it_is_an_error(x86_build, monkeypatch):
    """Instead of an illegal-instruction crash: a message naming the missing CPU features."""
    import tvm_fusion

    monkeypatch.setattr(targets.host, "host_cpu_flags", lambda: {"avx2", "fma", "sse4_2"})
    with pytest.raises(ArtifactError) as info:
        tvm_fusion.load(x86_build["x86_64-avx512"].artifact)
    assert "avx512f" in str(info.value) and "cannot run on this machine" in str(info.value)
    assert tvm_fusion.load(x86_build["x86_64-avx2"].artifact).run({"x": np.zeros((4, 16), np.float32)})


def test_duplicate_target_names_are_refused(tmp_path, mlp_path):
    from tvm_fusion.errors import ConfigError

    with pytest.raises(ConfigError, match="two configs are named 'x86_64-avx2'"):
        api.compile_targets(mlp_path, [config("x86_64-avx2")] * 2, [MLP_SHAPE], tmp_path)
    assert list(tmp_path.iterdir()) == []



def test_a_vnni_target_requires_vnni_of_the_machine_that_runs_it():
    """Its int8 matmul kernels run vpdpbusd: on an AVX-512 CPU without VNNI (Skylake) the
    artifact is refused by name instead of dying of an illegal instruction."""
    from tvm_fusion.targets import platform_of

    assert "avx512_vnni" in platform_of({"kind": "llvm", "mcpu": "sapphirerapids"}).cpu_flags
    assert "avx512_vnni" not in platform_of({"kind": "llvm", "mcpu": "skylake-avx512"}).cpu_flags
    # the bf16 kernels of a CPU without AMX run vdpbf16ps
    assert "avx512_bf16" in platform_of({"kind": "llvm", "mcpu": "znver4"}).cpu_flags
    assert "avx512_bf16" not in platform_of({"kind": "llvm", "mcpu": "icelake-server"}).cpu_flags
    assert "avx512_vnni" not in platform_of({"kind": "llvm", "mcpu": "znver1"}).cpu_flags

"""The per-kernel bf16 gate (tvm_fusion/commands/bf16_kernels.py) on a planted ill-conditioned
matmul: at auto and at bf16 it stays float32 and is named, the benign matmul beside it is bf16,
and the outputs pass; profile sets the bf16 kernel against the AMX-BF16 roof. Then a matmul that
passes alone but whose error the layer after it amplifies past the gate: the emulation names it
and compile rebuilds with it float32."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion import api, cli
from tvm_fusion.commands import bf16_kernels
from tvm_fusion.commands.bf16_kernels import Bf16KernelGate, emulated_declines, judge_bf16_kernels
from tvm_fusion.commands.profile import roof_position
from tvm_fusion.config import parse_config
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.kernels.cpu_features import has_bf16_kernels
from tvm_fusion.machine_peak import MachinePeak
from tvm_fusion.session import ModelSession
from tvm_fusion.verify import ReferenceUnavailable, reference_outputs

HOST_HAS_BF16 = has_bf16_kernels(tvm.target.Target.from_device(tvm.cpu()))
OFFSET = 1000.0  # bf16's spacing there is 4: rounding the shifted activation loses x itself


def planted_model() -> onnx.ModelProto:
    """``benign = x @ A`` and ``ill = (x + OFFSET) @ B``, B's columns summing to zero: the float32
    product of the second is ``x @ B``, a small remainder of two large sums, which bf16 rounding of
    either operand swamps. The first is an ordinary matmul on centered activations."""
    rng = np.random.default_rng(0)
    raw = rng.standard_normal((64, 32))
    inits = [numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "a"),
             numpy_helper.from_array((raw - raw.mean(axis=0)).astype(np.float32), "b"),
             numpy_helper.from_array(np.array(OFFSET, np.float32), "offset")]
    nodes = [helper.make_node("MatMul", ["x", "a"], ["benign"], name="benign_matmul"),
             helper.make_node("Add", ["x", "offset"], ["shifted"], name="shift"),
             helper.make_node("MatMul", ["shifted", "b"], ["ill"], name="ill_matmul")]
    # 3-D outputs: hidden values, not a classifier head's logits (no top-1 in the gate)
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4, 32]) for name in ("benign", "ill")]
    graph = helper.make_graph(nodes, "planted", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 64])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module", params=["auto", "bf16"])
def planted_build(request, tmp_path_factory):
    if not HOST_HAS_BF16:
        pytest.skip("the host CPU has neither AVX512_BF16 nor AMX-BF16: no bf16 kernel is built or run here")
    folder = tmp_path_factory.mktemp(f"planted-{request.param}")
    onnx.save(planted_model(), folder / "planted.onnx")
    said: list[str] = []
    result = api.compile_model(folder / "planted.onnx", None, None, folder / "build", precision=request.param,
                               progress=said.append)
    return result, said


def test_the_ill_conditioned_matmul_stays_float32_and_is_named(planted_build):
    result, said = planted_build
    meta = result.metadata
    gate = meta["bf16_gate_per_kernel"]
    assert gate["judged"] == 2 and gate["unjudged"] == []
    (declined,) = gate["declined"]
    assert declined["onnx_nodes"] == ["ill_matmul"]
    assert declined["cosine"] < meta["verification"]["bf16_gate"]["min_cosine"]
    assert "cosine" in declined["reason"]
    assert meta["built_from"]["config"]["bf16_declined"] == [declined["matmul"]]
    assert any(line.startswith("bf16 gate: kept ill_matmul float32") for line in said)


def test_the_benign_matmul_is_bf16_and_the_outputs_pass(planted_build):
    result, _ = planted_build
    meta = result.metadata
    assert meta["precision"] == "bf16" and "precision_fallback" not in meta  # no whole-model fallback
    assert len(meta["bf16_kernels"]) == 1
    outputs = {o["name"]: o for o in meta["verification"]["outputs"]}
    assert all(o["passed"] for o in outputs.values())
    assert outputs["benign"]["max_abs"] > 1e-6  # bf16's rounding
    assert outputs["ill"]["max_abs"] < 1e-2  # float32's: bf16 would be off by tens (the declined cosine)


def test_profile_sets_the_bf16_kernel_against_the_bf16_roof(planted_build, tmp_path, capsys):
    """Of the artifact: its declined matmul rebuilt float32, as compile built it. The bf16 roof is
    AMX-BF16's where the host has the tiles, AVX512_BF16's (Zen 4) where it has not."""
    result, _ = planted_build
    assert cli.main(["profile", str(result.artifact), "--repeat", "3", "--json", str(tmp_path / "p.json")]) == 0
    table = capsys.readouterr().out
    report = json.loads((tmp_path / "p.json").read_text())
    kernels = {node: k for k in report["kernels"] for node in k["onnx_nodes"]}
    bf16, float32 = kernels["benign_matmul"], kernels["ill_matmul"]
    peak = report["peak"]
    roof, roof_gflops = (("AMX-BF16", peak["amx_bf16_gflops"]) if peak["amx_bf16_gflops"]
                         else ("AVX512_BF16", peak["avx512_bf16_gflops"]))
    assert bf16["compute_roof"] == roof and roof_gflops and bf16["compute_roof_gflops"] == roof_gflops
    assert float32["compute_roof"] == "FMA" and float32["compute_roof_gflops"] == report["peak"]["gflops"]
    assert (bf16["roof_kind"], float32["roof_kind"]) == ("bf16", "float32")
    assert bf16["bound"].startswith(f"{roof} ") and f"{bf16['bound']} {bf16['roof_percent']:.0f}%" in table
    assert bf16["flops"] == 2 * 8 * 64 * 32  # a multiply-add per product: bf16's bit casts count nothing


PEAK = MachinePeak("llvm-test-2c", 2, gflops=100.0, gbytes_per_s=10.0, l2_gbytes_per_s=50.0, probed_at="-",
                   amx_bf16_gflops=1000.0)


def test_a_bf16_kernel_is_set_against_the_amx_roof_and_its_ridge():
    """Intensity 50 FLOP/B: above the FMA ridge (10), below the AMX-BF16 ridge (100)."""
    assert roof_position(PEAK, "float32", 5000, 50.0, 50.0, 1.0) == ("FMA", 100.0, "compute", 0.5)
    assert roof_position(PEAK, "bf16", 5000, 50.0, 250.0, 5.0) == ("AMX-BF16", 1000.0, "AMX-BF16 memory", 0.5)
    assert roof_position(PEAK, "bf16", 5000, 200.0, 500.0, 2.5) == ("AMX-BF16", 1000.0, "AMX-BF16 compute", 0.5)


def test_without_an_amx_probe_every_kernel_is_set_against_the_fma_roof():
    no_amx = dataclasses.replace(PEAK, amx_bf16_gflops=None)
    assert roof_position(no_amx, "bf16", 5000, 50.0, 50.0, 1.0) == ("FMA", 100.0, "compute", 0.5)


def amplified_model() -> onnx.ModelProto:
    """``amplified = exp(x @ A)`` and ``benign = x @ B``. Alone each matmul errs by about u = 2^-8
    of its output in bf16, within the gate; but x @ A reaches +-50, where bf16's error of about 0.1
    becomes a 10 % error of its exp, past the gate on the output."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((3.0 * rng.standard_normal((64, 32))).astype(np.float32), "a"),
             numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "a"], ["logits"], name="amplified_matmul"),
             helper.make_node("Exp", ["logits"], ["amplified"], name="exp"),
             helper.make_node("MatMul", ["x", "b"], ["benign"], name="benign_matmul")]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4, 32]) for name in ("amplified", "benign")]
    graph = helper.make_graph(nodes, "amplified", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 64])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def named_cpu_setup(model: onnx.ModelProto, path):
    """``model`` for a named AMX-BF16 CPU at bf16, so it runs on any host: the candidates are
    the pipeline's, the emulation ONNX Runtime's. The session, its prepared model, the config
    and the reference (compile's seeded inputs, ONNX Runtime's outputs for them)."""
    onnx.save(model, path)
    cfg = parse_config({"target": {"kind": "llvm", "mcpu": "sapphirerapids"}, "pipeline": {"precision": "bf16"}},
                       name="sapphirerapids-test", path="test.toml")
    session = ModelSession(path, None)
    prepared = session.prepared(cfg)
    inputs = onnx_frontend.random_inputs(prepared.onnx_model, onnx_frontend.inputs_at(prepared.inputs, {}), cfg.seed)
    return session, prepared, cfg, (inputs, reference_outputs(prepared.onnx_model, inputs))


def test_the_emulation_names_the_matmul_whose_error_is_amplified(tmp_path):
    session, prepared, cfg, reference = named_cpu_setup(amplified_model(), tmp_path / "amplified.onnx")
    said: list[str] = []
    (declined,) = emulated_declines(session, prepared, cfg, None, Bf16KernelGate(), reference, 0.5, said.append)
    assert declined.onnx_nodes == ["amplified_matmul"] and declined.judged_by == "emulation"
    assert declined.cosine is None and declined.max_abs > 0 and "x the gate's allowance on amplified" in declined.reason
    assert said[0] == "bf16 gate: emulating 2 bf16 matmul(s) in ONNX Runtime to find which to keep float32"
    assert said[1].startswith("bf16 gate: kept amplified_matmul float32: in bf16 it moves the outputs too far")
    # already kept float32: nothing left to decline that the outputs need
    kept = Bf16KernelGate(declined=[declined])
    assert emulated_declines(session, prepared, cfg, None, kept, reference, 0.5) == []


def test_an_emulation_onnx_runtime_cannot_run_declines_nothing_and_says_so(tmp_path, monkeypatch):
    session, prepared, cfg, reference = named_cpu_setup(amplified_model(), tmp_path / "amplified.onnx")

    def refuse(*_args):
        raise ReferenceUnavailable("ONNX Runtime cannot run the model: planted", "")
    monkeypatch.setattr(bf16_kernels, "Bf16Emulation", refuse)
    said: list[str] = []
    assert emulated_declines(session, prepared, cfg, None, Bf16KernelGate(), reference, 0.5, said.append) == []
    assert said[-1] == "bf16 gate: no emulation: ONNX Runtime cannot run the model: planted"


@pytest.mark.parametrize("precision", ["bf16", "auto"])
def test_compile_rebuilds_with_the_amplified_matmul_float32(tmp_path, precision):
    if not HOST_HAS_BF16:
        pytest.skip("the host CPU has neither AVX512_BF16 nor AMX-BF16: no bf16 kernel is built or run here")
    onnx.save(amplified_model(), tmp_path / "amplified.onnx")
    said: list[str] = []
    result = api.compile_model(tmp_path / "amplified.onnx", None, None, tmp_path / "build", precision=precision,
                               progress=said.append)
    meta = result.metadata
    gate = meta["bf16_gate_per_kernel"]
    assert meta["precision"] == "bf16" and "precision_fallback" not in meta
    assert [(d["onnx_nodes"], d["judged_by"]) for d in gate["declined"]] == [(["amplified_matmul"], "emulation")]
    assert gate["emulation_margins"] == [0.5] and len(meta["bf16_kernels"]) == 1
    assert all(o["passed"] for o in meta["verification"]["outputs"])
    assert any(line.startswith("bf16 gate: rebuilding with 1 matmul(s) kept float32") for line in said)


def shared_composite_model() -> onnx.ModelProto:
    """The planted pair with a bias each: both are calls of one gemm epilogue composite (one
    shape), ``benign`` the first, ``ill`` the second."""
    model = planted_model()
    graph = model.graph
    graph.initializer.append(numpy_helper.from_array(np.linspace(-1, 1, 32).astype(np.float32), "bias"))
    for node in list(graph.node):
        if node.op_type == "MatMul":
            product = node.output[0]
            node.output[0] = f"{product}_product"
            graph.node.append(helper.make_node("Add", [node.output[0], "bias"], [product], name=f"{product}_bias"))
    return model


def test_one_call_of_a_shared_composite_is_declined_and_named_by_its_own_node(tmp_path):
    """For a named AMX-BF16 CPU, so it runs on any host (the activations come from a float32 run):
    the ill call is kept float32 by its key, and named by its own ONNX node, not the composite's
    first call's."""
    session, prepared, cfg, (inputs, _) = named_cpu_setup(shared_composite_model(), tmp_path / "shared.onnx")
    gate = judge_bf16_kernels(session, prepared, cfg, None, inputs)
    (declined,) = gate.declined
    assert gate.judged == 2 and declined.matmul.endswith("#1") and declined.onnx_nodes == ["ill_matmul"]

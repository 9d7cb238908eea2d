"""End to end on real exporter output: fused vs unfused vs ONNX Runtime, and what fired."""

from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.frontend.onnx import random_inputs
from tvm_fusion.verify import reference_outputs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"
SHAPES = {"bert_tiny": ["input_ids:1x32", "attention_mask:1x32"], "gpt2_tiny": ["input_ids:1x32"]}
# Stated tolerances: float32 models with reductions over 256-1024 elements.
RTOL, ATOL = 1e-3, 2e-4
LAYERS = 2


@pytest.fixture(scope="module", params=sorted(SHAPES))
def prepared(request):
    return api.prepare(EXAMPLES / f"{request.param}.onnx", load_config(), SHAPES[request.param])


def run(executable, arrays):
    vm = relax.VirtualMachine(executable, tvm.cpu())
    result = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
    return result.numpy() if hasattr(result, "numpy") else result[0].numpy()


def test_fused_unfused_and_onnxruntime_agree(prepared):
    inputs = random_inputs(prepared.onnx_model, prepared.inputs, seed=0)
    arrays = [inputs[spec.name] for spec in prepared.inputs]
    optimized = api.optimize(prepared)
    fused = run(api.build(optimized.module, prepared.config), arrays)
    unfused = run(tvm.compile(relax.get_pipeline("zero")(prepared.relax_module),
                              target=prepared.config.tvm_target()), arrays)
    (expected,) = reference_outputs(prepared.onnx_model, inputs).values()
    np.testing.assert_allclose(fused, expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(fused, unfused, rtol=RTOL, atol=ATOL)


def test_every_linear_layer_and_gelu_is_fused(prepared):
    optimized = api.optimize(prepared)
    fired, variants = optimized.report.fired, optimized.report.variants
    # Per layer: Q, K, V (one fused c_attn GEMM in GPT-2), attention output, FFN up (+ GELU),
    # FFN down. The residual adds go with the LayerNorm (skip_layernorm runs first); where the
    # bias add went too, that linear is a plain matmul and its bias is in a bias_skip norm.
    linear_layers = 6 if prepared.name == "bert_tiny" else 4
    embedding_bias_skip = 1 if prepared.name == "bert_tiny" else 0  # word + type + position adds
    linears_with_bias_in_norm = variants["skip_layernorm.bias_skip"] - embedding_bias_skip
    assert fired["gemm_epilogue"] + linears_with_bias_in_norm == linear_layers * LAYERS
    gelu_variant = "matmul_bias_gelu" if prepared.name == "bert_tiny" else "matmul_bias_gelu_tanh"
    assert variants[f"gemm_epilogue.{gelu_variant}"] == LAYERS
    assert variants["gemm_epilogue.matmul_bias_residual"] == 0
    assert not optimized.report.near_misses
    assert api.kernel_calls(optimized.module) <= api.ModelSession.of(prepared).stock_kernel_calls(prepared.config)


def test_no_kernel_is_left_unscheduled(prepared):
    optimized = api.optimize(prepared)
    unscheduled = [gv.name_hint for gv, f in optimized.module.functions_items()
                   if isinstance(f, tvm.tirx.PrimFunc) and not (f.attrs and f.attrs.get("tirx.is_scheduled"))]
    assert unscheduled == []


def test_every_attention_is_one_scheduled_kernel(prepared):
    """Per layer the head split, QKᵀ, scale, mask, softmax, ·V and head merge are one kernel."""
    optimized = api.optimize(prepared)
    variant = "masked" if prepared.name == "bert_tiny" else "qkv_causal_masked"
    assert optimized.report.fired["attention"] == LAYERS
    assert optimized.report.variants[f"attention.{variant}"] == LAYERS
    attention_kernels = {name for name, rule in optimized.schedule_rules.items() if rule == "Attention"}
    calls = [call.args[0].name_hint for call in _call_tirs(optimized.module["main"])]
    assert sum(name in attention_kernels for name in calls) == LAYERS
    assert not any("softmax" in name and name not in attention_kernels for name in calls)


def _call_tirs(func):
    found = []
    relax.analysis.post_order_visit(
        func, lambda e: found.append(e) if isinstance(e, relax.Call)
        and getattr(e.op, "name", "") == "relax.call_tir" else None)
    return found


def test_every_layer_norm_is_fused_with_its_residual_add(prepared):
    """BERT: embeddings + 2 per layer; GPT-2: 2 per layer + final. inspect names the ONNX
    LayerNormalization and Add nodes each instance absorbed."""
    report = api.inspect_model(EXAMPLES / f"{prepared.name}.onnx", input_shapes=SHAPES[prepared.name])
    assert report.report.fired["skip_layernorm"] == 5
    assert "nn.layer_norm" not in report.fused_ops and report.relax_ops["nn.layer_norm"] == 5
    norms = [i for i in report.instances if i.pattern == "skip_layernorm"]
    assert sorted(op for i in norms for op in i.ops if op == "LayerNormalization") == ["LayerNormalization"] * 5
    assert all("Add" in i.ops for i in norms)

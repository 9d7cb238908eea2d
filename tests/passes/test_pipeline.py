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
    fired = optimized.report.fired
    # Per layer: Q, K, V (one fused c_attn GEMM in GPT-2), attention output (+ residual),
    # FFN up (+ GELU), FFN down (+ residual).
    linear_layers = 6 if prepared.name == "bert_tiny" else 4
    assert fired["gemm_epilogue"] == linear_layers * LAYERS
    gelu_variant = "matmul_bias_gelu" if prepared.name == "bert_tiny" else "matmul_bias_gelu_tanh"
    assert fired[f"gemm_epilogue.{gelu_variant}"] == LAYERS
    assert fired["gemm_epilogue.matmul_bias_residual"] == 2 * LAYERS
    assert not optimized.report.near_misses
    assert api.kernel_calls(optimized.module) <= api.stock_kernel_calls(prepared)


def test_no_kernel_is_left_unscheduled(prepared):
    optimized = api.optimize(prepared)
    unscheduled = [gv.name_hint for gv, f in optimized.module.functions_items()
                   if isinstance(f, tvm.tirx.PrimFunc) and not (f.attrs and f.attrs.get("tirx.is_scheduled"))]
    assert unscheduled == []

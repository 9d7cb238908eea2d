"""One token of a decoder (a sequence of 1): its row-wise kernels get their rules, not Fallback."""

import numpy as np
import onnx
import pytest

from helpers import EXAMPLES, assert_fused_matches_references
from tvm_fusion import api
from tvm_fusion.config import load_config

GPT2 = EXAMPLES / "gpt2_tiny.onnx"


@pytest.mark.parametrize("shape, sequence", [
    ("input_ids:1x1", 1),        # static: every row-wise kernel is a single row
    ("input_ids:1x1..16", 1),    # a range whose low end is one token: symbolic rows, run at 1
    ("input_ids:1x1..16", 7),
])
def test_gpt2_tiny_leaves_no_kernel_to_fallback(shape, sequence):
    """At 1x1 the three (skip) layer norms were Fallback's (normalize_prim_func dropped the unit
    row from their element-wise blocks only); now SkipNorm's, with ONNX Runtime's numbers."""
    prepared = api.prepare(GPT2, load_config(None), shape)
    optimized = api.optimize(prepared, tuning_log=False)
    rules = optimized.schedule_rules
    assert "Fallback" not in rules.values(), rules
    norms = {kernel: rule for kernel, rule in rules.items() if "layer_norm" in kernel}
    assert len(norms) == 3 and set(norms.values()) == {"SkipNorm"}, norms
    ids = np.random.default_rng(0).integers(0, 100, (1, sequence), dtype=np.int64)
    assert_fused_matches_references(onnx.load(str(GPT2)), prepared, optimized, {"input_ids": ids},
                                    rtol=1e-4, atol=1e-4)

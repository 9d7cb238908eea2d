"""``RMSNorm``: the fused ONNX of ``rmsnorm_decomposed``, written by ``layernorm_decomposed``'s
builder, and its reference implementation."""

from __future__ import annotations

from ..reference_ops import FusedOp, rms_norm
from ..spec import OnnxSpec
from .layernorm_decomposed import build_norm_rewrite


class RMSNorm(FusedOp):
    """An RMSNorm the exporter decomposed (no RMSNormalization below opset 23), as one op."""

    def _run(self, x, gamma=None, epsilon=1e-6, axis=-1):
        return (rms_norm(x, gamma, epsilon, axis),)


SPEC = OnnxSpec("rmsnorm_decomposed", build_norm_rewrite, (RMSNorm,))

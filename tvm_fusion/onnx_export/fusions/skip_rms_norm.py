"""``SkipRMSNorm``: the fused ONNX of ``skip_rms_norm``, written by ``skip_layernorm``'s builder,
and its reference implementation."""

from __future__ import annotations

from ..reference_ops import FusedOp, rms_norm
from ..spec import OnnxSpec
from .skip_layernorm import build_skip_norm


class SkipRMSNorm(FusedOp):
    """RMSNorm(input + bias + skip) = s / sqrt(mean(s²) + epsilon) * gamma; second output the sum."""

    def _run(self, x, skip, gamma=None, bias=None, epsilon=1e-6, axis=-1):
        summed = (x + bias if bias is not None else x) + skip
        return rms_norm(summed, gamma, epsilon, axis), summed


SPEC = OnnxSpec("skip_rms_norm", build_skip_norm, (SkipRMSNorm,))

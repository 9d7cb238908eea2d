"""``GemmDropout``: the fused ONNX of ``dropout_training`` (a GEMM epilogue, then training-mode
Dropout), written by ``gemm_epilogue``'s builder, and its reference implementation."""

from __future__ import annotations

import numpy as np

from ..reference_ops import FusedOp
from ..spec import OnnxSpec
from .gemm_epilogue import build_gemm, gemm_epilogue


class GemmDropout(FusedOp):
    """A GEMM epilogue then training-mode Dropout: [Y * mask / (1 - ratio), mask].

    The mask is ``uniform >= ratio``, uniform the top 24 bits of Philox-4x32-10's word 0 at
    counter = the element's flat index, key = (seed low, seed high 32 bits), times 2**-24.
    """

    def _run(self, a, b, bias=None, trans_b=0, alpha=1.0, beta=1.0, activation="", activation_params=None,
             output_shape=None, has_bias=0, ratio=0.5, seed=0):
        values = gemm_epilogue(a, b, bias, None, trans_b, alpha, beta, activation, activation_params,
                               output_shape)
        mask = philox_uniform(values.size, seed).reshape(values.shape) >= np.float32(ratio)
        scale = np.float32(1) / (np.float32(1) - np.float32(ratio))
        return np.where(mask, values * scale, 0).astype(values.dtype), mask


def philox_uniform(count: int, seed: int) -> np.ndarray:
    """float32 uniforms in [0, 1): Philox-4x32-10 word 0 at counters 0..count-1 (Random123)."""
    low = np.uint64(0xFFFFFFFF)
    counter = np.arange(count, dtype=np.uint64)
    c = [counter & low, counter >> np.uint64(32), np.zeros_like(counter), np.zeros_like(counter)]
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for _ in range(10):
        p0, p1 = c[0] * np.uint64(0xD2511F53), c[2] * np.uint64(0xCD9E8D57)
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & low,
             (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & low]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return (c[0] >> np.uint64(8)).astype(np.float32) * np.float32(2.0 ** -24)


SPEC = OnnxSpec("dropout_training", build_gemm, (GemmDropout,))

"""Skip RMSNorm: residual Add (+ bias Add) + RMSNorm (SimplifiedLayerNormalization) as one kernel.

The Llama/T5 form of ``skip_layernorm``: the same row-wise kernel without the mean, and the
same second output when a later op reads the sum (the next residual).
"""

from __future__ import annotations

from tvm.relax.dpl import is_op, wildcard

from .skip_layernorm import SkipLayerNorm, skip_norm_variants


class SkipRmsNorm(SkipLayerNorm):
    """``SkipLayerNorm``'s checks and kernel, around ``rms_norm``."""

    name = "skip_rms_norm"
    description = ("residual add (+ bias add) + rms_norm -> one row-wise kernel "
                   "(also writes the sum when a later op reads it)")

    def variants(self):
        return skip_norm_variants(lambda summed: is_op("relax.nn.rms_norm")(summed, wildcard()))

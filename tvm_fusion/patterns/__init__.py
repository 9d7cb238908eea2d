"""The pattern registry: one fusion concept per module, registered here by one line each.

The order of ``PATTERNS`` is the order of a pipeline config's ``patterns = "default"``.
"""

from __future__ import annotations

from .attention import Attention
from .base import FusionRule, NearMiss, PatternReport, RewriteRule
from .clip import Clip
from .conv_affine_fold import ConvAffineFold
from .conv_bn_fold import ConvBnFold
from .conv_epilogue import ConvEpilogue
from .conv_transpose_epilogue import ConvTransposeEpilogue
from .dropout import Dropout
from .dropout_training import DropoutTraining
from .eye_like_add import EyeLikeAdd
from .flattened_linear import FlattenedLinear
from .gelu_erf import GeluErf
from .gelu_tanh import GeluTanh
from .gemm_epilogue import GemmEpilogue
from .hardsigmoid import HardSigmoid
from .hardswish import HardSwish
from .layernorm_decomposed import LayerNormDecomposed
from .resize_merge import ResizeMerge
from .rmsnorm_decomposed import RmsNormDecomposed
from .silu import Silu
from .skip_layernorm import SkipLayerNorm
from .skip_rms_norm import SkipRmsNorm
from .softmax import Softmax
from .softmax_flattened import SoftmaxFlattened
from .squeeze_excitation import SqueezeExcitation

PATTERNS: dict[str, RewriteRule | FusionRule] = {
    rule.name: rule
    for rule in (
        # Rewrites (one Relax op for an exporter's decomposition) run first, in this order.
        FlattenedLinear(),
        GeluErf(),
        GeluTanh(),
        Silu(),
        Clip(),
        HardSwish(),
        HardSigmoid(),
        Dropout(),
        LayerNormDecomposed(),
        RmsNormDecomposed(),
        SoftmaxFlattened(),
        ConvBnFold(),
        ConvAffineFold(),
        # Fusions: where two match at one place, the earlier one takes it.
        SqueezeExcitation(),
        ConvEpilogue(),  # before resize_merge: it takes an FPN merge whose lateral is a conv
        ConvTransposeEpilogue(),
        ResizeMerge(),
        Attention(),
        SkipLayerNorm(),
        SkipRmsNorm(),
        DropoutTraining(),  # before gemm_epilogue, which would take its matmul chain
        EyeLikeAdd(),
        GemmEpilogue(),
        Softmax(),
    )
}


def registered_patterns() -> list[str]:
    return list(PATTERNS)


def get_pattern(name: str) -> RewriteRule | FusionRule:
    return PATTERNS[name]


__all__ = ["PATTERNS", "FusionRule", "NearMiss", "PatternReport", "RewriteRule",
           "get_pattern", "registered_patterns"]

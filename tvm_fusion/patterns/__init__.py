"""The pattern registry: one fusion concept per module, registered here by one line each.

The order of ``PATTERNS`` is the default order of a pipeline config's ``patterns`` list.
"""

from __future__ import annotations

from .base import FusionRule, NearMiss, PatternReport, RewriteRule
from .clip import Clip
from .flattened_linear import FlattenedLinear
from .gelu_erf import GeluErf
from .gelu_tanh import GeluTanh
from .gemm_epilogue import GemmEpilogue
from .silu import Silu

PATTERNS: dict[str, RewriteRule | FusionRule] = {
    rule.name: rule
    for rule in (
        FlattenedLinear(),
        GeluErf(),
        GeluTanh(),
        Silu(),
        Clip(),
        GemmEpilogue(),
    )
}


def registered_patterns() -> list[str]:
    return list(PATTERNS)


def get_pattern(name: str) -> RewriteRule | FusionRule:
    return PATTERNS[name]


__all__ = ["PATTERNS", "FusionRule", "NearMiss", "PatternReport", "RewriteRule",
           "get_pattern", "registered_patterns"]

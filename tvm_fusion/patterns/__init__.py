"""Fusion patterns: one concept per module, found and ordered by ``registry`` (no list to edit).

The registry's order is the order of a pipeline config's ``patterns = "default"``.
"""

from __future__ import annotations

from .base import FusionRule, NearMiss, PatternReport, RewriteRule
from .registry import pattern_registry


def registered_patterns() -> list[str]:
    return list(pattern_registry())


def get_pattern(name: str) -> RewriteRule | FusionRule:
    return pattern_registry()[name]


__all__ = ["FusionRule", "NearMiss", "PatternReport", "RewriteRule", "get_pattern", "pattern_registry",
           "registered_patterns"]

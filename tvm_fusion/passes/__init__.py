"""Module passes and the phased pipeline that composes them."""

from .apply_rewrite_rules import ApplyRewriteRules
from .fuse_patterns import FusePatterns
from .pipeline import GRAPH_PHASES, fusion_pipeline, stock_fusion_pipeline

__all__ = ["GRAPH_PHASES", "ApplyRewriteRules", "FusePatterns", "fusion_pipeline", "stock_fusion_pipeline"]

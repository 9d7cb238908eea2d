"""Module passes and the phased pipeline that composes them."""

from .apply_rewrite_rules import ApplyRewriteRules
from .fuse_patterns import FusePatterns
from .pipeline import fusion_pipeline, stock_fusion_pipeline

__all__ = ["ApplyRewriteRules", "FusePatterns", "fusion_pipeline", "stock_fusion_pipeline"]

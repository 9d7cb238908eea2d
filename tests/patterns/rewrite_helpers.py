"""Apply one rewrite rule the way the pipeline's canonicalize phase does."""

from tvm import relax

from tvm_fusion.passes import ApplyRewriteRules
from tvm_fusion.patterns import PatternReport, get_pattern


def apply_rule(mod, name):
    report = PatternReport()
    mod = ApplyRewriteRules([get_pattern(name)], report)(mod)
    return relax.transform.DeadCodeElimination()(mod), report

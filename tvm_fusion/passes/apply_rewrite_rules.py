"""ApplyRewriteRules: replace exporter-decomposed op chains with the single op they spell."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import rewrite_call

from ..patterns.base import NearMiss, PatternReport, RewriteRule


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.ApplyRewriteRules")
class ApplyRewriteRules:
    """Runs each rule's variants over every Relax function, counting rewrites and near misses."""

    def __init__(self, rules: list[RewriteRule], report: PatternReport):
        self.rules = rules
        self.report = report

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gvar, func in list(mod.functions_items()):
            if not isinstance(func, relax.Function):
                continue
            for rule in self.rules:
                for root, named in rule.variants():
                    func = rewrite_call(root, self._rewriter(rule, named), func)
            mod[gvar] = func
        return mod

    def _rewriter(self, rule: RewriteRule, named):
        def rewrite(original, matchings):
            matched = {name: matchings[pattern] for name, pattern in named.items() if pattern in matchings}
            reason = rule.check(matched)
            if reason is not None:
                where = getattr(matched.get("x"), "name", "<expr>")
                self.report.add_near_miss(NearMiss(rule.name, f"on {where}", reason))
                return original
            self.report.fired[rule.name] += 1
            return rule.rewrite(matched)

        return rewrite

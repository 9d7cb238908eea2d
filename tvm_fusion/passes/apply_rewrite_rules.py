"""ApplyRewriteRules: replace exporter-decomposed op chains with the single op they spell."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import CallPattern, OrPattern, rewrite_call

from ..patterns.base import NearMiss, PatternInstance, PatternReport, RewriteRule, kernel_reason


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.ApplyRewriteRules")
class ApplyRewriteRules:
    """Runs each rule's variants over every Relax function, counting rewrites and near misses."""

    def __init__(self, rules: list[RewriteRule], report: PatternReport):
        self.rules = rules
        self.report = report

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # the caller's module (e.g. the stock-TVM baseline) must stay as it was
        for gvar, func in list(mod.functions_items()):
            if not isinstance(func, relax.Function):
                continue
            for rule in self.rules:
                for root, named in rule.variants():
                    func = rewrite_call(root, self._rewriter(rule, named, _LazyUses(func), mod), func)
            mod[gvar] = func
        return mod

    def _rewriter(self, rule: RewriteRule, named, lazy_uses: _LazyUses, mod: tvm.IRModule):
        def rewrite(original, matchings):
            uses = lazy_uses.get()
            matched = {name: matchings[pattern] for name, pattern in named.items() if pattern in matchings}
            # The variables of the matched calls; what a wildcard matched is an input, not absorbed.
            chain = {uses.var_of.get(expr) for pattern, expr in matchings.items()
                     if isinstance(pattern, CallPattern)} - {None}
            output = uses.bound_var(original)
            reason = (kernel_reason(rule.kernels, matched, mod) or rule.check(matched)
                      or uses.leak_reason(rule.exclusive, named, matched, chain, output))
            output_name = output.name if output is not None else "<expr>"
            if reason is not None:
                where = getattr(matched.get("x"), "name", "<expr>")
                self.report.add_near_miss(NearMiss(rule.name, f"on {where}", reason, output_name))
                return original
            self.report.fired[rule.name] += 1
            self.report.instances.append(PatternInstance(
                rule.name, rule.name, output_name, [var.name for var in uses.in_order(chain)]))
            return rule.rewrite(matched)

        return rewrite


class _LazyUses:
    """The ``BindingUses`` of a function, built at its first match: most variants match
    nowhere, and a walk of a decoder unrolled into 23,000 bindings per variant took 20 s."""

    def __init__(self, func: relax.Function):
        self.func, self.uses = func, None

    def get(self) -> BindingUses:
        if self.uses is None:
            self.uses = BindingUses(self.func)
        return self.uses


class BindingUses:
    """Which variable each value is bound to, and which bindings use each variable."""

    def __init__(self, func: relax.Function):
        self.order = list(relax.analysis.get_var2val(func).items())
        self.var_of = {value: var for var, value in self.order}
        self.users: dict[relax.Var, set] = {}
        for var, value in self.order:
            relax.analysis.post_order_visit(value, lambda e, user=var: self._note(e, user))
        relax.analysis.post_order_visit(func.body.body, lambda e: self._note(e, None))

    def _note(self, expr, user) -> None:
        if isinstance(expr, relax.Var):
            self.users.setdefault(expr, set()).add(user)

    def bound_var(self, expr: relax.Expr) -> relax.Var | None:
        return expr if isinstance(expr, relax.Var) else self.var_of.get(expr)

    def in_order(self, variables: set) -> list[relax.Var]:
        return [var for var, _ in self.order if var in variables]

    def leak_reason(self, names, named, matched, chain: set, output) -> str | None:
        """Why an ``exclusive`` intermediate cannot be absorbed (a consumer outside ``chain``)."""
        for name in names:
            if name not in matched or not isinstance(named[name], (CallPattern, OrPattern)):
                continue  # not matched in this variant, or an input (wildcard)
            var = self.var_of.get(matched[name])
            if var is None or (output is not None and var.same_as(output)):
                continue
            if any(user not in chain for user in self.users.get(var, ())):
                return f"the intermediate {name} ({var.name}) is also used outside the chain"
        return None

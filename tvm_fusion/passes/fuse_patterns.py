"""FusePatterns: group each matched chain into a composite that FuseTIR makes one kernel."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.tirx.analysis import undefined_vars

from .absorb_elementwise_tails import SUFFIX, absorb_elementwise_tails
from ..patterns.base import FusionRule, NearMiss, PatternInstance, PatternReport, binding_name


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.FusePatterns")
class FusePatterns:
    """FuseOpsByPattern over our rules, recording which fired and why the others declined."""

    def __init__(self, rules: list[FusionRule], report: PatternReport, excluded: frozenset[str] = frozenset()):
        self.rules = rules
        self.report = report
        # Binding names of instances the numeric gate (fusion_gate.py) undid: matches over them decline.
        self.excluded = excluded

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        declined: dict[str, NearMiss] = {}
        accepted: list[tuple[str, str, relax.Var, list[relax.Var]]] = []
        patterns = [
            relax.transform.FusionPattern(f"{rule.name}.{variant}", root, annotations,
                                          self._check(rule, declined, accepted, variant, self.excluded))
            for rule in self.rules
            for variant, root, annotations in rule.variants()
        ]
        position_values = {var: value for _, func in mod.functions_items() if isinstance(func, relax.Function)
                           for var, value in relax.analysis.get_var2val(func).items()}
        position = {var: index for index, var in enumerate(position_values)}
        # Weights are constants; binding them into the composite would stop FuseTIR
        # ("Tensor constants are not supported in primitive functions").
        mod = relax.transform.FuseOpsByPattern(patterns, bind_constants=False,
                                               annotate_codegen=False)(mod)
        mod = inline_shape_params(mod)
        instances = realized_instances(accepted, unfused_vars(mod), position)
        mod, tails = absorb_elementwise_tails(mod, {r.name for r in self.rules if r.absorbs_elementwise_tail})
        # FuseOpsByPattern renamed the composites' results; before it, a tail's first op read the
        # result under the name its instance recorded.
        by_output = {instance.output: instance for instance in instances}
        for tail in tails:
            instance = by_output[str(position_values[tail.first].args[tail.operand].name)]
            instance.variant += SUFFIX
            instance.output = tail.output
            instance.absorbed = [*instance.absorbed, *tail.absorbed]
        for composite in composite_calls(mod):
            self.report.fired[composite.split(".")[0]] += 1
            self.report.fired[composite] += 1
        self.report.instances.extend(instances)
        still_unfused = unfused_anchor_names(mod)
        for anchor, miss in declined.items():
            if anchor in still_unfused:
                self.report.add_near_miss(miss)
        return mod

    @staticmethod
    def _check(rule: FusionRule, declined: dict[str, NearMiss], accepted: list, variant: str,
               excluded: frozenset[str]):
        def check(context: relax.transform.PatternCheckContext) -> bool:
            undone = excluded and not excluded.isdisjoint(v.name for v in context.matched_bindings.keys())
            reason = "undone by the numeric gate" if undone else rule.check(context)
            if reason is None:
                output = context.value_to_bound_var.get(context.matched_expr)
                accepted.append((rule.name, variant, output, list(context.matched_bindings.keys())))
                return True
            anchor = binding_name(context, rule.anchor(context))
            declined.setdefault(anchor, NearMiss(rule.name, f"at {anchor}", reason, anchor))
            return False

        return check


def inline_shape_params(mod: tvm.IRModule) -> tvm.IRModule:
    """Put the symbolic shapes FuseOpsByPattern lifted into composite parameters back inline.

    A reshape target such as ``R.shape([1, sequence, 4, 64])`` is kept inside a composite only
    when it has no symbolic dim; otherwise it becomes a ``R.Shape`` parameter, which LegalizeOps
    cannot lower (a reshape needs its target shape in place). The parameter's type spells the
    shape, and ``sequence`` is defined by the composite's tensor parameters, so the shape can
    be written inline again and the parameter (and the call's argument) dropped.
    """
    replaced: dict = {}  # GlobalVar -> (the function without the shape parameters, their positions)
    for gvar, func in mod.functions_items():
        if not (isinstance(func, relax.Function) and func.attrs and "Composite" in func.attrs):
            continue
        defined = {dim for param in func.params if isinstance(param.ty, relax.TensorType)
                   and param.ty.shape is not None for dim in param.ty.shape.values if isinstance(dim, tirx.Var)}
        inline = {index: param for index, param in enumerate(func.params)
                  if isinstance(param.ty, relax.ShapeType) and param.ty.values is not None
                  and all(var in defined for dim in param.ty.values for var in undefined_vars(dim))}
        if inline:
            bound = func.bind_params({param: relax.ShapeExpr(param.ty.values) for param in inline.values()})
            replaced[gvar] = (bound, set(inline))
    if not replaced:
        return mod
    # New GlobalVars (the old ones' types still list the dropped parameters), same names.
    for gvar in replaced:
        del mod[gvar]
    builder = relax.BlockBuilder(mod)
    dropped = {gvar: (builder.add_func(func, gvar.name_hint), positions)
               for gvar, (func, positions) in replaced.items()}
    mod = builder.get()
    dropper = _DropArguments(mod, dropped)
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and not (func.attrs and "Composite" in func.attrs):
            mod[gvar] = dropper.visit_expr(func)
    return mod


@mutator
class _DropArguments(PyExprMutator):
    """Calls the replacement of each given function, without the given argument positions."""

    def __init__(self, mod: tvm.IRModule, dropped: dict):
        super().__init__(mod)
        self.dropped = dropped

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if call.op in self.dropped:
            new_gvar, positions = self.dropped[call.op]
            return relax.Call(new_gvar, [arg for i, arg in enumerate(call.args) if i not in positions],
                              call.attrs, call.ty_args)
        return call


def composite_calls(mod: tvm.IRModule) -> list[str]:
    """The Composite name of every call site of a fused composite in the module's Relax code."""
    composites = {gvar: func.attrs["Composite"] for gvar, func in mod.functions_items()
                  if isinstance(func, relax.Function) and func.attrs and "Composite" in func.attrs}
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op in composites:
            found.append(str(composites[expr.op]))

    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function) and gvar not in composites:
            relax.analysis.post_order_visit(func, visit)
    return found


def realized_instances(accepted: list, unfused: set, position: dict) -> list[PatternInstance]:
    """The accepted matches FuseOpsByPattern actually grouped, in the order it preferred them.

    A check may accept a match that a preferred overlapping one then claims; a match was
    realized if none of its bindings is still a plain op call and no earlier one took them.
    """
    taken: set = set()
    instances = []
    for rule, variant, output, bindings in accepted:
        if taken.isdisjoint(bindings) and unfused.isdisjoint(bindings):
            taken.update(bindings)
            instances.append(PatternInstance(rule, f"{rule}.{variant}",
                                             output.name if output is not None else "<expr>",
                                             [var.name for var in sorted(bindings, key=position.get)]))
    return instances


def unfused_vars(mod: tvm.IRModule) -> set:
    """The variables still bound to a plain op call outside any composite."""
    found = set()
    for _, func in mod.functions_items():
        if not isinstance(func, relax.Function) or (func.attrs and "Composite" in func.attrs):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding.value, relax.Call) and isinstance(binding.value.op, tvm.ir.Op):
                    found.add(binding.var)
    return found


def unfused_anchor_names(mod: tvm.IRModule) -> set[str]:
    """Names of the variables still bound to a plain op call outside any composite."""
    return {var.name for var in unfused_vars(mod)}

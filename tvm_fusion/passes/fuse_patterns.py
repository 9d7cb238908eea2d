"""FusePatterns: group each matched chain into a composite that FuseTIR makes one kernel."""

from __future__ import annotations

import collections

import tvm
from tvm import relax
from tvm.relax import dpl
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.tirx.analysis import undefined_vars

from .absorb_dequantized_inputs import SUFFIX as HEAD_SUFFIX, absorb_dequantized_inputs
from .absorb_elementwise_tails import SUFFIX, absorb_elementwise_tails
from .pooled_gates import merge_pooled_gates
from ..patterns.base import FusionRule, NearMiss, PatternInstance, PatternReport, binding_name, kernel_reason


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
        original = _OriginalVars(mod)
        # A variant needing an op the module does not call, or one op feeding another where none
        # does, cannot match: FuseOpsByPattern, a whole-graph walk per variant, is skipped for it
        # (an unrolled LSTM or decoder has thousands of bindings; the rules have hundreds of
        # variants, most of them conv and attention forms).
        present, edges = called_ops(mod), called_edges(mod)
        patterns = [
            relax.transform.FusionPattern(f"{rule.name}.{variant}", root, annotations,
                                          self._check(rule, declined, accepted, variant, self.excluded, original,
                                                      mod))
            for rule in self.rules
            for variant, root, annotations in rule.variants()
            if required_ops(root) <= present and required_edges(root) <= edges
        ]
        position_values = original.values
        position = {var: index for index, var in enumerate(position_values)}
        # What FuseOpsByPattern does with the whole list (patterns in order, each grouping the
        # matches left by the ones before), one pattern at a time, so that the shapes it lifted
        # into a composite's parameters are back inline before the next pattern looks: a
        # resize2d sized by a parameter has no known shape, nor would anything after it.
        # Weights are constants; binding them into the composite would stop FuseTIR
        # ("Tensor constants are not supported in primitive functions").
        seen: set = set()
        for pattern in patterns:
            mod = relax.transform.FuseOpsByPattern([pattern], bind_constants=False,
                                                   annotate_codegen=False)(mod)
            mod = _inline_new_shape_params(mod, seen)
        unfused = {original(var) for var in unfused_vars(mod)}
        instances = realized_instances(accepted, unfused, position)
        mod, tails = absorb_elementwise_tails(mod, {r.name for r in self.rules if r.absorbs_elementwise_tail})
        # FuseOpsByPattern renamed the composites' results; before it, a tail's first op read the
        # result under the name its instance recorded.
        by_output = {instance.output: instance for instance in instances}
        for tail in tails:
            first = position_values[original(tail.first)]
            instance = by_output[str(first.args[tail.operand].name)]
            instance.variant += SUFFIX
            instance.output = tail.output
            instance.absorbed = [*instance.absorbed, *tail.absorbed]
        mod, heads = absorb_dequantized_inputs(mod, {r.name for r in self.rules if r.absorbs_dequantized_input})
        by_output = {instance.output: instance for instance in instances}
        for head in heads:
            instance = by_output[head.output]
            instance.variant += HEAD_SUFFIX
            instance.absorbed = [*head.absorbed, *instance.absorbed]
        if any(rule.merges_pooled_gates for rule in self.rules):
            mod = merge_pooled_gates(mod, instances)
        for composite in composite_calls(mod):
            self.report.fired[composite.split(".")[0]] += 1
            self.report.variants[composite] += 1
        self.report.instances.extend(instances)
        still_unfused = unfused_anchor_names(mod)
        for anchor, miss in declined.items():
            if anchor in still_unfused:
                self.report.add_near_miss(miss)
        return mod

    @staticmethod
    def _check(rule: FusionRule, declined: dict[str, NearMiss], accepted: list, variant: str,
               excluded: frozenset[str], original: _OriginalVars, mod: tvm.IRModule):
        def check(context: relax.transform.PatternCheckContext) -> bool:
            undone = excluded and not excluded.isdisjoint(v.name for v in context.matched_bindings.keys())
            reason = ("undone by the numeric gate" if undone else
                      kernel_reason(rule.kernels, context.annotated_expr, mod) or rule.check(context))
            if reason is None:
                output = context.value_to_bound_var.get(context.matched_expr)
                accepted.append((rule.name, variant, output,
                                 [original(var) for var in context.matched_bindings.keys()]))
                return True
            anchor = binding_name(context, rule.anchor(context))
            declined.setdefault(anchor, NearMiss(rule.name, f"at {anchor}", reason, anchor))
            return False

        return check


class _OriginalVars:
    """The binding variable of the module before fusion that a variable of a later version stands for.

    FuseOpsByPattern and ``inline_shape_params`` re-emit the bindings after a composite whose
    result type changed, with new variables of the same name; the importer's names are unique,
    so a name found once before fusion identifies the binding.
    """

    def __init__(self, mod: tvm.IRModule):
        self.values = {var: value for _, func in mod.functions_items() if isinstance(func, relax.Function)
                       for var, value in relax.analysis.get_var2val(func).items()}
        names = collections.Counter(str(var.name) for var in self.values)
        self.by_name = {str(var.name): var for var in self.values if names[str(var.name)] == 1}

    def __call__(self, var: relax.Var) -> relax.Var:
        if var in self.values:
            return var
        return self.by_name.get(str(var.name), var)


def inline_shape_params(mod: tvm.IRModule) -> tvm.IRModule:
    """Put the symbolic shapes FuseOpsByPattern lifted into composite parameters back inline.

    A shape argument such as a reshape target ``R.shape([1, sequence, 4, 64])`` or a resize2d
    size ``R.shape([2 * (height_div32 * 2), ...])`` is kept inside a composite only when every
    var in it is defined by the composite's tensor parameters, where a var is defined only by a
    dim that is the var alone (``sequence``, not ``height_div32 * 2``); otherwise it becomes an
    ``R.Shape`` parameter, which LegalizeOps cannot lower (a reshape or resize needs its shape
    in place), and a resize given one has an unknown output shape. The parameter's type spells
    the shape; where its vars are defined by the other parameters (the tensors, or the
    ``tir_vars`` shape FuseOpsByPattern adds for vars that appear only inside expressions) it is
    written inline again, the parameter (and each call's argument) dropped, and the types
    after it inferred again.
    """
    return _inline_new_shape_params(mod, set())


def _inline_new_shape_params(mod: tvm.IRModule, seen: set) -> tvm.IRModule:
    """``inline_shape_params`` for the composites not in ``seen`` (which it extends)."""
    replaced: dict = {}  # GlobalVar -> (the function without the shape parameters, their positions)
    for gvar, func in mod.functions_items():
        if gvar in seen or not (isinstance(func, relax.Function) and func.attrs and "Composite" in func.attrs):
            continue
        seen.add(gvar)
        inline = _inlinable_shape_params(func)
        if inline:
            bound = func.bind_params({param: relax.ShapeExpr(param.ty.values) for param in inline.values()})
            # Re-infer the function's result: a resize sized by the parameter had none.
            bound = relax.Function(bound.params, bound.body, bound.body.ty, bound.is_pure, bound.attrs)
            replaced[gvar] = (bound, set(inline))
    if not replaced:
        return mod
    # New GlobalVars (the old ones' types still list the dropped parameters), same names.
    for gvar in replaced:
        del mod[gvar]
    builder = relax.BlockBuilder(mod)
    dropped = {gvar: (builder.add_func(func, gvar.name_hint), positions)
               for gvar, (func, positions) in replaced.items()}
    seen.update(new_gvar for new_gvar, _ in dropped.values())
    mod = builder.get()
    dropper = _DropArguments(mod, dropped)
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and not (func.attrs and "Composite" in func.attrs):
            mod[gvar] = dropper.visit_expr(func)
    return mod


def _inlinable_shape_params(func: relax.Function) -> dict:
    """{position: parameter} of the shape parameters the body uses as values (not the
    ``tir_vars`` one, which only defines vars) whose vars the other parameters define."""
    used = set(relax.analysis.free_vars(func.body))
    candidates = {index: param for index, param in enumerate(func.params)
                  if isinstance(param.ty, relax.ShapeType) and param.ty.values is not None and param in used}
    defined = {var for index, param in enumerate(func.params) if index not in candidates
               for var in relax.analysis.definable_tir_vars_in_type(param.ty)}
    return {index: param for index, param in candidates.items()
            if all(var in defined for dim in param.ty.values for var in undefined_vars(dim))}


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


def called_ops(mod: tvm.IRModule) -> set[str]:
    """Names of the ops the module's Relax functions call."""
    found: set[str] = set()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            found.add(expr.op.name)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return found


def called_edges(mod: tvm.IRModule) -> set[tuple[str, str]]:
    """(producer op, consumer op) for every op call that reads another op call's result."""
    found: set[tuple[str, str]] = set()
    for _, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        producers = {var: value.op.name for var, value in relax.analysis.get_var2val(func).items()
                     if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)}

        def visit(expr):
            if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
                for arg in expr.args:
                    producer = producers.get(arg) if isinstance(arg, relax.Var) else (
                        arg.op.name if isinstance(arg, relax.Call) and isinstance(arg.op, tvm.ir.Op) else None)
                    if producer:
                        found.add((producer, expr.op.name))

        relax.analysis.post_order_visit(func, visit)
    return found


def required_edges(pattern: dpl.DFPattern) -> frozenset[tuple[str, str]]:
    """(producer op, consumer op) pairs every match of ``pattern`` has: a call whose argument
    is a call of a known op (on both sides of an alternative)."""
    def at_call(call: dpl.CallPattern, args: list) -> frozenset:
        consumer = _head_op(call)
        return frozenset().union(*map(required_edges, args)) | {
            (producer, consumer) for producer in map(_head_op, args) if producer and consumer}

    return _every_match(pattern, at_call, required_edges)


def _head_op(pattern: dpl.DFPattern) -> str | None:
    """The op of the call every match of ``pattern`` is, if it is one known op."""
    if isinstance(pattern, dpl.CallPattern):
        op = pattern.op
        return op.expr.name if isinstance(op, dpl.ExprPattern) and isinstance(op.expr, tvm.ir.Op) else None
    if isinstance(pattern, dpl.OrPattern):
        left = _head_op(pattern.left)
        return left if left == _head_op(pattern.right) else None
    if isinstance(pattern, (dpl.AttrPattern, dpl.DataTypePattern, dpl.ShapePattern, dpl.TypePattern)):
        return _head_op(pattern.pattern)
    return None


def required_ops(pattern: dpl.DFPattern) -> frozenset[str]:
    """The ops every match of ``pattern`` calls: those of its calls, except where an alternative
    (``|``) needs only those both sides need. Patterns of other kinds require none."""
    def at_call(call: dpl.CallPattern, args: list) -> frozenset:
        own = {_head_op(call)} - {None}
        return frozenset(own).union(*map(required_ops, args))

    return _every_match(pattern, at_call, required_ops)


def _every_match(pattern: dpl.DFPattern, at_call, required) -> frozenset:
    """What every match of ``pattern`` has: ``at_call(call, its args)`` for a call pattern,
    what both sides of an alternative have, what any part of a conjunction, tuple or wrapper
    has (``required`` applied to the parts)."""
    if isinstance(pattern, dpl.CallPattern):
        return at_call(pattern, list(pattern.args or ()))
    if isinstance(pattern, dpl.OrPattern):
        return required(pattern.left) & required(pattern.right)
    if isinstance(pattern, dpl.AndPattern):
        return required(pattern.left) | required(pattern.right)
    if isinstance(pattern, (dpl.TuplePattern, dpl.UnorderedTuplePattern)):
        return frozenset().union(*map(required, pattern.fields))
    if isinstance(pattern, dpl.TupleGetItemPattern):
        return required(pattern.tuple)
    if isinstance(pattern, (dpl.AttrPattern, dpl.DataTypePattern, dpl.ShapePattern, dpl.TypePattern)):
        return required(pattern.pattern)
    return frozenset()


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
                                             [var.name for var in sorted(bindings, key=lambda var: position.get(var, len(position)))]))
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

"""Relax bindings: re-emitting one under a mutator (the new variable keeps the old one's kind),
running a mutator over a module's functions (or a rewrite over their blocks, or replacing single
bound values), and the variables an expression reads."""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator


def rebind(builder: relax.BlockBuilder, old: relax.Var, value: relax.Expr, name: str | None = None) -> relax.Var:
    """``value`` bound to a new variable named ``name`` (default: ``old``'s) of ``old``'s kind:
    a graph output (a plain Var in a dataflow block) stays an output."""
    value = builder.normalize(value)
    var = (relax.DataflowVar if isinstance(old, relax.DataflowVar) else relax.Var)(str(name or old.name), value.ty)
    builder.emit_normalized(relax.VarBinding(var, value))
    return var


def mutate_functions(mod: tvm.IRModule, mutator) -> tvm.IRModule:
    """A copy of ``mod`` with each Relax function but the fused composites visited by
    ``mutator(mod)`` (a PyExprMutator class); ``mod`` itself is left as it was."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and not (func.attrs and "Composite" in func.attrs):
            mod[gvar] = mutator(mod).visit_expr(func)
    return mod


def rewrite_blocks(mod: tvm.IRModule, rewrite_block: Callable[[relax.BindingBlock], relax.BindingBlock]) -> tvm.IRModule:
    """A copy of ``mod`` with each binding block of its Relax functions but the fused composites
    put through ``rewrite_block`` (which returns the block itself to keep it), normalized where
    one changed; ``mod`` itself is left as it was."""
    mod = mod.clone()
    changed = False
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and not (func.attrs and "Composite" in func.attrs):
            blocks = [rewrite_block(block) for block in func.body.blocks]
            if not all(new.same_as(old) for new, old in zip(blocks, func.body.blocks)):
                mod[gvar] = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                                           func.is_pure, func.attrs)
                changed = True
    return relax.transform.Normalize()(mod) if changed else mod


def replace_values(mod: tvm.IRModule, replace: Callable[[relax.Expr], relax.Expr | None]) -> tvm.IRModule:
    """A copy of ``mod`` with each bound value ``v`` (its operands already replaced) bound to
    ``replace(v)`` instead, where that is not None."""
    return mutate_functions(mod, lambda module: _ValueReplacer(module, replace))


@mutator
class _ValueReplacer(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, replace: Callable[[relax.Expr], relax.Expr | None]):
        super().__init__(mod)
        self.replace = replace

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        replaced = self.replace(value)
        self.set_var_remap(binding.var, rebind(self.builder_, binding.var, value if replaced is None else replaced))


def vars_in(expr: relax.Expr) -> set:
    """Every variable ``expr`` refers to."""
    found = set()
    relax.analysis.post_order_visit(expr, lambda e: found.add(e) if isinstance(e, relax.Var) else None)
    return found


def readers_of(bindings) -> dict:
    """Variable -> the bindings, in order, whose values read it (calls, tuples, aliases alike)."""
    readers: dict = {}
    for binding in bindings:
        for var in vars_in(binding.value):
            readers.setdefault(var, []).append(binding)
    return readers


def composites_of(mod: tvm.IRModule, rule_names: set[str] | None = None) -> dict:
    """GlobalVar -> function of every composite in ``mod`` (of the rules ``rule_names`` only, when given)."""
    return {gvar: func for gvar, func in mod.functions_items()
            if isinstance(func, relax.Function) and func.attrs and "Composite" in func.attrs
            and (rule_names is None or str(func.attrs["Composite"]).split(".")[0] in rule_names)}


def users_by_index(bindings: list) -> dict:
    """Variable -> the indices of the bindings whose values read it."""
    users: dict = {}
    for index, binding in enumerate(bindings):
        for var in vars_in(binding.value):
            users.setdefault(var, set()).add(index)
    return users


def with_main_blocks(builder: relax.BlockBuilder, mod: tvm.IRModule, blocks: list, replaced) -> tvm.IRModule:
    """``builder``'s module (``mod`` and the functions a pass added) with ``main``'s body made of
    ``blocks``, less those of the ``replaced`` functions (GlobalVars) that nothing calls any more:
    the composites a pass grew or merged into new ones."""
    main = mod["main"]
    builder.update_func(mod.get_global_var("main"), relax.Function(
        main.params, relax.SeqExpr(blocks, main.body.body), main.ret_ty, main.is_pure, main.attrs))
    result = builder.get()
    called: set = set()
    for _, func in result.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: called.add(e) if isinstance(e, relax.GlobalVar) else None)
    for gvar in [gvar for gvar in replaced if gvar not in called]:
        del result[gvar]
    return relax.transform.Normalize()(result)

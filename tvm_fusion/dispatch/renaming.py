"""One module's functions added to another under new names, every call following: how each
build that a dispatching ``main`` calls keeps its kernels apart from the others'.

TVM is imported inside the functions, as in the rest of this package (``buckets.py``).
"""

from __future__ import annotations


def add_renamed(builder, module, rename):
    """Add every function of ``module`` under ``rename(name)``, calls and global symbols
    following; the GlobalVar of the renamed ``main``."""
    from tvm import relax, tirx  # deferred: keeps TVM out of --help (module docstring)

    renamed = {}
    for gvar, func in module.functions_items():
        new_name = rename(gvar.name_hint)
        if isinstance(func, tirx.PrimFunc):
            renamed[gvar] = builder.add_func(func.with_attr("global_symbol", new_name), new_name)
        else:
            renamed[gvar] = builder.add_func(func, new_name)
    mutator = _renamer(renamed)
    for gvar, func in module.functions_items():
        if isinstance(func, relax.Function):
            body = mutator.visit_expr(func)
            if body.attrs and "global_symbol" in body.attrs:
                body = body.with_attr("global_symbol", renamed[gvar].name_hint)
            builder.update_func(renamed[gvar], body)
    return renamed[module.get_global_var("main")]


def _renamer(renamed):
    """A mutator pointing calls (and ``call_tir``'s kernel argument) at the renamed GlobalVars."""
    from tvm import relax  # deferred: keeps TVM out of --help (module docstring)

    @relax.expr_functor.mutator
    class GlobalVarRenamer(relax.PyExprMutator):
        def visit_global_var_(self, op):
            return renamed.get(op, op)

    return GlobalVarRenamer()

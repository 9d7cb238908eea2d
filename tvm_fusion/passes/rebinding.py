"""Relax bindings: re-emitting one under a mutator (the new variable keeps the old one's kind),
and the variables an expression reads."""

from __future__ import annotations

from tvm import relax


def rebind(builder: relax.BlockBuilder, old: relax.Var, value: relax.Expr, name: str | None = None) -> relax.Var:
    """``value`` bound to a new variable named ``name`` (default: ``old``'s) of ``old``'s kind:
    a graph output (a plain Var in a dataflow block) stays an output."""
    value = builder.normalize(value)
    var = (relax.DataflowVar if isinstance(old, relax.DataflowVar) else relax.Var)(str(name or old.name), value.ty)
    builder.emit_normalized(relax.VarBinding(var, value))
    return var


def vars_in(expr: relax.Expr) -> set:
    """Every variable ``expr`` refers to."""
    found = set()
    relax.analysis.post_order_visit(expr, lambda e: found.add(e) if isinstance(e, relax.Var) else None)
    return found

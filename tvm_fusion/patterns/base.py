"""The two kinds of pattern modules and what they report.

A pattern module holds one fusion concept: its dataflow pattern, a check that says *why*
it declines (so ``inspect`` can show near misses), and its replacement.

* ``RewriteRule``: recognizes an exporter-decomposed op chain and replaces it with the single
  Relax op it spells (e.g. the Div/Erf/Add/Mul/Mul chain -> ``R.nn.gelu``). Rewrites run first
  so that fusions see one op instead of five.
* ``FusionRule``: groups a chain of Relax ops into one composite function that FuseTIR turns
  into one kernel (e.g. matmul + bias + GELU + residual add).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping

from tvm import relax
from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import DFPattern


@dataclasses.dataclass
class NearMiss:
    """A place where a pattern matched structurally but its check declined."""

    pattern: str
    where: str
    reason: str
    var: str = ""  # the anchor binding's variable name (inspect maps it to an ONNX node)


@dataclasses.dataclass
class PatternInstance:
    """One place a pattern fired, with the bindings (variable names) it absorbed."""

    pattern: str
    variant: str
    output: str  # the variable now bound to the replacement (a rewrite's op, a composite call)
    absorbed: list[str]


@dataclasses.dataclass
class PatternReport:
    """What the pattern passes did to one module: fired counts, instances and near misses."""

    fired: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)
    instances: list[PatternInstance] = dataclasses.field(default_factory=list)

    def add_near_miss(self, miss: NearMiss) -> None:
        if all((m.pattern, m.where) != (miss.pattern, miss.where) for m in self.near_misses):
            self.near_misses.append(miss)


class RewriteRule:
    """One graph rewrite: ``pattern`` + ``check`` (reason or None) + ``rewrite``.

    ``variants()`` yields ``(root, named)`` where ``named`` maps the names that ``check`` and
    ``rewrite`` read to sub-patterns; several variants cover the operand orders exporters emit.
    """

    name: str = ""
    description: str = ""
    # Named intermediates that must have no consumer outside the match: rewriting the chain
    # would leave them computed anyway (declined as "... is also used outside the chain").
    exclusive: tuple[str, ...] = ()

    def variants(self) -> list[tuple[DFPattern, dict[str, DFPattern]]]:
        raise NotImplementedError

    def check(self, matched: Mapping[str, relax.Expr]) -> str | None:
        """Return None to accept the match, or the reason it is declined."""
        return None

    def rewrite(self, matched: Mapping[str, relax.Expr]) -> relax.Expr:
        raise NotImplementedError


class FusionRule:
    """One fusion: pattern variants grouped into a composite that becomes one kernel.

    ``variants()`` yields ``(variant_name, root, annotations)``, longest first: where several
    variants match at one place FuseOpsByPattern takes the first whose check accepts.
    ``check(context)`` returns None to fuse, or the reason it declines.
    """

    name: str = ""
    description: str = ""
    # Epilogue fusions: element-wise ops after the match (constants, one residual) join the
    # composite too (passes/absorb_elementwise_tails.py).
    absorbs_elementwise_tail: bool = False

    def variants(self) -> list[tuple[str, DFPattern, dict[str, DFPattern]]]:
        raise NotImplementedError

    def check(self, context: relax.transform.PatternCheckContext) -> str | None:
        return None

    def anchor(self, context: relax.transform.PatternCheckContext) -> relax.Expr:
        """The expression that identifies a match site (for near-miss bookkeeping)."""
        return context.matched_expr


# Helpers shared by the pattern modules ---------------------------------------------------

def scalar_constant(expr: relax.Expr) -> float | None:
    """The value of a one-element constant, or None if ``expr`` is not one."""
    value = getattr(expr, "value", None)
    if value is None or not hasattr(value, "numpy"):
        return None
    array = value.numpy()
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def close_to(value: float | None, expected: float, rel: float = 1e-4) -> bool:
    return value is not None and abs(value - expected) <= rel * max(1.0, abs(expected))


def static_shape(expr: relax.Expr) -> tuple[int, ...] | None:
    """The static shape of a tensor-typed expression, or None if any dim is symbolic."""
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    if shape is None:
        return None
    dims = []
    for dim in shape:
        if not hasattr(dim, "value"):
            return None
        dims.append(int(dim.value))
    return tuple(dims)


def dtype_of(expr: relax.Expr) -> str | None:
    return getattr(getattr(expr, "ty", None), "dtype", None)


FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def non_float_reason(expr: relax.Expr) -> str | None:
    """The decline reason for a non-float operand (activation rewrites are float-only), else None."""
    dtype = dtype_of(expr)
    return None if dtype in FLOAT_DTYPES else f"dtype {dtype} is not a float type"


def residual_or_leak_reason(context: relax.transform.PatternCheckContext, dtype: str) -> str | None:
    """The epilogue fusions' shared last checks: a residual of the output's exact shape and
    dtype (no broadcast that would grow the output), and no intermediate used outside."""
    found = context.annotated_expr
    if "residual" in found:
        out_full = static_shape(context.matched_expr)
        if static_shape(found["residual"]) != out_full:
            return (f"residual shape {static_shape(found['residual'])} does not equal the "
                    f"output shape {out_full}")
        if dtype_of(found["residual"]) != dtype:
            return f"residual dtype {dtype_of(found['residual'])} differs from {dtype}"
    if has_leaking_intermediate_variables(context):
        return "an intermediate result is also used outside the chain"
    return None


def binding_name(context: relax.transform.PatternCheckContext, expr: relax.Expr) -> str:
    var = context.value_to_bound_var.get(expr)
    return var.name if var is not None else "<expr>"


CheckFn = Callable[[relax.transform.PatternCheckContext], bool]

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
import re
from collections.abc import Callable, Mapping

import numpy as np
import tvm_ffi
from tvm import relax
from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import DFPattern
from tvm.sym.analyzer import Analyzer

from ..kernels import KERNEL_ATTR, kernel_kind


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
    """What the pattern passes did to one module: fired counts, instances and near misses.

    ``fired`` counts fusions by pattern (``gemm_epilogue``: each fusion once); ``variants`` by
    pattern and variant (``gemm_epilogue.matmul_bias_gelu``), with the layout conversions."""

    fired: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    variants: collections.Counter = dataclasses.field(default_factory=collections.Counter)
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
    # Declared order among the rewrites (names of other patterns); the registry sorts by it.
    runs_before: tuple[str, ...] = ()
    runs_after: tuple[str, ...] = ()
    # Named intermediates that must have no consumer outside the match: rewriting the chain
    # would leave them computed anyway (declined as "... is also used outside the chain").
    exclusive: tuple[str, ...] = ()
    # Named callees (a call_tir's PrimFunc) that must carry this ``tvm_fusion.kernel`` attribute
    # (kernels.KERNEL_ATTR): the rule accepts only the kernels we emitted, whatever their name.
    kernels: Mapping[str, str] = {}

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
    # Declared order among the fusions: where two match at one place, the earlier one takes it.
    runs_before: tuple[str, ...] = ()
    runs_after: tuple[str, ...] = ()
    # Epilogue fusions: element-wise ops after the match (constants, one residual) join the
    # composite too (passes/absorb_elementwise_tails.py).
    absorbs_elementwise_tail: bool = False
    # Convs computed in float32 on a quantized map: the map's dequantization (a cast of its bytes,
    # less scalar constants) joins the composite (passes/absorb_dequantized_inputs.py).
    absorbs_dequantized_input: bool = False
    # The squeeze-and-excitation gate: also as any ops spell it on the pooled values, after the
    # patterns (passes/pooled_gates.py).
    merges_pooled_gates: bool = False
    # As RewriteRule.kernels: named callees that must be our kernels of these kinds.
    kernels: Mapping[str, str] = {}

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


def strided_slice_fields(call: relax.Call) -> list[list[int]] | None:
    """A strided_slice's axes, begin, end and strides as ints (strides 1 where absent), or None
    where one is symbolic."""
    try:
        fields = [[int(v) for v in arg.fields] for arg in call.args[1:]]
    except (AttributeError, TypeError):
        return None
    return fields if len(fields) == 4 else [*fields, [1] * len(fields[0])]


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


def shape_dims(expr: relax.Expr) -> tuple | None:
    """The shape of a tensor-typed expression, dim by dim: an int where the dim is static, the
    symbolic PrimExpr (``sequence``, ``height // 2``) where it is not; None if the rank is unknown.

    Checks that only need dims to agree (a residual of the output's shape) or a few dims to be
    static (a softmax's reduced axis) read this, so a module compiled for a range of sizes fuses
    like a static one.
    """
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    values = getattr(shape, "values", shape)
    if values is None:
        return None
    try:
        return tuple(int(dim.value) if hasattr(dim, "value") else dim for dim in values)
    except TypeError:
        return None


def same_dims(first: tuple | None, second: tuple | None) -> bool:
    """True if two ``shape_dims`` answers are provably the same shape (symbolic dims compared
    structurally: ``sequence`` equals ``sequence``, not ``sequence2``)."""
    if first is None or second is None or len(first) != len(second):
        return False
    return all(same_dim(a, b) for a, b in zip(first, second))


def same_dim(first, second) -> bool:
    """One dim of ``same_dims``: equal ints, or structurally equal symbolic expressions."""
    if isinstance(first, int) or isinstance(second, int):
        return isinstance(first, int) and isinstance(second, int) and first == second
    return tvm_ffi.structural_equal(first, second)


def broadcasts_to(dims: tuple | None, target: tuple | None) -> bool:
    """True if ``dims`` provably broadcasts to ``target`` without growing it (numpy rules): each
    trailing dim is 1 or the same as the target's (``sequence`` matches only ``sequence``)."""
    if dims is None or target is None or len(dims) > len(target):
        return False
    return all(same_dim(d, 1) or same_dim(d, t) for d, t in zip(reversed(dims), reversed(target)))


def same_size(first: tuple, second: tuple) -> bool:
    """True if two shapes provably hold as many elements (``(1, n, 4)`` and ``(4 * n,)``)."""
    def product(dims):
        total = 1
        for dim in dims:
            total = total * dim
        return total

    left, right = product(first), product(second)
    if isinstance(left, int) and isinstance(right, int):
        return left == right
    return bool(Analyzer().can_prove_equal(left, right))


def symbolic_dim_reason(what: str, dims: tuple | None, axes=None, role: str = "") -> str | None:
    """Why the dims of ``what`` at ``axes`` (all of them by default) are not all static, naming the
    first symbolic one (and its ``role``, e.g. "K"); None when they are. For the dims a fused
    kernel is built around (a normalized row, a GEMM's K and N, attention's head dim), which a
    module compiled for a range of sizes cannot leave open."""
    if dims is None:
        return f"the {what} has no known shape"
    for axis in range(len(dims)) if axes is None else axes:
        dim = dims[axis]
        if not isinstance(dim, int):
            named = f" ({role})" if role else ""
            return (f"the {what} {dims_text(dims)} has the symbolic dim {dims_text((dim,))[1:-1]} at axis "
                    f"{axis % len(dims)}{named}: the kernel needs it static (bind it)")
    return None


def dims_text(dims: tuple | None) -> str:
    """``(1, sequence, 256)`` for messages (``8 * n``, not ``T.int64(8) * n``)."""
    if dims is None:
        return "unknown"
    return "(" + ", ".join(re.sub(r"T\.int(?:32|64)\((-?\d+)\)", r"\1", str(d)) for d in dims) + ")"


def dtype_of(expr: relax.Expr) -> str | None:
    return getattr(getattr(expr, "ty", None), "dtype", None)


def whole_numbers(values: np.ndarray) -> bool:
    """Every value a whole number: a quantized op's centered weights or zero points (its float32
    sums of them are exact), a resize's integer scales."""
    return bool(np.all(values == np.round(values)))


FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def constants_reason(matched: Mapping[str, relax.Expr], expected: Mapping[str, tuple[float, str]]) -> str | None:
    """The message of the first named scalar constant not close to its expected value, or None.
    ``expected``: name -> (value, message), checked in order."""
    for name, (value, message) in expected.items():
        if not close_to(scalar_constant(matched[name]), value):
            return message
    return None


def unsupported_dtype_reason(expr: relax.Expr) -> str | None:
    """The decline reason of a kernel that computes in float types only, else None."""
    dtype = dtype_of(expr)
    return None if dtype in FLOAT_DTYPES else f"dtype {dtype} is not supported ({', '.join(FLOAT_DTYPES)})"


def non_float_reason(expr: relax.Expr) -> str | None:
    """The decline reason for a non-float operand (activation rewrites are float-only), else None."""
    dtype = dtype_of(expr)
    return None if dtype in FLOAT_DTYPES else f"dtype {dtype} is not a float type"


def residual_or_leak_reason(context: relax.transform.PatternCheckContext, dtype: str) -> str | None:
    """The epilogue fusions' shared last checks: a residual of the output's exact shape and
    dtype (no broadcast that would grow the output, either way round; symbolic dims must be the
    same: ``sequence`` with ``sequence``), and no intermediate used outside."""
    found = context.annotated_expr
    if "residual" in found:
        add = found.get("residual_add", context.matched_expr)
        sum_dims, residual_dims = shape_dims(add), shape_dims(found["residual"])
        # Both operands of the add (the chain's result and the residual) must have the sum's
        # shape: a broadcast either way would change what the kernel writes.
        operand_dims = [shape_dims(arg) for arg in getattr(add, "args", ())]
        if not same_dims(residual_dims, sum_dims) or not all(same_dims(d, sum_dims) for d in operand_dims):
            out_dims = next((d for d in operand_dims if not same_dims(d, residual_dims)), sum_dims)
            return (f"residual shape {dims_text(residual_dims)} does not equal the "
                    f"output shape {dims_text(out_dims)}")
        if dtype_of(found["residual"]) != dtype:
            return f"residual dtype {dtype_of(found['residual'])} differs from {dtype}"
    if has_leaking_intermediate_variables(context):
        return "an intermediate result is also used outside the chain"
    return None


def binding_name(context: relax.transform.PatternCheckContext, expr: relax.Expr) -> str:
    var = context.value_to_bound_var.get(expr)
    return var.name if var is not None else "<expr>"


CheckFn = Callable[[relax.transform.PatternCheckContext], bool]


def kernel_reason(kernels: Mapping[str, str], matched: Mapping[str, relax.Expr], mod) -> str | None:
    """Why a matched callee is not the kernel ``kernels`` (role -> kind) names for it, or None."""
    for role, kind in kernels.items():
        if role in matched and kernel_kind(mod, matched[role]) != kind:
            name = getattr(matched[role], "name_hint", "<expr>")
            return f"kernel {name!r} is not our {kind} kernel (its {KERNEL_ATTR} attribute is not {kind!r})"
    return None

"""EinsumAsMatmul: every Einsum that is a (batched) contraction computed as a matmul.

Exporters write attention and dense layers as Einsum (torch.export's ``bhqd,bhkd->bhqk``,
jax2tf's ``...ij,jk->...ik``, heads-transposed ``bqhd,bkhd->bhqk``). Left as one, it lowers to
a generic reduction kernel that no pattern reads and no contraction rule schedules, at a few
percent of the machine's roof. As ``permute_dims``/``reshape`` around one ``matmul`` the
attention and gemm patterns fuse it and the matmul rules schedule it.

Each index of a two-operand equation is a batch index (both operands and the output), a
contracted one (both operands only) or a free one (one operand and the output). The left
operand is put in (batch, free, contracted) order, the right one in (batch, contracted, free),
several contracted or free indices are merged by a reshape, and the product is put back in the
output's order. An equation of three or more operands is contracted pairwise, left to right;
one of one operand (a transpose, a sum over indices) becomes ``permute_dims``/``sum``, as does an index
that one operand alone has and the output has not. An index repeated within one operand (a
trace, a diagonal) keeps the Einsum.
"""

from __future__ import annotations

import dataclasses
import string

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .rebinding import mutate_functions, rebind

EINSUM = "relax.einsum"


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.EinsumAsMatmul")
class EinsumAsMatmul:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_functions(mod, _Rewriter)


@dataclasses.dataclass(frozen=True)
class Equation:
    """An einsum equation with ``...`` expanded: one list of index names per operand, and the output's."""

    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]

    def text(self) -> str:
        return ",".join("".join(term) for term in self.inputs) + "->" + "".join(self.output)


def parse_equation(subscripts: str, ranks: list[int]) -> Equation | None:
    """``subscripts`` for operands of ``ranks``, ``...`` given one letter per dim (aligned from the
    right, as numpy broadcasts them), the implicit output made explicit; None if malformed."""
    text = subscripts.replace(" ", "")
    left, arrow, right = text.partition("->")
    terms = left.split(",")
    if len(terms) != len(ranks):
        return None
    used = set(text) - set(",->.")
    spare = [c for c in string.ascii_letters if c not in used]
    ellipsis_rank = max((rank - len(term.replace("...", "")) for term, rank in zip(terms, ranks)
                         if "..." in term), default=0)
    if ellipsis_rank > len(spare):
        return None
    broadcast = spare[:ellipsis_rank]
    inputs = []
    for term, rank in zip(terms, ranks):
        explicit = term.replace("...", "")
        if "..." in term:
            count = rank - len(explicit)
            if count < 0:
                return None
            head, _, tail = term.partition("...")
            indices = [*head, *broadcast[ellipsis_rank - count:], *tail]
        else:
            indices = list(term)
        if len(indices) != rank or not all(c in string.ascii_letters for c in indices):
            return None
        inputs.append(tuple(indices))
    if arrow:
        head, dots, tail = right.partition("...")
        output = [*head, *(broadcast if dots else []), *tail]
    else:  # implicit: the broadcast dims, then the indices used once, in alphabetical order
        counts = {}
        for term in inputs:
            for c in term:
                counts[c] = counts.get(c, 0) + 1
        output = [*broadcast, *sorted(c for c, n in counts.items() if n == 1 and c not in broadcast)]
    if not all(c in string.ascii_letters for c in output) or len(set(output)) != len(output):
        return None
    if any(c not in {i for term in inputs for i in term} for c in output):
        return None
    return Equation(tuple(inputs), tuple(output))


@mutator
class _Rewriter(PyExprMutator):
    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        old = binding.var
        replacement = _as_matmuls(self.builder_, value) if _is_einsum(value) else None
        self.set_var_remap(old, rebind(self.builder_, old, replacement if replacement is not None else value))


def _is_einsum(value) -> bool:
    return isinstance(value, relax.Call) and value.op == tvm.ir.Op.get(EINSUM)


def _as_matmuls(builder: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    """The einsum ``call`` as matmuls, transposes and reshapes, or None where it is none."""
    operands = list(call.args[0].fields)
    shapes = [_shape(op) for op in operands]
    if any(shape is None for shape in shapes):
        return None
    equation = parse_equation(str(call.attrs.subscripts), [len(shape) for shape in shapes])
    if equation is None or any(len(set(term)) != len(term) for term in equation.inputs):
        return None
    terms = list(equation.inputs)
    values = list(operands)
    while len(values) > 2:  # left to right, keeping what a later operand or the output reads
        later = {c for term in terms[2:] for c in term} | set(equation.output)
        kept = tuple(c for c in dict.fromkeys(terms[0] + terms[1]) if c in later)
        product = _contract(builder, values[0], values[1], terms[0], terms[1], kept)
        values[:2], terms[:2] = [builder.emit(product)], [kept]
    if len(values) == 1:
        return _reduce(values[0], terms[0], equation.output)
    return _contract(builder, values[0], values[1], terms[0], terms[1], equation.output)


def _shape(expr: relax.Expr) -> list | None:
    ty = expr.ty
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return list(ty.shape.values)
    return None


def _reduce(value: relax.Expr, term: tuple[str, ...], output: tuple[str, ...]) -> relax.Expr:
    """One operand: the indices not in the output summed away, the rest put in its order."""
    summed = [axis for axis, c in enumerate(term) if c not in output]
    rest = [c for c in term if c in output]
    if summed:
        value = relax.op.sum(value, axis=summed)
    order = [rest.index(c) for c in output]
    return relax.op.permute_dims(value, order) if order != list(range(len(order))) else value


def _contract(builder: relax.BlockBuilder, left: relax.Expr, right: relax.Expr, left_term: tuple[str, ...],
              right_term: tuple[str, ...], output: tuple[str, ...]) -> relax.Expr:
    """``left`` and ``right`` contracted into ``output`` by one matmul (an index that one operand
    alone has and the output has not is summed away first)."""
    both = set(left_term) & set(right_term)
    left, left_term = _sum_alone(builder, left, left_term, both, output)
    right, right_term = _sum_alone(builder, right, right_term, both, output)
    batch = [c for c in output if c in both]
    contracted = [c for c in left_term if c in both and c not in output]
    left_free = [c for c in left_term if c not in both]
    right_free = [c for c in right_term if c not in both]
    left_size, right_size = dict(zip(left_term, _shape(left))), dict(zip(right_term, _shape(right)))
    size = {**right_size, **left_size}

    def arranged(value, term, order, shape_of, merged):
        """``value`` in ``order``, then each group of ``merged`` (tuples of indices) as one dim."""
        perm = [term.index(c) for c in order]
        if perm != list(range(len(perm))):
            value = builder.emit(relax.op.permute_dims(value, perm))
        dims = [_product([shape_of[c] for c in group]) for group in merged]
        if len(dims) != len(order):
            value = builder.emit(relax.op.reshape(value, dims))
        return value

    # A left operand with no batch index keeps its free indices as leading dims: matmul
    # broadcasts them, and a dense layer stays (rows, in) @ (in, out).
    left_groups = [(c,) for c in batch]
    if batch:
        left_groups.append(tuple(left_free))
    else:
        left_groups += [(c,) for c in left_free]
    left_groups.append(tuple(contracted))
    right_groups = [(c,) for c in batch] + [tuple(contracted), tuple(right_free)]
    a = arranged(left, left_term, batch + left_free + contracted, left_size, left_groups)
    b = arranged(right, right_term, batch + contracted + right_free, right_size, right_groups)
    # The last step is returned, not emitted: it is bound to the einsum's own variable.
    steps = [relax.op.matmul(a, b)]
    produced = batch + left_free + right_free
    product_rank = len(batch) + (1 if batch else len(left_free)) + 1
    if product_rank != len(produced):
        batch_dims = builder.normalize(steps[-1]).ty.shape.values[:len(batch)]  # broadcast sizes
        steps.append(lambda x: relax.op.reshape(x, [*batch_dims, *(size[c] for c in left_free + right_free)]))
    order = [produced.index(c) for c in output]
    if order != list(range(len(order))):
        steps.append(lambda x: relax.op.permute_dims(x, order))
    result = steps[0]
    for step in steps[1:]:
        result = step(builder.emit(result))
    return result


def _sum_alone(builder: relax.BlockBuilder, value: relax.Expr, term: tuple[str, ...], both: set[str],
               output: tuple[str, ...]) -> tuple[relax.Expr, tuple[str, ...]]:
    """``value`` with the indices neither the other operand nor the output has summed away."""
    alone = [axis for axis, c in enumerate(term) if c not in both and c not in output]
    if not alone:
        return value, term
    return builder.emit(relax.op.sum(value, axis=alone)), tuple(c for c in term if c in both or c in output)


def _product(dims: list):
    result = 1
    for dim in dims:
        result = result * dim
    return result

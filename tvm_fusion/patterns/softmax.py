"""Softmax with its element-wise prologue (scale, causal Where, additive mask) and epilogue.

TVM's FuseOps fuses element-wise ops *after* a softmax into it, but not the ones before it:
``x / s + mask -> softmax`` is two kernels and the logits make a round trip through memory.
As one composite, the ``Softmax`` CPU schedule computes the prologue, both row reductions,
the normalization and the epilogue per row, reading the inputs and writing the output once.
Attention blocks are taken by the ``attention`` pattern first; this one covers the softmaxes
left (attention forms it declines, classifier heads, scaled logits).
"""

from __future__ import annotations

import itertools

from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import is_op, wildcard

from .base import FLOAT_DTYPES, FusionRule, dims_text, dtype_of, same_dims, shape_dims, symbolic_dim_reason

EPILOGUES = {
    "multiply": lambda x, operand: is_op("relax.multiply")(x, operand),
    "astype": lambda x, _operand: is_op("relax.astype")(x),
}


# The two spellings of a select-mask, by the name variants carry: ``where(keep, x, fill)``
# (GPT-2's causal triangle) and ``where(masked, fill, x)`` (torch's ``masked_fill``).
WHERE_MASKS = ("causal", "masked_fill")


def softmax_pattern(scale: bool, where: str | None, mask: bool, epilogue: str | None):
    """``[epilogue](softmax([mask +] [where(cond, ] [x * s | x / s] [, fill)]))`` and its annotations."""
    found = {"x": wildcard()}
    out = masked_softmax(found, found["x"], scale, where, mask)
    if epilogue:
        found["epilogue_operand"] = wildcard()
        out = found["epilogue"] = EPILOGUES[epilogue](out, found["epilogue_operand"])
    return out, found


def masked_softmax(found: dict, logits, scale: bool, where: str | None, mask: bool):
    """``softmax([mask +] [where(cond, ] [logits * s | logits / s] [, fill)]))``, the prologue
    steps exporters put before a softmax (in attention too), named in ``found``. ``where``: one
    of ``WHERE_MASKS`` ("masked_fill": ``where(cond, fill, logits)``), or None."""
    if scale:
        found["scale"] = wildcard()
        logits = found["scaled"] = (is_op("relax.divide")(logits, found["scale"])
                                    | is_op("relax.multiply")(logits, found["scale"]))
    if where:
        found["causal_cond"], found["causal_fill"] = wildcard(), wildcard()
        chosen = (found["causal_fill"], logits) if where == "masked_fill" else (logits, found["causal_fill"])
        logits = found["causal"] = is_op("relax.where")(found["causal_cond"], *chosen)
    if mask:
        found["mask"] = wildcard()
        logits = found["masked"] = is_op("relax.add")(logits, found["mask"])
    probs = found["probs"] = is_op("relax.nn.softmax")(logits)
    return probs


def variant_name(scale: bool, where: str | None, mask: bool, epilogue: str | None) -> str:
    parts = [name for name, on in (("scale", scale), (where, where), ("mask", mask)) if on]
    return "_".join(parts + ["softmax"] + ([epilogue] if epilogue else []))


class Softmax(FusionRule):
    name = "softmax"
    description = ("element-wise prologue (scale, causal Where, additive mask) + softmax + "
                   "multiply/astype epilogue -> one row-wise kernel")

    def variants(self):
        choices = itertools.product((True, False), (*WHERE_MASKS, None), (True, False), (*EPILOGUES, None))
        variants = [(variant_name(*choice), *softmax_pattern(*choice))
                    for choice in choices if any(choice[:3])]  # a bare softmax is one kernel already
        return sorted(variants, key=lambda v: -len(v[0].split("_")))

    def anchor(self, context):
        return context.annotated_expr["probs"]

    def check(self, context):
        found = context.annotated_expr
        probs = found["probs"]
        axis = int(probs.attrs.axis)
        shape = shape_dims(probs)
        if dtype_of(probs) not in FLOAT_DTYPES:
            return f"dtype {dtype_of(probs)} is not supported ({', '.join(FLOAT_DTYPES)})"
        if not shape:
            inputs = ", ".join(f"{name} {dims_text(shape_dims(found[name]))}"
                               for name in ("x", "causal_cond", "mask") if name in found)
            return f"the softmax's shape is not known (from {inputs})"
        if axis not in (-1, len(shape) - 1):
            return f"softmax is over axis {axis}, not the last: rows would not be contiguous"
        # The rows may vary in number; the row itself is what the kernel vectorizes and reduces.
        if reason := symbolic_dim_reason("softmax input", shape, [-1], role="softmax axis"):
            return reason
        for name in ("x", "scaled", "causal", "masked", "epilogue"):
            if name in found and not same_dims(shape_dims(found[name]), shape):
                operand = "input" if name == "x" else f"{name} result"
                return (f"the {operand} shape {dims_text(shape_dims(found[name]))} differs from the "
                        f"softmax shape {dims_text(shape)}")
        if has_leaking_intermediate_variables(context):
            return "an intermediate result is also used outside the chain"
        return None

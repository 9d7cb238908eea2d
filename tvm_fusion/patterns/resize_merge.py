"""Resize merge: the upsample in an FPN-style neck fused into the op that consumes it.

Two shapes, one kernel each:

* top-down merge: ``act(lateral + resize2d(top))`` (either operand order);
* output fusion: ``concat([resize2d(p5), resize2d(p4), ..., p2], axis=1)``, where each level
  is upsampled to a common size and some inputs may not be resized at all.

Unfused, every upsampled map is written out at full resolution and read back by the add or
concat; fused, each output element reads its source pixel(s) of the small map directly, so
the upsampled maps never exist in memory.

Where the lateral map is a conv output, ``conv_epilogue`` (which runs first) takes the merge
as its upsampled-residual variant, and the lateral map is not stored either; this rule takes
the other merges and the concats.

Rows and columns may be symbolic (a model compiled for a range of sizes); batch and channels
must be static.
"""

from __future__ import annotations

import re

from tvm import relax
from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.sym.analyzer import Analyzer
from tvm.tirx.analysis import undefined_vars
from tvm.relax.dpl import is_op, is_tuple, wildcard

from .activations import activation_patterns
from .base import FLOAT_DTYPES, FusionRule, dims_text, dtype_of, same_dims, shape_dims, symbolic_dim_reason

MERGE_ACTIVATIONS = activation_patterns(("relu", "clip", "leakyrelu", "silu", "hardswish"))
# FPN/PAN necks concatenate 2-5 levels; a few more keeps wider heads covered.
MAX_CONCAT_INPUTS = 8


def resize_pattern():
    data = wildcard()
    return is_op("relax.image.resize2d")(data, wildcard()), data


def merge_add_pattern(activation: str | None):
    """``act(lateral + resize2d(top))``; the add is commutative, so either order matches."""
    resize, top = resize_pattern()
    lateral = wildcard()
    out = add = is_op("relax.add")(lateral, resize)
    annotations = {"top": top, "resize": resize, "lateral": lateral, "add": add}
    if activation:
        out = annotations["activation"] = MERGE_ACTIVATIONS[activation](add)
    return out, annotations


def concat_pattern(inputs: int, first_resized: int):
    """``concat`` of ``inputs`` tensors whose first resized one is input ``first_resized``.

    Inputs before it are plain; later ones are either resized or plain. One variant per
    position of the first resized input covers every mix without matching a concat that
    has no resize at all.
    """
    fields, annotations = [], {}
    for index in range(inputs):
        if index < first_resized:
            field = annotations[f"input{index}"] = wildcard()
        else:
            resize, annotations[f"input{index}"] = resize_pattern()
            annotations[f"resize{index}"] = resize
            field = resize if index == first_resized else resize | annotations[f"input{index}"]
        fields.append(field)
    annotations["concat"] = is_op("relax.concat")(is_tuple(fields))
    return annotations["concat"], annotations


class ResizeMerge(FusionRule):
    name = "resize_merge"
    description = ("resize2d (upsample) + add of a lateral map (+ relu, clip, leakyrelu, silu, "
                   "hardswish), and resize2d outputs concatenated along channels (FPN necks)")

    def variants(self):
        variants = [(f"add_{activation}", *merge_add_pattern(activation)) for activation in MERGE_ACTIVATIONS]
        variants.append(("add", *merge_add_pattern(None)))
        # A tuple pattern has a fixed length: one set of variants per concat arity.
        for inputs in range(2, MAX_CONCAT_INPUTS + 1):
            variants += [(f"concat{inputs}", *concat_pattern(inputs, first)) for first in range(inputs)]
        return variants

    def anchor(self, context):
        found = context.annotated_expr
        return found["add"] if "add" in found else found["concat"]

    def check(self, context):
        found = context.annotated_expr
        resizes = [expr for name, expr in found.items() if name.startswith("resize")]
        for resize in resizes:
            reason = resize_reason(resize)
            if reason:
                return reason
        if "add" in found:
            reason = _lateral_reason(found["lateral"], found["resize"])
        else:
            reason = _channel_concat_reason(found["concat"])
        if reason:
            return reason
        if has_leaking_intermediate_variables(context):
            return "an upsampled map or the merged sum is also used outside the chain"
        return None


def resize_reason(resize) -> str | None:
    """Why a matched ``resize2d`` cannot be fused (conv_epilogue's upsampled residual too)."""
    dtype = dtype_of(resize)
    if dtype not in FLOAT_DTYPES:
        return f"dtype {dtype} is not supported ({', '.join(FLOAT_DTYPES)})"
    layout = str(resize.attrs.layout)
    if layout != "NCHW" and not re.fullmatch(r"NCHW\d+c", layout):
        return f"resize layout {layout} is not NCHW or NCHW[x]c"
    for what, expr in (("resize input", resize.args[0]), ("resize output", resize)):
        reason = _static_batch_channels(what, shape_dims(expr))
        if reason:
            return reason
    return _size_vars_reason(resize)


def _size_vars_reason(resize) -> str | None:
    """The output size may be symbolic only in the vars of the input's shape.

    The kernel needs the size inline; a composite knows the vars its tensor parameters carry
    (the resize input is one), but a var only the size names (``R.shape([h2, w2])`` from a
    shape computed elsewhere) would reach it as a shape parameter, which LegalizeOps cannot
    lower for a resize.
    """
    size = resize.args[1]
    if not isinstance(size, relax.ShapeExpr):
        return "the resize size is computed at run time, not a shape expression"
    known = {var for dim in shape_dims(resize.args[0]) if not isinstance(dim, int)
             for var in undefined_vars(dim)}
    missing = sorted({str(var) for dim in size.values for var in undefined_vars(dim) if var not in known})
    if missing:
        return (f"the resize size {dims_text(tuple(size.values))} uses {', '.join(missing)}, which the "
                f"resize input {dims_text(shape_dims(resize.args[0]))} does not: the kernel could not be given it")
    return None


def _static_batch_channels(what: str, dims: tuple | None) -> str | None:
    """NCHW, or NCHW[x]c with a static block, with static batch and channels; rows and columns
    may be symbolic."""
    if dims is None or len(dims) not in (4, 5):
        return f"the {what} {dims_text(dims)} is not 4-D (NCHW) or 5-D (NCHW[x]c)"
    return symbolic_dim_reason(what, dims, axes=(0, 1) if len(dims) == 4 else (0, 1, 4))


def _lateral_reason(lateral, upsampled) -> str | None:
    """The add must be same-shape: a broadcast would grow the output past the upsampled map."""
    lateral_shape, upsampled_shape = shape_dims(lateral), shape_dims(upsampled)
    if not _provably_same_dims(lateral_shape, upsampled_shape):
        return (f"the add broadcasts: lateral shape {dims_text(lateral_shape)} does not equal the "
                f"upsampled shape {dims_text(upsampled_shape)}")
    if dtype_of(lateral) != dtype_of(upsampled):
        return f"lateral dtype {dtype_of(lateral)} differs from {dtype_of(upsampled)}"
    return None


def _provably_same_dims(first: tuple | None, second: tuple | None) -> bool:
    """``same_dims``, with symbolic dims compared by value (an import may spell the lateral's
    rows ``2 * height`` and the resize's ``height * 2``)."""
    if same_dims(first, second):
        return True
    if first is None or second is None or len(first) != len(second):
        return False
    analyzer = Analyzer()
    return all(a == b if isinstance(a, int) and isinstance(b, int) else analyzer.can_prove_equal(a, b)
               for a, b in zip(first, second))


def _channel_concat_reason(concat) -> str | None:
    reason = _static_batch_channels("concat output", shape_dims(concat))
    if reason:
        return reason
    if int(concat.attrs.axis) not in (1, -3):
        return f"concat axis {int(concat.attrs.axis)} is not the channel axis (1)"
    if dtype_of(concat) not in FLOAT_DTYPES:
        return f"dtype {dtype_of(concat)} is not supported ({', '.join(FLOAT_DTYPES)})"
    return None

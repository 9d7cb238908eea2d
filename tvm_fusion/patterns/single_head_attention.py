"""Single-head attention: 3-D ``softmax(mask(q @ kᵀ)) @ v`` -> the [batch, heads=1, ...] form.

An RNN decoder's attention over its encoder memory (Luong/Bahdanau, the romanizer's decoder),
and any attention whose heads are folded into the batch, multiplies [B, S, D] queries with
[B, T, D] keys and values: no head split, no head merge. The ``attention`` fusion matches
the per-head 4-D form; here the 3-D chain is rewritten to it with one head (reshapes and
transposes of a size-1 axis, which the attention kernel reads through its indexing), so the
scores, mask, softmax and ·V run as one kernel with the scores in a cache-resident tile.
"""

from __future__ import annotations

import itertools

from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from .base import FLOAT_DTYPES, RewriteRule, broadcasts_to, dims_text, dtype_of, shape_dims
from .softmax import WHERE_MASKS, masked_softmax


def single_head_pattern(scale: bool, where: str | None, mask: bool) -> tuple:
    found = {"q": wildcard(), "k": wildcard(), "v": wildcard()}
    found["k_transposed"] = is_op("relax.permute_dims")(found["k"])
    # Only 3-D scores: the per-head 4-D form is the attention fusion's own (no near miss there).
    found["scores"] = is_op("relax.matmul")(found["q"], found["k_transposed"]).has_ty(relax.TensorType(ndim=3, dtype=""))
    probs = masked_softmax(found, found["scores"], scale, where, mask)
    found["context"] = is_op("relax.matmul")(probs, found["v"])
    return found["context"], found


class SingleHeadAttention(RewriteRule):
    name = "single_head_attention"
    runs_before = ("attention",)
    description = ("3-D q @ kᵀ (+ scale, select mask, additive mask) -> softmax -> @ v, no head "
                   "split -> the 4-D one-head form the attention fusion takes")
    exclusive = ("scores", "scaled", "causal", "masked", "probs")

    def variants(self):
        return [single_head_pattern(scale, where, mask)
                for scale, where, mask in itertools.product((True, False), (*WHERE_MASKS, None), (True, False))]

    def check(self, matched):
        q, k, v = (shape_dims(matched[name]) for name in ("q", "k", "v"))
        if q is None or k is None or v is None or not len(q) == len(k) == len(v) == 3:
            return f"q, k, v shapes {dims_text(q)}, {dims_text(k)}, {dims_text(v)} are not all 3-D"
        axes = tuple(int(a) for a in matched["k_transposed"].attrs.axes or ())
        if axes != (0, 2, 1):
            return f"the key is permuted by {axes}, not transposed (0, 2, 1)"
        if dtype_of(matched["scores"]) not in FLOAT_DTYPES or dtype_of(matched["context"]) != dtype_of(matched["scores"]):
            return f"dtype {dtype_of(matched['scores'])} is not supported ({', '.join(FLOAT_DTYPES)})"
        if int(matched["probs"].attrs.axis) not in (-1, 2):
            return "the softmax is not over the keys (last axis)"
        scores = shape_dims(matched["scores"])
        for name in ("scale", "causal_cond", "causal_fill", "mask"):
            if name in matched and not broadcasts_to(shape_dims(matched[name]), scores):
                return f"the {name.replace('_', ' ')} {dims_text(shape_dims(matched[name]))} does not broadcast into the scores {dims_text(scores)}"
        return None

    def rewrite(self, matched):
        batch, queries, depth = shape_dims(matched["q"])
        keys = shape_dims(matched["k"])[1]
        width = shape_dims(matched["v"])[2]
        q = relax.op.reshape(matched["q"], (batch, 1, queries, depth))
        k = relax.op.reshape(matched["k"], (batch, 1, keys, depth))
        logits = relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2]))
        if "scaled" in matched:
            logits = relax.Call(matched["scaled"].op, [logits, matched["scale"]])
        if "causal" in matched:
            cond, fill = _one_head(matched["causal_cond"]), _one_head(matched["causal_fill"])
            fill_first = matched["causal"].args[1].same_as(matched["causal_fill"])
            chosen = (fill, logits) if fill_first else (logits, fill)
            logits = relax.op.where(cond, *chosen)
        if "masked" in matched:
            logits = relax.op.add(logits, _one_head(matched["mask"]))
        probs = relax.op.nn.softmax(logits, axis=-1)
        v = relax.op.permute_dims(relax.op.reshape(matched["v"], (batch, keys, 1, width)), [0, 2, 1, 3])
        context = relax.op.matmul(probs, v)
        return relax.op.reshape(relax.op.permute_dims(context, [0, 2, 1, 3]), (batch, queries, width))


def _one_head(operand: relax.Expr) -> relax.Expr:
    """A mask operand of the 3-D scores, broadcast the same way into the [B, 1, S, T] ones."""
    dims = shape_dims(operand)
    return relax.op.expand_dims(operand, 1) if dims is not None and len(dims) == 3 else operand

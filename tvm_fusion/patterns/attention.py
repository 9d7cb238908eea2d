"""Attention: head split -> Q·Kᵀ -> scale -> [causal where] -> [additive mask] -> softmax -> ·V
-> head merge, as one kernel.

Unfused, every head's seq x seq score matrix goes through main memory four times (matmul out,
scale/mask out, softmax in and out) and the head split/merge transposes are copies of their
own. As one composite, FuseTIR makes a single PrimFunc that the ``Attention`` CPU schedule
computes one block of query rows at a time, the scores living in a cache-resident tile, Q, K
and V read straight from the [batch, seq, heads*dim] projections and the output written in
that layout too.

The exporters' two mask forms both match: BERT's padding mask ``add(scores/√d, (1-m)·min)``
and GPT-2's causal mask ``where(triangle, scores/√d, min)`` (+ its additive mask), also in
torch's ``masked_fill`` order ``where(masked, min, scores)``; so do
separate Q, K, V projections (BERT), one packed projection split three ways (GPT-2's c_attn,
whose split then happens inside the kernel's indexing too) and Q, K already split into heads
(Llama, whose rotary embedding is computed on [batch, heads, seq, dim]).
"""

from __future__ import annotations

from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import is_op, is_tuple_get_item, wildcard

from .base import (FLOAT_DTYPES, FusionRule, dims_text, dtype_of, same_dim, same_dims, same_size, scalar_constant,
                   shape_dims, symbolic_dim_reason)
from .softmax import masked_softmax

# permute_dims axes that turn a [batch, seq, heads, dim] view into the matmul operands.
HEADS_FIRST = (0, 2, 1, 3)          # Q, V: [batch, heads, seq, dim]; also the head merge
HEADS_FIRST_TRANSPOSED = (0, 2, 3, 1)  # Kᵀ: [batch, heads, dim, seq]
LAST_TWO_SWAPPED = (0, 1, 3, 2)     # Kᵀ from K already in [batch, heads, seq, dim]

STACKED_HEADS = (2, 0, 3, 1, 4)      # [B, S, 3, H, D] -> [3, B, H, S, D]: Q, K, V stacked on axis 0

# Where Q and K come from, in the order tried (the form absorbing the most first), with the
# prefix of its variant names: one packed projection split three ways (GPT-2's c_attn), one
# packed projection viewed as [B, S, 3, H, D] and indexed on a stacked axis (SVTR in PP-OCR,
# timm's ViT), one projection each (BERT), or Q and K already split into heads (Llama: after
# rotary embeddings).
QK_FORMS = {"packed": "qkv_", "stacked": "qkv_stacked_", "projections": "", "heads": "qk_heads_"}

# Where the 1/sqrt(d) scale is applied, with the suffix of the variant names: to the scores
# (BERT, GPT-2), to Q before Q·Kᵀ (SVTR, timm), its square root to Q and to Kᵀ (torch's dynamo
# exporter), or nowhere (folded into the Q weights).
SCALES = {"scores": "", "query": "_query_scaled", "query_and_key": "_qk_scaled", "none": "_unscaled"}

MASKS = {  # name: (select mask (one of softmax.WHERE_MASKS), additive mask), longest first
    "causal_masked": ("causal", True),
    "masked_fill_masked": ("masked_fill", True),
    "causal": ("causal", False),
    "masked_fill": ("masked_fill", False),
    "masked": (None, True),
    "unmasked": (None, False),
}


def _split_heads(found: dict, name: str):
    """``permute_dims(reshape(<name>_proj, [B, S, H, D]))``, annotated as <name>_proj/<name>_heads.

    With a ``qkv_split`` in ``found`` (GPT-2's fused c_attn), the projection is one of its outputs.
    """
    split = found.get("qkv_split")
    proj = found[f"{name}_proj"] = is_tuple_get_item(split) if split is not None else wildcard()
    found[f"{name}_view"] = is_op("relax.reshape")(proj, wildcard())
    found[f"{name}_heads"] = is_op("relax.permute_dims")(found[f"{name}_view"])
    if name != "k":
        return found[f"{name}_heads"]
    # torch's dynamo exporter transposes K in 3-D: heads first, then [B*H, S, D] -> [B*H, D, S].
    found["k_heads_first"] = is_op("relax.permute_dims")(found["k_view"])
    found["k_flat"] = is_op("relax.reshape")(found["k_heads_first"], wildcard())
    found["k_flat_transposed"] = is_op("relax.permute_dims")(found["k_flat"])
    found["k_unflat"] = is_op("relax.reshape")(found["k_flat_transposed"], wildcard())
    return found["k_heads"] | found["k_unflat"]


def _stacked_head(found: dict, name: str):
    """``squeeze(strided_slice(stack, axis 0, [i, i+1]), 0)``: one of Q, K, V from the stack."""
    found[f"{name}_slice"] = is_op("relax.strided_slice")(found["qkv_stack"], varg_default_wildcard=True)
    found[f"{name}_unstacked"] = is_op("relax.squeeze")(found[f"{name}_slice"])
    return found[f"{name}_unstacked"]


def _qkv_operands(found: dict, qk_form: str):
    """The Q, Kᵀ and V operands of the two matmuls, for one of ``QK_FORMS``."""
    if qk_form == "stacked":
        found["qkv"] = wildcard()
        found["qkv_view"] = is_op("relax.reshape")(found["qkv"], wildcard())
        found["qkv_stack"] = is_op("relax.permute_dims")(found["qkv_view"])
        q, k = _stacked_head(found, "q"), _stacked_head(found, "k")
        found["k_transposed"] = is_op("relax.permute_dims")(k)
        return q, found["k_transposed"], _stacked_head(found, "v")
    if qk_form == "heads":
        found["q"], found["k"] = wildcard(), wildcard()
        found["k_transposed"] = is_op("relax.permute_dims")(found["k"])
        return found["q"], found["k_transposed"], _split_heads(found, "v")
    if qk_form == "packed":
        found["qkv"] = wildcard()
        found["qkv_split"] = is_op("relax.split")(found["qkv"])
    return _split_heads(found, "q"), _split_heads(found, "k"), _split_heads(found, "v")


def attention_pattern(where: str | None, masked: bool, qk_form: str = "projections", scale_at: str = "scores",
                      nan_guard: bool = False):
    """The attention chain and its annotations."""
    found: dict = {}
    q, k_transposed, v = _qkv_operands(found, qk_form)
    if scale_at in ("query", "query_and_key"):
        found["scale"] = wildcard()
        q = found["q_scaled"] = is_op("relax.multiply")(q, found["scale"])
    if scale_at == "query_and_key":  # sqrt(scale) on each side (torch's SDPA decomposition)
        found["k_scale"] = wildcard()
        k_transposed = found["k_scaled"] = is_op("relax.multiply")(k_transposed, found["k_scale"])
    scores = found["scores"] = is_op("relax.matmul")(q, k_transposed)
    probs = masked_softmax(found, scores, scale_at == "scores", where, masked)
    if nan_guard:  # where(isnan(p), 0, p): torch's SDPA zeroes the rows a mask left all -inf
        found["nan_fill"] = wildcard()
        probs = found["guarded"] = is_op("relax.where")(is_op("relax.isnan")(probs), found["nan_fill"], probs)
    found["context"] = is_op("relax.matmul")(probs, v)
    found["merged"] = is_op("relax.permute_dims")(found["context"])
    found["out"] = is_op("relax.reshape")(found["merged"], wildcard())
    return found["out"], found


class Attention(FusionRule):
    name = "attention"
    runs_before = ("softmax", "gemm_epilogue")
    description = ("head split (per projection, of a packed QKV, or Q/K already per head) + Q·Kᵀ + scale "
                   "(Mul/Div) + causal Where + additive mask + softmax + ·V + head merge -> one kernel, "
                   "scores in a cache-resident tile")

    def variants(self):
        return [(prefix + name + suffix + ("_nan_guarded" if guard else ""),
                 *attention_pattern(*masks, qk_form=form, scale_at=scale_at, nan_guard=guard))
                for form, prefix in QK_FORMS.items() for name, masks in MASKS.items()
                for scale_at, suffix in SCALES.items() for guard in ((True, False) if any(masks) else (False,))]

    def anchor(self, context):
        return context.annotated_expr["probs"]

    def check(self, context):
        found = context.annotated_expr
        # Masks before the layout: a mask that does not broadcast leaves the output shape unknown.
        reason = (_check_dtypes(found) or _check_masks(found) or _check_layout(found)
                  or _check_scale(found))
        if reason:
            return reason
        axis = int(found["probs"].attrs.axis)
        if axis not in (-1, 3):
            return f"softmax is over axis {axis}, not the last (key) axis"
        if has_leaking_intermediate_variables(context):
            return "an intermediate result (scores or probabilities) is also used outside the chain"
        return None


def _check_dtypes(found) -> str | None:
    dtypes = {name: dtype_of(found[name])
              for name in ("qkv", "q_proj", "k_proj", "q", "k", "v_proj", "scores", "out") if name in found}
    if len(set(dtypes.values())) != 1:
        listed = ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        return f"dtype mismatch ({listed}): the kernel computes in one dtype"
    if dtypes["out"] not in FLOAT_DTYPES:
        return f"dtype {dtypes['out']} is not supported ({', '.join(FLOAT_DTYPES)})"
    return None


def _check_layout(found) -> str | None:
    scores_shape, context_shape = shape_dims(found["scores"]), shape_dims(found["context"])
    if scores_shape is None or len(scores_shape) != 4:
        return f"scores shape {dims_text(scores_shape)} is not [batch, heads, queries, keys]"
    if context_shape is None or len(context_shape) != 4 or shape_dims(found["out"]) is None:
        return f"the attention output {dims_text(context_shape)} is not [batch, heads, queries, head dim]"
    # Batch, query and key lengths may vary (one kernel for a range of sequence lengths); the
    # heads and the head dim are the kernel's inner loops and the output's last axis.
    reason = (symbolic_dim_reason("attention output", context_shape, [1], role="heads")
              or symbolic_dim_reason("attention output", context_shape, [3], role="head dim"))
    if reason:
        return reason
    expected = {"q_heads": HEADS_FIRST, "k_heads": HEADS_FIRST_TRANSPOSED, "k_transposed": LAST_TWO_SWAPPED,
                "v_heads": HEADS_FIRST, "merged": HEADS_FIRST}
    if "qkv_stack" in found:
        expected["qkv_stack"] = STACKED_HEADS
    if "k_unflat" in found:  # K transposed in 3-D: the heads-first view, its last two axes swapped
        del expected["k_heads"]
        expected.update(k_heads_first=HEADS_FIRST, k_flat_transposed=(0, 2, 1))
        reason = _check_flat_transpose(found)
        if reason:
            return reason
    for name, axes in expected.items():
        if name not in found:
            continue
        actual = tuple(int(a) for a in found[name].attrs.axes or ())
        if actual != axes:
            return f"{name.split('_')[0]} head permutation {actual} is not {axes}"
    return _check_stacked_slices(found) if "qkv_stack" in found else None


def _check_flat_transpose(found) -> str | None:
    """[B, H, S, D] -> [B*H, S, D] -> [B*H, D, S] -> [B, H, D, S] is Kᵀ only with those shapes."""
    heads_first, flat, unflat = (shape_dims(found[n]) for n in ("k_heads_first", "k_flat", "k_unflat"))
    if heads_first is None or flat is None or unflat is None or len(heads_first) != 4 or len(flat) != 3:
        return "the key transpose's ranks are not known"
    b, h, s, d = heads_first
    if not (same_size((b, h), flat[:1]) and same_dims(flat[1:], (s, d)) and same_dims(unflat, (b, h, d, s))):
        return (f"the key is reshaped {dims_text(heads_first)} -> {dims_text(flat)} and back to "
                f"{dims_text(unflat)}, not transposed")
    return None


def _check_stacked_slices(found) -> str | None:
    """Q, K and V must be stack[0], stack[1] and stack[2], each squeezed on the stacked axis."""
    for index, name in enumerate(("q", "k", "v")):
        sliced, squeezed = found[f"{name}_slice"], found[f"{name}_unstacked"]
        axes, begin, end = (_int_tuple(arg) for arg in sliced.args[1:4])
        if (axes, begin, end) != ([0], [index], [index + 1]):
            return f"{name} is not slice {index} of the stacked Q, K, V (axes {axes}, begin {begin}, end {end})"
        if [int(a) for a in squeezed.attrs.axis or ()] != [0]:
            return f"{name} is not squeezed on the stacked axis"
    return None


def _check_scale(found) -> str | None:
    for name in ("scale", "k_scale"):
        if name in found and scalar_constant(found[name]) is None:
            return "the score scale is not a constant scalar"
    if "nan_fill" in found and scalar_constant(found["nan_fill"]) is None:
        return "the value replacing NaN probabilities is not a constant scalar"
    return None


def _check_masks(found) -> str | None:
    """A mask must broadcast into the scores, not widen them (the kernel writes one tile per row block)."""
    scores_shape = shape_dims(found["scores"])
    for result, operand, label in (("causal", "causal_cond", "causal"), ("masked", "mask", "additive")):
        if result in found and not same_dims(shape_dims(found[result]), scores_shape):
            return (f"{label} mask shape {dims_text(shape_dims(found[operand]))} does not broadcast into "
                    f"the scores shape {dims_text(scores_shape)}")
    fill = shape_dims(found["causal_fill"]) if "causal" in found else ()
    if fill is None or len(fill) > 1 or fill and not same_dim(fill[0], 1):
        return f"the causal fill value has shape {dims_text(fill)}, not a scalar"
    return None


def _int_tuple(expr) -> list[int] | None:
    """A strided_slice's axes/begin/end as ints, or None when they are not constants."""
    try:
        return [int(value) for value in expr.fields]
    except (AttributeError, TypeError):
        return None

"""``Attention``: the fused ONNX of ``attention``, its builder and its reference implementation.

The builder reads every form the pattern fuses back from the ONNX nodes: Q, K, V split into
heads from one projection each, from a packed projection Split three ways, or from one
projection viewed as [B, S, 3, H, D] and sliced on the stacked axis (``qkv_shape``), or Q and K
already per head; Kᵀ transposed in 4-D or, as torch's dynamo exporter writes it, in 3-D; the
scale on the scores, on Q, or its square root on Q and on Kᵀ (one ``scale``, their product);
torch's NaN guard after the softmax (``nan_fill``).
"""

from __future__ import annotations

import numpy as np
import onnx

from ..chains import score_prologue
from ..graph import Region, Unrepresentable, attribute, fused_node
from ..reference_ops import FusedOp, softmax
from ..spec import OnnxSpec

HEADS_FIRST = (0, 2, 1, 3)             # [B, S, H, D] -> [B, H, S, D]: Q, V; also the head merge
HEADS_FIRST_TRANSPOSED = (0, 2, 3, 1)  # [B, S, H, D] -> Kᵀ [B, H, D, S]
LAST_TWO_SWAPPED = (0, 1, 3, 2)        # Kᵀ from K already in [B, H, S, D]
STACKED_HEADS = (2, 0, 3, 1, 4)        # [B, S, 3, H, D] -> [3, B, H, S, D]


def build_attention(region: Region, variant: str) -> list[onnx.NodeProto]:
    """[Head split | stacked slices] + [Q, Kᵀ scale] + Q·Kᵀ + scale + causal Where + mask +
    Softmax [+ NaN guard] + ·V + head merge."""
    graph = region.graph
    probs = region.only("Softmax")
    logits, causal, mask, attrs, _ = score_prologue(region, probs.input[0], "score")
    scores = region.producer(logits, "MatMul")
    if scores is None:
        node = region.producer(logits)
        raise Unrepresentable(f"{node.op_type} between the scores and the softmax" if node is not None
                              else "no Q·Kᵀ MatMul before the softmax")
    weights, nan_fill = nan_guarded(region, probs.output[0])
    context = region.single_consumer(weights, "MatMul")
    (q, q_scale), (k_transposed, k_scale) = (scaled(region, name) for name in scores.input)
    if q_scale != 1.0 or k_scale != 1.0:
        attrs["scale"] = attrs.get("scale", 1.0) * q_scale * k_scale
    query, q_form = heads_source(region, q, 0)
    key, k_form = key_source(region, k_transposed)
    value, v_form = heads_source(region, context.input[1], 2)
    if q_form == "stacked" or k_form == "stacked" or v_form == "stacked":
        if not q_form == k_form == v_form == "stacked" or query != key or key != value:
            raise Unrepresentable("Q, K and V are not slices 0, 1, 2 of one stacked projection")
        inputs = [query, "", ""]
        attrs.update(qk_form="stacked", qkv_shape=list(graph.shape(stack_view(region, query).output[0])))
    else:
        if v_form != "projection":
            raise Unrepresentable("V is not split into heads from a projection")
        if q_form != k_form:
            raise Unrepresentable(f"Q is {q_form} but K is {k_form}")
        inputs = [query, key, value]
        if q_form == "heads":
            attrs["qk_form"] = "heads"
        packed(region, inputs, attrs)
    output = merged_heads(region, context.output[0])
    num_heads = graph.shape(scores.output[0])[1]
    return [fused_node("Attention", [*inputs, causal, mask], [output], num_heads=num_heads,
                       output_shape=list(graph.shape(output)), nan_fill=nan_fill, **attrs)]


def nan_guarded(region: Region, probs: str) -> tuple[str, float | None]:
    """``Where(IsNaN(p), fill, p)`` after the softmax (torch's SDPA zeroes fully masked rows):
    (the guarded probabilities, fill); (probs, None) without a guard."""
    readers = [region.graph.nodes[i] for i in region.inside_consumers(probs, set())]
    is_nan = next((n for n in readers if n.op_type == "IsNaN"), None)
    where = next((n for n in readers if n.op_type == "Where"), None)
    if is_nan is None and where is None:
        return probs, None
    guard = (is_nan is not None and where is not None and len(readers) == 2
             and list(where.input) == [is_nan.output[0], where.input[1], probs])
    if not guard:
        raise Unrepresentable("the softmax output goes on to more than Where(IsNaN(p), fill, p)")
    fill = region.graph.scalar(where.input[1])
    if fill is None:
        raise Unrepresentable("the value replacing NaN probabilities is not a constant scalar")
    return where.output[0], fill


def scaled(region: Region, name: str) -> tuple[str, float]:
    """(x, factor) for ``x * factor`` (factor a constant scalar, either side); (name, 1.0) otherwise."""
    node = region.producer(name, "Mul")
    if node is not None:
        for inner, factor in (node.input, reversed(node.input)):
            if region.graph.scalar(factor) is not None and region.graph.scalar(inner) is None:
                return inner, region.graph.scalar(factor)
    return name, 1.0


def heads_source(region: Region, name: str, index: int) -> tuple[str, str]:
    """Where Q (``index`` 0), K (1) or V (2) as [B, H, S, D] comes from: (projection,
    "projection") split into heads, (source, "stacked") sliced from a stack, or (name, "heads")."""
    projection = split_heads(region, name, HEADS_FIRST)
    if projection is not None:
        return projection, "projection"
    stacked = unstacked(region, name, index)
    return (stacked, "stacked") if stacked is not None else (name, "heads")


def key_source(region: Region, k_transposed: str) -> tuple[str, str]:
    """Where Kᵀ comes from: a projection split into heads (transposed in 4-D, or in 3-D as
    torch's dynamo exporter writes it), or K as ``heads_source`` finds it, transposed."""
    projection = split_heads(region, k_transposed, HEADS_FIRST_TRANSPOSED) or flat_transposed_key(region, k_transposed)
    if projection is not None:
        return projection, "projection"
    transposed = region.producer(k_transposed, "Transpose")
    if transposed is None or tuple(attribute(transposed, "perm")) != LAST_TWO_SWAPPED:
        raise Unrepresentable("K is not transposed as [batch, heads, dim, seq]")
    return heads_source(region, transposed.input[0], 1)


def split_heads(region: Region, name: str, perm: tuple[int, ...]) -> str | None:
    """The projection for ``Transpose(perm)(Reshape(projection))``, else None."""
    transpose = region.producer(name, "Transpose")
    reshape = transpose is not None and region.producer(transpose.input[0], "Reshape")
    if not reshape or tuple(attribute(transpose, "perm")) != perm:
        return None
    return reshape.input[0]


def flat_transposed_key(region: Region, name: str) -> str | None:
    """The key projection for Kᵀ transposed in 3-D: [B, S, H·D] -> [B, H, S, D] -> [B·H, S, D]
    -> [B·H, D, S] -> [B, H, D, S] (torch's dynamo exporter); else None."""
    graph = region.graph
    unflat = region.producer(name, "Reshape")
    swap = unflat and region.producer(unflat.input[0], "Transpose")
    flat = swap and region.producer(swap.input[0], "Reshape")
    heads = flat and split_heads(region, flat.input[0], HEADS_FIRST)
    if not heads or tuple(attribute(swap, "perm")) != (0, 2, 1):
        return None
    b, h, s, d = graph.shape(flat.input[0])
    if graph.shape(flat.output[0]) != (b * h, s, d) or graph.shape(name) != (b, h, d, s):
        return None
    return heads


def stack_view(region: Region, source: str) -> onnx.NodeProto:
    """The Reshape of ``source`` to [B, S, 3, H, D] that the stacked heads are sliced from."""
    return next(region.graph.nodes[i] for i in region.inside_consumers(source, set())
                if region.graph.nodes[i].op_type == "Reshape")


def unstacked(region: Region, name: str, index: int) -> str | None:
    """The projection for ``Squeeze(Slice(Transpose(2, 0, 3, 1, 4)(Reshape(projection)), axis 0,
    [index, index + 1]), 0)``: one of Q, K, V of a stacked projection (SVTR, timm's ViT); else None."""
    graph = region.graph
    squeeze = region.producer(name, "Squeeze")
    sliced = squeeze and region.producer(squeeze.input[0], "Slice")
    stack = sliced and region.producer(sliced.input[0], "Transpose")
    view = stack and region.producer(stack.input[0], "Reshape")
    if not view or tuple(attribute(stack, "perm")) != STACKED_HEADS or len(graph.shape(view.output[0])) != 5:
        return None
    squeezed = attribute(squeeze, "axes") or constant_ints(region, squeeze.input[1:2])
    starts, ends, axes, steps = (constant_ints(region, sliced.input[i:i + 1]) for i in range(1, 5))
    if list(squeezed or []) != [0] or (starts, ends, axes or [0], steps or [1]) != ([index], [index + 1], [0], [1]):
        raise Unrepresentable(f"{'qkv'[index]} is not slice {index} of the stacked Q, K, V")
    return view.input[0]


def constant_ints(region: Region, names) -> list[int] | None:
    """An optional constant input's values as ints; None when it is absent."""
    if not names or not names[0]:
        return None
    value = region.graph.constants.get(names[0])
    if value is None:
        raise Unrepresentable(f"{names[0]!r} is computed at run time")
    return [int(v) for v in value.ravel()]


def packed(region: Region, inputs: list[str], attrs: dict) -> None:
    """Q, K, V as the three outputs of one Split (GPT-2's c_attn): the Split's input, qkv_split."""
    split = region.producer(inputs[0], "Split")
    if split is None:
        return
    if list(split.output) != inputs or attribute(split, "axis") not in (-1, 2):
        raise Unrepresentable("the packed QKV split is not Q, K, V along the last axis")
    attrs.update(qk_form="packed", qkv_split=[region.graph.shape(name)[-1] for name in split.output])
    inputs[:] = [split.input[0], "", ""]


def merged_heads(region: Region, context: str) -> str:
    """The attention output: Transpose(0, 2, 1, 3) of the context [, Reshape]."""
    merged = region.single_consumer(context, "Transpose")
    if tuple(attribute(merged, "perm")) != HEADS_FIRST:
        raise Unrepresentable("the head merge is not a (0, 2, 1, 3) transpose")
    output = merged.output[0]
    reshape = [region.graph.nodes[i] for i in region.inside_consumers(output, set())]
    if reshape:
        if len(reshape) != 1 or reshape[0].op_type != "Reshape":
            raise Unrepresentable("the merged heads go on to more than a Reshape")
        output = reshape[0].output[0]
    return output


class Attention(FusedOp):
    """softmax(scale * Q·Kᵀ, causal Where, + mask)·V with heads split and merged.

    ``qk_form``: "projections" (query, key, value are [B, S, H*D] projections), "packed" (query
    is one [B, S, 3*H*D] projection split by ``qkv_split`` along the last axis), "stacked" (query
    is one projection viewed as ``qkv_shape`` [B, S, 3, H, D], Q, K, V its slices on axis 2),
    "heads" (query and key already [B, H, S, D]). Where ``causal_condition`` is false the score
    becomes ``causal_fill``; ``mask`` is added; with ``nan_fill``, NaN probabilities (rows
    masked everywhere) become it. The [B, S, H, D] result is reshaped to ``output_shape``.
    """

    def _run(self, query, key=None, value=None, causal_condition=None, mask=None, num_heads=1,
             qk_form="projections", qkv_split=None, qkv_shape=None, scale=1.0, causal_fill=0.0, nan_fill=None,
             output_shape=None):
        if qk_form == "stacked":
            query, key, value = query.reshape(qkv_shape).transpose(2, 0, 3, 1, 4)
        elif qk_form == "packed":
            query, key, value = np.split(query, np.cumsum(qkv_split)[:-1], axis=-1)
        if qk_form not in ("heads", "stacked"):
            query, key = _heads(query, num_heads), _heads(key, num_heads)
        value = value if qk_form == "stacked" else _heads(value, num_heads)
        with np.errstate(over="ignore", invalid="ignore"):  # -3.4e38 masks add up to -inf, as in ORT
            scores = (query @ np.swapaxes(key, -1, -2)) * np.float32(scale)
            if causal_condition is not None:
                scores = np.where(causal_condition, scores, np.float32(causal_fill))
            probs = softmax(scores if mask is None else scores + mask).astype(query.dtype)
        probs = probs if nan_fill is None else np.where(np.isnan(probs), np.float32(nan_fill), probs)
        merged = (probs @ value).transpose(0, 2, 1, 3)
        return (merged.reshape(output_shape) if output_shape is not None else merged,)


def _heads(projection: np.ndarray, num_heads: int) -> np.ndarray:
    """[B, S, H*D] -> [B, H, S, D]."""
    batch, sequence, width = projection.shape
    return projection.reshape(batch, sequence, num_heads, width // num_heads).transpose(0, 2, 1, 3)


SPEC = OnnxSpec("attention", build_attention, (Attention,))

"""``FusedSoftmax``: the fused ONNX of ``softmax`` (scale, causal Where and mask before it, a
multiply or cast after), its builder and its reference implementation."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..chains import chain_steps, check_all_used, score_prologue
from ..graph import Region, Unrepresentable, attribute, fused_node
from ..reference_ops import FusedOp, softmax
from ..spec import OnnxSpec


def build_softmax(region: Region, variant: str) -> list[onnx.NodeProto]:
    """Scale + causal Where + mask + Softmax + multiply/cast epilogue."""
    graph = region.graph
    probs = region.only("Softmax")
    axis = attribute(probs, "axis", -1 if graph.opset >= 13 else 1)
    rank = len(graph.shape(probs.input[0]))
    if axis % rank != rank - 1:
        raise Unrepresentable(f"softmax over axis {axis}, not the last")
    logits, causal, mask, attrs, passed = score_prologue(region, probs.input[0], "softmax")
    if (node := region.producer(logits)) is not None:
        raise Unrepresentable(f"{node.op_type} before the softmax")
    attrs["axis"] = -1
    done = {graph.producer[probs.output[0]]} | {graph.producer[n.output[0]] for n in passed}
    operand = ""
    steps, end = chain_steps(region, probs.output[0], done)
    for step in steps:
        if step.kind == "Mul" and "epilogue" not in attrs:
            attrs["epilogue"], operand = "multiply", step.operand
        elif step.kind == "Cast" and "epilogue" not in attrs:
            attrs.update(epilogue="cast", to=attribute(step.nodes[0], "to"))
        else:
            raise Unrepresentable(f"{step.kind} after the softmax")
    check_all_used(region, done)
    return [fused_node("FusedSoftmax", [logits, causal, mask, operand], [end], **attrs)]


class FusedSoftmax(FusedOp):
    """epilogue(softmax(x * scale, causal Where, + mask)): ``epilogue`` "multiply" (by
    ``epilogue_operand``) or "cast" (to ``to``)."""

    def _run(self, x, causal_condition=None, mask=None, epilogue_operand=None, scale=1.0, causal_fill=0.0,
             axis=-1, epilogue="", to=0):
        logits = x * np.float32(scale) if scale != 1.0 else x
        if causal_condition is not None:
            logits = np.where(causal_condition, logits, np.float32(causal_fill))
        if mask is not None:
            with np.errstate(over="ignore", invalid="ignore"):
                logits = logits + mask
        out = softmax(logits, axis).astype(x.dtype)
        if epilogue == "multiply":
            out = out * epilogue_operand
        elif epilogue == "cast":
            out = out.astype(helper.tensor_dtype_to_np_dtype(to))
        return (out,)


SPEC = OnnxSpec("softmax", build_softmax, (FusedSoftmax,))

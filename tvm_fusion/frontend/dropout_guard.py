"""Carry Dropout nodes through onnxslim, which deletes every Dropout as dead code.

onnxslim's dead-node elimination erases each Dropout, in training mode too: the output then
silently equals the input, and a graph output fed by the mask disappears (the import fails
with a missing name). Renaming Dropout to an op onnxslim does not know keeps it in place; the
name is restored right after, so our converter (training mode) or the ``dropout`` pattern
(inference) decides what it becomes.
"""

from __future__ import annotations

import onnx
from onnx import helper

HIDDEN_DOMAIN = "ai.tvm_fusion.hidden"
HIDDEN_OP = "HiddenDropout"


def hide_dropouts(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with each top-level Dropout renamed out of onnxslim's reach."""
    if not any(node.op_type == "Dropout" and node.domain in ("", "ai.onnx") for node in model.graph.node):
        return model
    hidden = onnx.ModelProto()
    hidden.CopyFrom(model)
    for node in hidden.graph.node:
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            node.op_type, node.domain = HIDDEN_OP, HIDDEN_DOMAIN
    hidden.opset_import.append(helper.make_opsetid(HIDDEN_DOMAIN, 1))
    return hidden


def restore_dropouts(model: onnx.ModelProto) -> onnx.ModelProto:
    """Undo ``hide_dropouts`` (in place) and return the model."""
    for node in model.graph.node:
        if node.op_type == HIDDEN_OP and node.domain == HIDDEN_DOMAIN:
            node.op_type = "Dropout"
            node.ClearField("domain")  # the default domain
    kept = [entry for entry in model.opset_import if entry.domain != HIDDEN_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return model

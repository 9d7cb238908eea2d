"""``ResizeMerge``: the fused ONNX of ``resize_merge`` (an FPN's upsample-and-merge), its builder
and its reference implementation."""

from __future__ import annotations

import numpy as np
import onnx

from ..chains import activation_attributes, chain_steps, check_all_used
from ..graph import Region, Unrepresentable, attribute, fused_node, resize_attributes, resize_scales
from ..reference_ops import FusedOp, apply_activation
from ..spec import OnnxSpec
from ..standard_ops import resize


def build_resize_merge(region: Region, variant: str) -> list[onnx.NodeProto]:
    """Resizes + Add (+ activation) of a lateral map, or Resizes + Concat."""
    graph = region.graph
    merge = region.only("Add", "Concat")
    done = {graph.producer[merge.output[0]]}
    inputs, resized, scales, resizes = [], [], [], []
    for name in merge.input:
        resize = region.producer(name, "Resize")
        if resize is not None:
            done.add(graph.producer[name])
            resizes.append(resize)
            scales += resize_scales(graph, resize)
            name = resize.input[0]
        inputs.append(name)
        resized.append(int(resize is not None))
    attrs = {"merge": "add" if merge.op_type == "Add" else "concat", "resized": resized, "scales": scales}
    if merge.op_type == "Concat":
        attrs["axis"] = attribute(merge, "axis")
    steps, end = chain_steps(region, merge.output[0], done)
    for step in steps:
        if step.kind != "activation" or "activation" in attrs:
            raise Unrepresentable(f"{step.kind} after the merge")
        attrs.update(activation_attributes(step))
    check_all_used(region, done)
    return [fused_node("ResizeMerge", inputs, [end], **attrs, **resize_attributes(graph, resizes))]


class ResizeMerge(FusedOp):
    """Inputs flagged in ``resized`` are upsampled (Resize by their 4 ``scales``, in order),
    then ``merge = "add"`` adds the two and applies ``activation``, or ``"concat"`` joins all
    along ``axis``."""

    def _run(self, *inputs, merge="concat", axis=1, resized=None, scales=None, activation="",
             activation_params=None, **resize_attributes):
        maps, scale_list = [], list(scales or [])
        for value, is_resized in zip(inputs, resized or [0] * len(inputs)):
            if is_resized:
                value, scale_list = resize(value, scale_list[:4], resize_attributes), scale_list[4:]
            maps.append(value)
        if merge == "add":
            return (apply_activation(maps[0] + maps[1], activation, activation_params),)
        return (np.concatenate(maps, axis=axis),)


SPEC = OnnxSpec("resize_merge", build_resize_merge, (ResizeMerge,))

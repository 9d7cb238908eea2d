"""``AddEyeLike``: the fused ONNX of ``eye_like_add``, its builder and its reference implementation."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..graph import Region, attribute, fused_node
from ..reference_ops import FusedOp
from ..spec import OnnxSpec


def build_add_eye_like(region: Region, variant: str) -> list[onnx.NodeProto]:
    eye = region.only("EyeLike")
    add = region.only("Add")
    other = add.input[1] if add.input[0] == eye.output[0] else add.input[0]
    return [fused_node("AddEyeLike", [eye.input[0], other], [add.output[0]], k=attribute(eye, "k", 0),
                       dtype=attribute(eye, "dtype"))]


class AddEyeLike(FusedOp):
    """other + EyeLike(x, k): ones where column - row == k, in ``dtype`` (0: x's)."""

    def _run(self, x, other, k=0, dtype=0):
        rows, columns = x.shape
        eye = np.eye(rows, columns, k, dtype=helper.tensor_dtype_to_np_dtype(dtype) if dtype else x.dtype)
        return ((other + eye).astype(other.dtype),)


SPEC = OnnxSpec("eye_like_add", build_add_eye_like, (AddEyeLike,))

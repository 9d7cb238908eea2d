"""Gather at a constant index (``x[0]``, an RNN state's direction) -> strided_slice (+ squeeze).

Torch exports ``x[k]`` as ``Gather(x, k)`` with a constant index, and TVM imports it as
``R.take``. FuseOps cannot fuse a take with anything: its kernel reads the index from memory,
so TVM marks it opaque, and every ``x[k]`` costs a kernel and a copy of its own. With the index
known, the same element selection is a slice of one position along the axis (squeezed for a
scalar index): injective, so it joins its producer's or consumer's kernel (silero VAD's conv
output transposed back from the blocked layout, then read at one index).
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .base import RewriteRule, static_shape


class GatherConstantIndex(RewriteRule):
    name = "gather_constant_index"
    description = "take(x, constant index k) -> strided_slice(x, k..k+1) (squeezed for a scalar k)"

    def variants(self):
        data, index = wildcard(), is_const()
        take = is_op("relax.take")(data, index)
        return [(take, {"take": take, "x": data, "index": index})]

    def check(self, matched):
        index = matched["index"].value.numpy()
        if index.size != 1 or index.ndim > 1:
            return f"the index has shape {list(index.shape)}, not one position"
        if index.dtype.kind not in "iu":
            return f"the index has dtype {index.dtype}, not an integer type"
        shape = static_shape(matched["x"])
        if shape is None:
            return "the gathered tensor's shape is not static"
        if matched["take"].attrs.axis is None:
            return "the take indexes the flattened tensor (no axis)"
        size = shape[self._axis(matched["take"], shape)]
        if not -size <= int(index.reshape(-1)[0]) < size:
            return f"index {int(index.reshape(-1)[0])} is outside an axis of {size}"
        return None

    def rewrite(self, matched):
        index = matched["index"].value.numpy()
        shape = static_shape(matched["x"])
        axis = self._axis(matched["take"], shape)
        position = int(index.reshape(-1)[0]) % shape[axis]  # ONNX Gather: a negative index counts from the end
        sliced = relax.op.strided_slice(matched["x"], [axis], [position], [position + 1])
        return relax.op.squeeze(sliced, [axis]) if index.ndim == 0 else sliced

    @staticmethod
    def _axis(take: relax.Call, shape: tuple[int, ...]) -> int:
        """The gathered axis, non-negative."""
        return int(take.attrs.axis) % len(shape)

"""Conv1dAsConv2d: every Conv1d (and ConvTranspose1d) computed as its 2-D twin over a one-row map.

Audio models (silero VAD's encoder, wav2vec-style feature extractors, TCNs) are Conv1d stacks.
The conv patterns, the blocked layout and the conv schedules are written for Conv2d; a Conv1d
left as it is runs under the generic Reduction or Fallback schedule, its bias and activation
unfused. ``conv1d(x, w)`` equals ``squeeze(conv2d(expand_dims(x, 2), expand_dims(w, 2)), 2)``
with the stride, padding and dilation on the width axis; ``SinkViews`` then moves each squeeze
below the element-wise epilogue and cancels it against the next conv's ``expand_dims``. The
same holds for ``conv1d_transpose`` and ``conv2d_transpose`` (a decoder's or a detector's
upsampling head), which otherwise runs under Fallback.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .rebinding import mutate_functions, rebind

CONV1D = "relax.nn.conv1d"
CONV1D_TRANSPOSE = "relax.nn.conv1d_transpose"


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.Conv1dAsConv2d")
class Conv1dAsConv2d:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_functions(mod, _Rewriter)


@mutator
class _Rewriter(PyExprMutator):
    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        old = binding.var
        conv2d = _as_conv2d(value)
        if conv2d is None:
            self.set_var_remap(old, rebind(self.builder_, old, value))
            return
        conv = self.builder_.emit(conv2d, str(old.name))  # the conv keeps the name: it is the ONNX node
        self.set_var_remap(old, rebind(self.builder_, old, relax.op.squeeze(conv, [2]), f"{old.name}_row"))


def _as_conv2d(value) -> relax.Expr | None:
    """The one-row 2-D conv (or transposed conv) that computes ``value``; None for anything
    else, and for a 1-D conv in a layout other than ONNX's."""
    if not isinstance(value, relax.Call) or value.op not in (tvm.ir.Op.get(CONV1D), tvm.ir.Op.get(CONV1D_TRANSPOSE)):
        return None
    attrs = value.attrs
    transposed = value.op == tvm.ir.Op.get(CONV1D_TRANSPOSE)
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCW", "IOW" if transposed else "OIW", "NCW"):
        return None
    data, weight = value.args
    options = dict(strides=[1, int(attrs.strides[0])], padding=[0, int(attrs.padding[0]), 0, int(attrs.padding[1])],
                   dilation=[1, int(attrs.dilation[0])], groups=int(attrs.groups), out_dtype=attrs.out_dtype)
    if transposed:
        return relax.op.nn.conv2d_transpose(relax.op.expand_dims(data, [2]), _one_row_weight(weight),
                                            output_padding=[0, int(attrs.output_padding[0])], **options)
    return relax.op.nn.conv2d(relax.op.expand_dims(data, [2]), _one_row_weight(weight), **options)


def _one_row_weight(weight: relax.Expr) -> relax.Expr:
    """OIW (or IOW) weights as OI1W (IO1W): a constant reshaped now, anything else at run time."""
    if isinstance(weight, tvm.ir.GenericConst):
        value = weight.value.numpy()
        return relax.const(np.ascontiguousarray(np.expand_dims(value, 2)), str(value.dtype))
    return relax.op.expand_dims(weight, [2])

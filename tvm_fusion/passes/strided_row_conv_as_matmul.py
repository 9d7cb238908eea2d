"""StridedRowConvAsMatmul: a strided conv over a one-row map computed as a matmul of its frames.

A conv with stride ``s`` and kernel width ``k`` over one row is a matmul once its input is cut
into frames: ``frames[n, t, c*k + j] = x[n, c, 0, t*s + j*d]`` (after padding), and
``conv(x, w)[n, o, 0, t] = (frames @ w.reshape(O, C*k)^T)[n, t, o]``. Audio front ends are built
this way, as Conv1d (a one-row Conv2d after ``Conv1dAsConv2d``): an STFT is a conv of the
signal with the real and imaginary DFT filters (kernel 512, stride 160 in openWakeWord's
melspectrogram; silero VAD's 258-filter ``forward_basis``), a wav2vec-style encoder starts with
a 1-channel kernel-10 stride-5 conv. The direct conv kernel (``Conv2dNCHW``) vectorizes along
the output columns: with a stride every vector is gathered, with a handful of frames most lanes
are empty, and 257 filters (a prime) leave a register tile of one channel: openWakeWord's two
STFT convs were nearly all of that model's time. As a matmul the filters are the vectorized
axis, the weight a constant that ``PackMatmulWeights`` packs, and the product runs at the
matmul kernel's speed.

The frames are one ``take`` of the flattened input by constant indices; they hold each input
value about ``k/s`` times, so a conv whose frames would exceed ``MAX_FRAME_GROWTH`` times its
input stays a conv. Unit-stride convs (their direct kernel reads contiguous vectors) are not
considered. Declined, with the reason recorded as a near miss: a grouped conv, a non-constant
weight, symbolic shapes, a mixed-precision output; declined as the better choice, silently: a
conv whose result feeds a bias add or an activation, which the conv epilogue pattern fuses into
the direct conv but which would sit behind the transpose back to NCHW here, and heavily
overlapping windows. The product comes back to NCHW with a transpose, which the element-wise
kernel after it (a power spectrum) takes as its read order.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..patterns import NearMiss, PatternReport
from ..patterns.base import static_shape
from .merge_sibling_convs import epilogue_reason, reader_ops
from .rebinding import rewrite_blocks

CONV2D = "relax.nn.conv2d"
PASS_NAME = "strided_row_conv_as_matmul"
# Frames hold each input value about k/s times; beyond this the copy costs more than the gathers
# it saves.
MAX_FRAME_GROWTH = 4
# Refusals that are no near miss: the direct conv is the better kernel there (it fuses the
# epilogue; it reads overlapping windows once).
UNREPORTED = ("its result feeds", "windows overlap too much")


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.StridedRowConvAsMatmul")
class StridedRowConvAsMatmul:
    def __init__(self, report: PatternReport | None = None):
        self.report = report

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_blocks(mod, self._rewrite_block)

    def _rewrite_block(self, block):
        if not isinstance(block, relax.DataflowBlock):
            return block
        bindings = list(block.bindings)
        if not any(is_strided_row_conv(binding.value) for binding in bindings):
            return block
        readers = reader_ops(bindings)
        builder = relax.BlockBuilder()
        new, changed = [], False
        for binding in bindings:
            if not is_strided_row_conv(binding.value):
                new.append(binding)
                continue
            name = str(binding.var.name)
            reason = decline_reason(binding.value) or epilogue_reason(binding.var, readers)
            if reason is not None:
                if self.report is not None and not reason.startswith(UNREPORTED):
                    self.report.add_near_miss(NearMiss(PASS_NAME, name, reason, name))
                new.append(binding)
                continue
            if self.report is not None:
                self.report.variants[f"{PASS_NAME}.conv2d"] += 1
            new += frames_matmul(builder, binding)
            changed = True
        return relax.DataflowBlock(new) if changed else block


def is_strided_row_conv(value) -> bool:
    """An NCHW conv2d over a one-row map, one row out, with a column stride above one: the
    convs this pass considers (others are not mentioned in its near misses)."""
    if not (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get(CONV2D)):
        return False
    attrs = value.attrs
    data_shape, out_shape = value.args[0].ty.shape, value.ty.shape
    if (attrs.data_layout, attrs.out_layout) != ("NCHW", "NCHW") or data_shape is None or out_shape is None:
        return False
    one_row = [dim for dim in (data_shape[2], out_shape[2]) if isinstance(dim, tvm.tirx.IntImm) and int(dim) == 1]
    return len(one_row) == 2 and int(attrs.strides[1]) > 1


def decline_reason(conv: relax.Call) -> str | None:
    """Why the strided one-row conv ``conv`` stays a conv; None when it can become a matmul
    (its result's readers are checked apart, by ``epilogue_reason``)."""
    attrs = conv.attrs
    data, weight = conv.args
    if attrs.kernel_layout != "OIHW":
        return f"kernel layout {attrs.kernel_layout}, not OIHW"
    if int(attrs.groups) != 1:
        return f"grouped conv ({int(attrs.groups)} groups): each group would need frames of its own channels"
    if not isinstance(weight, tvm.ir.GenericConst):
        return "the weight is not a constant (it is laid out as the matmul's right operand at build time)"
    if static_shape(data) is None or static_shape(conv) is None:
        return "symbolic shapes: the frame indices are computed at build time"
    out_dtype = "" if attrs.out_dtype is None else str(attrs.out_dtype)
    if out_dtype not in ("", "void") and out_dtype != str(data.ty.dtype):
        return f"output type {out_dtype} differs from the input's {data.ty.dtype}"
    top, _, bottom, _ = (int(p) for p in attrs.padding)
    if weight.value.shape[2] != 1 or top or bottom:
        return "the kernel or its padding spans more than the one row"
    _, _, _, width = static_shape(data)
    _, left, _, right = (int(p) for p in attrs.padding)
    frames = static_shape(conv)[3]
    growth = frames * int(weight.value.shape[3]) / (width + left + right)
    if growth > MAX_FRAME_GROWTH:
        return (f"windows overlap too much: the frames would be {growth:.1f}x the input "
                f"(at most {MAX_FRAME_GROWTH}x)")
    return None


def frames_matmul(builder: relax.BlockBuilder, binding: relax.VarBinding) -> list[relax.VarBinding]:
    """Bindings computing ``binding``'s conv as ``take(flat(pad(x)), frame_indices) @ W^T``,
    laid back out as NCHW under the conv's own variable."""
    conv, name = binding.value, str(binding.var.name)
    attrs = conv.attrs
    data, weight = conv.args
    batch, channels, _, width = static_shape(data)
    stride, dilation = int(attrs.strides[1]), int(attrs.dilation[1])
    _, left, _, right = (int(p) for p in attrs.padding)
    filters = weight.value.numpy()
    out_channels, _, _, taps = filters.shape
    frames = static_shape(conv)[3]
    result = []

    def bind(value, suffix):
        value = builder.normalize(value)
        var = relax.DataflowVar(f"{name}_{suffix}", value.ty)
        result.append(relax.VarBinding(var, value))
        return var

    if left or right:
        data = bind(relax.op.nn.pad(data, [0, 0, 0, 0, 0, 0, left, right]), "padded")
        width += left + right
    flat = bind(relax.op.reshape(data, [batch, channels * width]), "flat")
    # indices[t, c*k + j] = c*width + t*stride + j*dilation
    indices = (np.arange(channels)[None, :, None] * width + np.arange(frames)[:, None, None] * stride
               + np.arange(taps)[None, None, :] * dilation).reshape(frames, channels * taps)
    windows = bind(relax.op.take(flat, relax.const(indices.astype("int64")), axis=1), "frames")
    matrix = np.ascontiguousarray(filters.reshape(out_channels, channels * taps).T)
    product = builder.normalize(relax.op.matmul(windows, relax.const(matrix)))
    product_var = relax.DataflowVar(name, product.ty)  # the conv's name: it is the ONNX node
    result.append(relax.VarBinding(product_var, product))
    columns = bind(relax.op.permute_dims(product_var, [0, 2, 1]), "ncw")
    result.append(relax.VarBinding(binding.var, builder.normalize(relax.op.expand_dims(columns, [2]))))
    return result

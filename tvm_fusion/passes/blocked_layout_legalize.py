"""Legalizing the blocked layout's ops (``blocked_layout.py``): convs in NCHW[x]c as TE kernels
(dense, grouped on whole blocks, depthwise, NCHW read into blocks, and 3x3 stride-1 convs by
Winograd, ``kernels/winograd_conv2d.py``), layout transforms as gathers.

TVM's own legalizer declines blocked conv layouts, and legalizes a layout transform as a loop
over its input that scatters the writes.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, topi

from ..kernels.winograd_conv2d import winograd_conv2d_nchwc, winograd_tile
from ..patterns.base import static_shape, whole_numbers


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
    tile = winograd_tile_of(call) if winograd else None
    if tile is not None:
        return bb.call_te(winograd_conv2d_nchwc, call.args[0], call.args[1], [int(p) for p in attrs.padding], tile,
                          primfunc_name_hint="winograd_conv2d_nchwc")
    return bb.call_te(_conv2d_nchwc, call.args[0], call.args[1], [int(s) for s in attrs.strides],
                      [int(p) for p in attrs.padding], [int(d) for d in attrs.dilation], out_dtype,
                      int(attrs.groups), primfunc_name_hint="conv2d_nchwc")


def winograd_tile_of(call: relax.Call) -> int | None:
    """``winograd_tile`` of a blocked conv2d call (its output tile, or None: the direct conv)."""
    attrs = call.attrs
    if len(attrs.data_layout) == 4 or attrs.out_layout != attrs.data_layout or int(attrs.groups) != 1:
        return None
    out_dtype = attrs.out_dtype if str(attrs.out_dtype) not in ("", "void") else None
    data, kernel = call.args
    dtype = str(data.ty.dtype)
    if out_dtype not in (None, dtype) or str(kernel.ty.dtype) != dtype:
        return None
    if isinstance(kernel, tvm.ir.GenericConst) and whole_numbers(kernel.value.numpy()):
        return None  # an integer conv in float32 (frontend/qoperator.py) is exact; Winograd's transforms are not
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

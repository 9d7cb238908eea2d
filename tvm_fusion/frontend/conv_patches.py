"""A conv2d as a matmul of its input's patches, the form of the packed-weight kernels
(``bf16_conv.py``: bf16 x bf16 -> float32; ``int8_conv.py``: uint8 x int8 -> int32).

Row ``p`` of the patch matrix is output pixel ``p``'s receptive field (``K = C x KH x KW``
values), the weight is ``[K, Co]``. One kernel holds three parts: the input converted to the
sum's operand type once (``PatchOperand.convert``; a 1x1 conv's patches convert what they
read), the patch matrix copied from it (the
padding as the operand value of a zero), and a last block that writes each output pixel's
channels in the conv's output layout. The element-wise epilogue FuseOps or a composite adds
follows in the same kernel.

In the blocked layout ``NCHW{b}c`` the patch's k runs over (channel block, kh, kw, channel in
block): the innermost ``b`` k of a row are ``b`` consecutive values of the input, so the
prologue reads and writes whole vectors. An NCHW input is converted pixel major, with the
conv's padding as zeros, and k runs over (kh, kw, channel): each kernel row of a patch is one
contiguous run of ``KW x channels`` values, copied as a vector (an RGB stem's 3 channels are
padded to 4; a narrow blocked input read by AMX tiles has each run padded to whole tile rows). A blocked input whose AMX tiles read it in place (``conv_geometry.reads_input_directly``)
is converted the same way; its patch block, marked ``DIRECT_INPUT``, is dropped once the tiles
are scheduled (``schedules/cpu/direct_tiles.py``). A patch matrix re-reads each input value
``KH x KW`` times (strided convs fewer): for a 1x1 conv it is the input itself, converted and
in pixel-major order.

Its rows are per output row (``[N x OH, OW]``) where a tile divides OW, else the pixels, padded
to whole tiles where no large tile divides them (``conv_geometry.flat_rows``). What the conv
is (``ConvGeometry``) and its weight matrix are ``conv_geometry.py``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tvm
from tvm import te

from .conv_geometry import ConvGeometry, flat_rows, pixel_major, reads_input_directly, rows_per_output_row
from .packed_weights import round_up

# Block annotations for the schedule rules: a block whose values are each read many times (the
# converted input, which the patches read KH x KW times) is computed once, not inlined into its
# readers; the patches' k loop as the extents of (channel block, kh, kw, channel in block).
READ_MANY_TIMES = "tvm_fusion.read_many_times"
PATCH_LOOPS = "tvm_fusion.patch_loops"
# On a conv's patch block whose rows the tiles may read from the converted input instead
# (``reads_input_directly``): [OH, row stride, column stride, row dilation, column dilation, k per
# kernel row (``run_depth``), C].
DIRECT_INPUT = "tvm_fusion.direct_input"


@dataclasses.dataclass(frozen=True)
class PatchOperand:
    """What a kernel's sum reads its patches as: the operand ``dtype`` and ``depth_block`` (k
    per weight group), ``convert`` (a float32 input value to its operand element), the element
    ``zero`` stands for (the padding), and the names of the converted input, patch and output
    blocks (the schedule rules find them by name)."""

    dtype: str
    depth_block: int
    convert: Callable[[tvm.tirx.PrimExpr], tvm.tirx.PrimExpr]
    zero: int
    input_name: str
    patches_name: str
    output_name: str


def _rows_shape(geometry: ConvGeometry) -> tuple[int, ...]:
    g = geometry
    return (g.batch * g.out_height, g.out_width) if rows_per_output_row(g) else (flat_rows(g),)


def _pixel(geometry: ConvGeometry, n, y, x) -> tuple:
    """The patch row of output pixel (n, y, x)."""
    g = geometry
    if rows_per_output_row(g):
        return (n * g.out_height + y, x)
    return ((n * g.out_height + y) * g.out_width + x,)


def _output_pixel(geometry: ConvGeometry, rows: tuple) -> tuple:
    """(batch, output row, output column) of patch row ``rows``, and the condition that it is
    a pixel (not a padding row; None where there are none), the batch clamped inside."""
    g = geometry
    if len(rows) == 2:
        (line, ow) = rows
        return line // g.out_height, line % g.out_height, ow, None
    (p,) = rows
    n, rest = p // (g.out_height * g.out_width), p % (g.out_height * g.out_width)
    if flat_rows(g) == g.pixels:
        return n, rest // g.out_width, rest % g.out_width, None
    return tvm.tirx.min(n, g.batch - 1), rest // g.out_width, rest % g.out_width, p < g.pixels


def _patch_index(geometry: ConvGeometry, rows: tuple, k):
    """(batch, channel block, input row, input column, channel in block) of a blocked input's
    patch element ``[*rows, k]``, and whether it lies inside the input (else padding)."""
    g = geometry
    kh, kw = g.kernel
    block = g.data_block
    n, oh, ow, pixel = _output_pixel(g, rows)
    tap = k // block
    outer, r, s = tap // (kh * kw), tap // kw % kh, tap % kw
    y = oh * g.strides[0] + r * g.dilation[0] - g.padding[0]
    x = ow * g.strides[1] + s * g.dilation[1] - g.padding[1]
    inside = tvm.tirx.all(y >= 0, y < g.height, x >= 0, x < g.width, k < g.depth)
    if pixel is not None:
        inside = tvm.tirx.all(inside, pixel)
    return (n, outer, y, x, k % block), inside


def patches_te(data: te.Tensor, geometry: ConvGeometry, operand: PatchOperand) -> te.Tensor:
    """The patch matrix (rows ``_rows_shape``, K padded to whole depth blocks with zeros) as
    ``operand`` elements: the input is converted once, then copied into the patches (each value
    KH x KW times). A 1x1 conv's patches read each value at most once: its conversion is left
    for the rules to inline into them, saving a pass over the input. An NCHW input's are
    ``_pixel_major_patches_te``'s, and so are those of a blocked input the AMX tiles read
    directly (``reads_input_directly``)."""
    if pixel_major(geometry):
        return _pixel_major_patches_te(data, geometry, operand)
    attrs = {} if tuple(geometry.kernel) == (1, 1) else {READ_MANY_TIMES: 1}
    converted = te.compute(data.shape, lambda *i: operand.convert(data[i]), name=operand.input_name, attrs=attrs)

    def compute(*index):
        *rows, k = index
        (n, outer, y, x, inner), inside = _patch_index(geometry, tuple(rows), k)
        at = (n, outer, _clamp(y, geometry.height), _clamp(x, geometry.width), inner)
        return _where(inside, converted[at], operand)

    depth = round_up(geometry.depth, operand.depth_block)
    loops = [geometry.channels // geometry.data_block, *geometry.kernel, geometry.data_block]
    attrs = {PATCH_LOOPS: loops} if depth == geometry.depth else {}  # K padded: one k loop
    return te.compute((*_rows_shape(geometry), depth), compute, name=operand.patches_name, attrs=attrs)


def _pixel_major_patches_te(data: te.Tensor, geometry: ConvGeometry, operand: PatchOperand) -> te.Tensor:
    """An NCHW input's patches: the input converted once into ``geometry.padded_input`` (pixel
    major, its padding zeros), so that a patch row is KH runs of ``KW x channels`` contiguous
    values (k over kh, kw, channel), each copied as one vector. Read from the channel planes,
    a row's values would be gathered one by one (a 24-channel 3x1 conv's ran slower than float32).
    A blocked input's (``reads_input_directly``) is converted the same way, a block's channels
    one vector, and its patch block is marked ``DIRECT_INPUT`` for the AMX rules."""
    g = geometry
    top, left = g.padding
    channels = g.patch_channels

    if g.depth % operand.depth_block:
        raise ValueError(f"{g.patch_channels} channels per pixel do not fill whole depth blocks of "
                         f"{operand.depth_block}: pad them to a multiple of it (NCHW_CHANNEL_MULTIPLE)")

    def convert(n, y, x, c):
        inside = tvm.tirx.all(y >= top, y < top + g.height, x >= left, x < left + g.width, c < g.channels)
        y, x = _clamp(y - top, g.height), _clamp(x - left, g.width)
        if g.data_block:
            at = (n, c // g.data_block, y, x, c % g.data_block)
        else:
            at = (n, tvm.tirx.min(c, g.channels - 1), y, x)
        return _where(inside, operand.convert(data[at]), operand)

    converted = te.compute(g.padded_input, convert, name=operand.input_name, attrs={READ_MANY_TIMES: 1})
    run = g.run_depth  # a padded run's last k read the next pixels (zero weights)

    def compute(*index):
        *rows, k = index
        n, oh, ow, pixel = _output_pixel(g, tuple(rows))
        r, s, c = k // run, k % run // channels, k % run % channels
        value = converted[n, oh * g.strides[0] + r * g.dilation[0], ow * g.strides[1] + s * g.dilation[1], c]
        return value if pixel is None else _where(pixel, value, operand)

    attrs = {PATCH_LOOPS: [g.kernel[0], run]}
    if reads_input_directly(g):
        attrs[DIRECT_INPUT] = [g.out_height, *g.strides, *g.dilation, run, channels]
    return te.compute((*_rows_shape(g), g.depth), compute, name=operand.patches_name, attrs=attrs)


def _clamp(index: tvm.tirx.PrimExpr, bound: int) -> tvm.tirx.PrimExpr:
    """``index`` kept inside ``[0, bound)``: a read that ``_where`` masks must still land in the buffer."""
    return tvm.tirx.max(tvm.tirx.min(index, bound - 1), 0)


def _where(inside: tvm.tirx.PrimExpr, value: tvm.tirx.PrimExpr, operand: PatchOperand) -> tvm.tirx.PrimExpr:
    """``value`` (a clamped read) where ``inside``, else ``operand.zero``, as a mask of its bits: in a
    ``Select``, TVM's simplifier drops the read's clamps (the condition implies them) and a false
    lane then reads outside the buffer (a vector load there faulted). The mask keeps the read
    out of the condition's reach, and vectorizes as a ``Select`` does."""
    ones = tvm.tirx.const((1 << tvm.DataType(operand.dtype).bits) - 1, operand.dtype)
    mask = tvm.tirx.Select(inside, ones, tvm.tirx.const(0, operand.dtype))
    return (value & mask) | (tvm.tirx.const(operand.zero, operand.dtype) & ~mask)


def output_te(total: te.Tensor, geometry: ConvGeometry, name: str,
              value: Callable[[tvm.tirx.PrimExpr, tvm.tirx.PrimExpr], tvm.tirx.PrimExpr] = lambda v, _: v) -> te.Tensor:
    """The sum's rows by ``Co16`` columns in the conv's output layout, each ``value(sum, output
    channel)``."""
    g = geometry
    if g.out_block:
        shape = (g.batch, g.out_channels // g.out_block, g.out_height, g.out_width, g.out_block)

        def blocked(n, cb, y, x, c):
            channel = cb * g.out_block + c
            return value(total[(*_pixel(g, n, y, x), channel)], channel)

        return te.compute(shape, blocked, name=name)
    shape = (g.batch, g.out_channels, g.out_height, g.out_width)
    return te.compute(shape, lambda n, c, y, x: value(total[(*_pixel(g, n, y, x), c)], c), name=name)

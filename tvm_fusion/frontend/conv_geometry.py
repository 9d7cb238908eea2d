"""What a patch kernel needs of a conv2d (``conv_patches.py`` builds the kernel from it): its
geometry, whether the packed-weight kernels take it and why not, the ``[K, Co]`` weight matrix
its patch rows multiply, how its rows are laid out, and the numpy patch rows the bf16 gate
multiplies.

The patch k runs over (channel block, kh, kw, channel in block) for a blocked input
(``NCHW{b}c``), over (kh, kw, channel) for an input converted pixel major: an NCHW one, and a
blocked one whose AMX tiles read it in place (``reads_input_directly``). Where those tiles read
a narrow input (channels short of a tile row), each kernel row's run of ``KW x channels`` k is
padded to whole tile rows (``run_depth``), the padding's weights zero.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import tvm
from tvm import relax

from .packed_weights import round_up

# Input channels a conv of a blocked input (NCHW{b}c) needs for a patch kernel: with fewer, each
# patch value feeds too few products for the tiles to pay for the copies ...
MIN_CHANNELS = 16
# ... and one strided along its columns, whose float32 kernel gathers every input vector.
# (An NCHW input's patches are pixel-major runs, with rules of their own below.)
MIN_STRIDED_CHANNELS = 8
# Output pixels (the sum's rows) a conv needs: a squeeze-and-excitation block's convs on a pooled
# map have one, which its own fusion computes (a patch kernel inside it ran at half its speed).
MIN_PIXELS = 16
# Rows of an AMX tile (schedules/cpu/amx_tiles.py): a tile of fewer than MIN_TILE_ROWS rows
# wastes most of its 16.
TILE_ROWS, MIN_TILE_ROWS = 16, 5
# Bytes of an AMX tile row: an A-tile row holds 32 bf16 or 64 int8 k (``tile_row_depth``).
TILE_ROW_BYTES = 64
# An NCHW input's channels per pixel in the patches are padded to this (ConvGeometry.patch_channels).
NCHW_CHANNEL_MULTIPLE = 2
# Channels an NCHW input needs: basic-pitch's 1-channel 1x256 filters over its audio took its
# bf16 outputs to a cosine of 0.995 against float32.
MIN_NCHW_CHANNELS = 2
# Output channels an NCHW input's patches need (where its tiles copy them): past one tile of 16
# columns, each patch value is reused enough to pay for the conversion and the copies (with the 3 -> 16 RGB stems of
# picodet-layout and YOLOv8n as patches, their bf16 builds ran 1.07x and 1.06x slower).
MIN_NCHW_OUT_CHANNELS = 17
# K an NCHW input's patches need (half an AMX tile's 32): a 1-channel 3x3 conv's 10 fill a third.
MIN_NCHW_DEPTH = 16
# A narrow input's AMX tiles read a kernel row's KW x channels run padded to whole tile rows of k,
# the padding k multiplied by zero weights: at most this many times the run's k (a 16-channel
# 3x3's 48 k in 64: 1.33x; an 8-channel 5x5's 40 in 64, 1.6x, keeps its patches).
MAX_RUN_PADDING = 1.4
# Rows of a tile below which a flat conv's rows are padded to whole tiles of 16 (``flat_rows``).
MIN_PADDED_TILE_ROWS = 8
_BLOCKED = re.compile(r"NCHW(\d+)c")
_BLOCKED_WEIGHT = re.compile(r"OIHW(\d+)i(\d+)o")
_OUT_BLOCKED_WEIGHT = re.compile(r"OIHW(\d+)o")


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """What the kernel needs of a conv: its layouts' channel blocks (0: NCHW), the input's
    ``[N, C, H, W]``, the output's ``[Co, OH, OW]``, its kernel, strides, dilation and
    (top, left) padding; the fewest rows a tile within an output row may have
    (``rows_per_output_row``: an AMX tile's by default, fewer for register tiles); and the k of
    one AMX A-tile row where the kernel's tiles may load the converted input directly (32 bf16,
    64 int8; 0: always through a patch matrix, as register tiles read it: ``reads_input_directly``)."""

    data_block: int
    out_block: int
    batch: int
    channels: int
    height: int
    width: int
    out_channels: int
    out_height: int
    out_width: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int]
    min_tile_rows: int = MIN_TILE_ROWS
    tile_row_depth: int = 0

    @property
    def patch_channels(self) -> int:
        """The channels of each tap in a patch row: an NCHW input's padded to a multiple of
        ``NCHW_CHANNEL_MULTIPLE`` (an RGB stem's 3 as 4, the 4th zero), so that K is whole
        depth blocks and every tap's run starts on one."""
        return self.channels if self.data_block else round_up(self.channels, NCHW_CHANNEL_MULTIPLE)

    @property
    def run_depth(self) -> int:
        """k per kernel row: its ``KW x patch_channels`` values, padded to whole A-tile rows
        where the tiles read a narrow input's runs (``reads_runs``)."""
        run = self.kernel[1] * self.patch_channels
        return round_up(run, self.tile_row_depth) if reads_runs(self) else run

    @property
    def depth(self) -> int:
        """K: the values of one receptive field (with an NCHW input's padding channels, and the
        padding of each kernel row's run: ``run_depth``)."""
        return self.kernel[0] * self.run_depth

    @property
    def padded_input(self) -> tuple[int, int, int, int]:
        """A pixel-major input as the kernel converts it: ``[N, H', W', channels]`` (the
        padding around it written as zeros, ``patch_channels`` per pixel), so that each tap's
        ``KW x channels`` values are one contiguous run."""
        height, width = ((out - 1) * stride + (kernel - 1) * dilation + 1 for out, stride, kernel, dilation in zip(
            (self.out_height, self.out_width), self.strides, self.kernel, self.dilation))
        # a padded run reads past its row's last pixel: columns of zeros for the last pixel's
        past = -(-(self.run_depth - self.kernel[1] * self.patch_channels) // self.patch_channels)
        return (self.batch, height, width + past, self.patch_channels)

    @property
    def pixels(self) -> int:
        """M: the output pixels of the whole batch, the sum's rows."""
        return self.batch * self.out_height * self.out_width


def _block(layout: str, plain: str, blocked: re.Pattern) -> int | None:
    if layout == plain:
        return 0
    found = blocked.fullmatch(layout)
    return int(found.group(1)) if found else None


def conv_geometry(call: relax.Call, tile_row_depth: int = 0) -> ConvGeometry | str:
    """The geometry of a ``relax.nn.conv2d`` call, or why no patch kernel takes it: they
    take a float32 dense conv (groups 1) of static shapes in NCHW or ``NCHW{b}c``;
    ``tile_row_depth`` the k of an AMX A-tile row where tiles may read the input directly
    (``ConvGeometry.tile_row_depth``; 0 without them)."""
    attrs = call.attrs
    data, weight = call.args
    if int(attrs.groups) != 1:
        return f"a grouped conv ({attrs.groups} groups)"
    if str(data.ty.dtype) != "float32" or str(weight.ty.dtype) != "float32" or (
            attrs.out_dtype and str(attrs.out_dtype) not in ("float32", "void")):
        return f"a {data.ty.dtype} conv, not float32"
    data_block = _block(str(attrs.data_layout), "NCHW", _BLOCKED)
    out_block = _block(str(attrs.out_layout or attrs.data_layout), "NCHW", _BLOCKED)
    if data_block is None or out_block is None:
        return f"layouts {attrs.data_layout} -> {attrs.out_layout}, not NCHW or NCHW[x]c"
    shapes = [arg.ty.shape for arg in (data, weight)] + [call.ty.shape]
    if not all(isinstance(s, relax.ShapeExpr) and all(isinstance(d, tvm.tirx.IntImm) for d in s.values)
               for s in shapes):
        return "a shape is not static"
    (n, c, h, w, *_), _, out = ([int(d) for d in s.values] for s in shapes)
    if data_block:
        c *= data_block
    if n * out[2] * out[3] < MIN_PIXELS:
        return f"{n * out[2] * out[3]} output pixels (a conv on a pooled map): fewer than a tile's {MIN_PIXELS} rows"
    out_channels = out[1] * out_block if out_block else out[1]
    kernel = _weight_kernel(str(attrs.kernel_layout), [int(d) for d in weight.ty.shape.values])
    if kernel is None:
        return f"kernel layout {attrs.kernel_layout}"
    geometry = ConvGeometry(data_block, out_block, n, c, h, w, out_channels, out[2], out[3], kernel,
                            tuple(int(s) for s in attrs.strides), tuple(int(d) for d in attrs.dilation),
                            (int(attrs.padding[0]), int(attrs.padding[1])), tile_row_depth=tile_row_depth)
    if data_block:
        if not reads_input_directly(geometry) and c < (MIN_STRIDED_CHANNELS if geometry.strides[1] > 1 else MIN_CHANNELS):
            return f"{c} input channels in blocks: its patches cost more than tiles gain on so few products"
    elif c < MIN_NCHW_CHANNELS:
        return f"{c} input channel: a filter over a raw signal (audio), which bf16's 8-bit mantissa loses"
    elif geometry.depth < MIN_NCHW_DEPTH:
        return f"a receptive field of {c * kernel[0] * kernel[1]} values: under half a tile's k"
    elif out_channels < MIN_NCHW_OUT_CHANNELS and not reads_input_directly(geometry):
        return (f"{out_channels} output channels from an NCHW input: its conversion and patches cost more "
                "than one column of tiles saves")
    return geometry


def _weight_kernel(layout: str, shape: list[int]) -> tuple[int, int] | None:
    if layout == "OIHW" or _BLOCKED_WEIGHT.fullmatch(layout) or _OUT_BLOCKED_WEIGHT.fullmatch(layout):
        return shape[2], shape[3]
    return None


def oihw_weight(weight: np.ndarray, layout: str) -> np.ndarray:
    """A conv weight in ``OIHW``, ``OIHW{b}i{b}o`` or ``OIHW{b}o`` as plain ``[Co, C, KH, KW]``."""
    if layout == "OIHW":
        return weight
    if _BLOCKED_WEIGHT.fullmatch(layout):  # [Co/b, C/b, KH, KW, bi, bo]
        blocks_out, blocks_in, kh, kw, bi, bo = weight.shape
        return weight.transpose(0, 5, 1, 4, 2, 3).reshape(blocks_out * bo, blocks_in * bi, kh, kw)
    blocks_out, c, kh, kw, bo = weight.shape  # OIHW{b}o
    return weight.transpose(0, 4, 1, 2, 3).reshape(blocks_out * bo, c, kh, kw)


def weight_matrix(weight: np.ndarray, geometry: ConvGeometry) -> np.ndarray:
    """The plain ``[Co, C, KH, KW]`` weight as the ``[K, Co]`` matrix the patch rows multiply:
    k over (kh, kw, channel) for an input converted pixel major (``pixel_major``), else over
    (channel block, kh, kw, channel in block)."""
    out_channels, channels, kh, kw = weight.shape
    block = geometry.data_block
    if pixel_major(geometry):  # k over (kh, kw, channel), the padding channels' and runs' rows zero
        padded = np.pad(weight, ((0, 0), (0, geometry.patch_channels - channels), (0, 0), (0, 0)))
        runs = padded.transpose(2, 3, 1, 0).reshape(kh, -1, out_channels)
        runs = np.pad(runs, ((0, 0), (0, geometry.run_depth - runs.shape[1]), (0, 0)))
        return np.ascontiguousarray(runs.reshape(-1, out_channels))
    blocked = weight.reshape(out_channels, channels // block, block, kh, kw).transpose(1, 3, 4, 2, 0)
    return np.ascontiguousarray(blocked.reshape(-1, out_channels))


def rows_per_output_row(geometry: ConvGeometry) -> bool:
    """Whether the patch rows are laid out ``[N x OH, OW]`` (an output row per row of the
    matrix) rather than ``[pixels]``: the tiles then divide an output row and never straddle
    two, so the output layout's block and the epilogue follow each tile. Not where OW has no
    divisor of at least ``geometry.min_tile_rows`` up to 16 (a prime OW past 16, or a map a few
    columns wide: a conv1d's, 1): tiles of so few rows would waste most of each instruction."""
    width = geometry.out_width
    return max(d for d in range(1, TILE_ROWS + 1) if width % d == 0) >= geometry.min_tile_rows


def reads_input_directly(geometry: ConvGeometry) -> bool:
    """Whether the AMX tiles of this conv can load its patch rows from the converted input
    itself: a KxK conv (a 1x1's patches are its input already) whose input is converted pixel
    major (``[N, H', W', C]``, its padding written), whose tile rows each lie at one address per
    pixel: its channels are whole A-tile rows of k (a row then lies within one tap), or each
    kernel row's run is read padded (``reads_runs``); and whose tiles stay within an output row
    (``rows_per_output_row``: a tile's pixels are then a column stride of ``C`` values apart).
    The patch matrix is kept in the kernel as written (register tiles read it) and the AMX rules
    drop it (``schedules/cpu/direct_tiles.py``)."""
    g = geometry
    return bool(g.tile_row_depth and g.kernel != (1, 1) and rows_per_output_row(g)
                and (g.channels % g.tile_row_depth == 0 or _runs_fit(g)))


def reads_runs(geometry: ConvGeometry) -> bool:
    """Whether the tiles read a narrow input (channels short of whole tile rows) by kernel rows:
    a kernel row's taps are adjacent columns (dilation 1 along them), so its ``KW x C`` values
    are one run of the pixel-major input, and a run padded to whole tile rows
    (``MAX_RUN_PADDING``) reads on into the next pixels, whose k have zero weights (so an
    infinity there, times zero, makes the output NaN where the float32 conv never read it)."""
    g = geometry
    return bool(g.tile_row_depth) and g.channels % g.tile_row_depth != 0 and reads_input_directly(g)


def _runs_fit(geometry: ConvGeometry) -> bool:
    g = geometry
    run = g.kernel[1] * g.patch_channels
    return g.dilation[1] == 1 and round_up(run, g.tile_row_depth) <= MAX_RUN_PADDING * run


def pixel_major(geometry: ConvGeometry) -> bool:
    """Whether the patch k runs over (kh, kw, channel) from an input converted pixel major: an
    NCHW input's, and a blocked one that ``reads_input_directly``; else over (channel block, kh,
    kw, channel in block)."""
    return not geometry.data_block or reads_input_directly(geometry)


def flat_rows(geometry: ConvGeometry) -> int:
    """The patch rows of a conv whose rows are its pixels: their count, padded to whole tiles of
    16 where no divisor of at least ``MIN_PADDED_TILE_ROWS`` up to 16 divides it (475 pixels:
    tiles of 5 rows would re-read the weight for every 5 rows and fill a third of each AMX
    tile); the padding rows are zeros that no output reads."""
    pixels = geometry.pixels
    if pixels <= TILE_ROWS or max(d for d in range(1, TILE_ROWS + 1) if pixels % d == 0) >= MIN_PADDED_TILE_ROWS:
        return pixels
    return round_up(pixels, TILE_ROWS)


def patch_rows(activation: np.ndarray, geometry: ConvGeometry) -> np.ndarray:
    """The float32 patch matrix ``[pixels, K]`` of an input in the conv's data layout (what the
    per-kernel gate multiplies by ``weight_matrix``)."""
    g = geometry
    plain = activation
    if g.data_block:  # [N, C/b, H, W, b] -> [N, C, H, W]
        n, blocks, h, w, b = activation.shape
        plain = activation.transpose(0, 1, 4, 2, 3).reshape(n, blocks * b, h, w)
    reach = [g.strides[i] * size + g.kernel[i] * g.dilation[i] for i, size in enumerate((g.out_height, g.out_width))]
    padded = np.pad(plain, ((0, 0), (0, 0), (g.padding[0], reach[0]), (g.padding[1], reach[1])))
    taps = []
    for r in range(g.kernel[0]):
        for s in range(g.kernel[1]):
            y0, x0 = r * g.dilation[0], s * g.dilation[1]
            taps.append(padded[:, :, y0:y0 + g.strides[0] * g.out_height:g.strides[0],
                               x0:x0 + g.strides[1] * g.out_width:g.strides[1]])
    stacked = np.stack(taps, axis=2)  # [N, C, taps, OH, OW]
    n, c = stacked.shape[:2]
    if not pixel_major(g):  # k over (channel block, tap, channel in block)
        b = g.data_block
        stacked = stacked.reshape(n, c // b, b, len(taps), g.out_height, g.out_width).transpose(0, 4, 5, 1, 3, 2)
    else:  # k over (tap, channel), with the padding channels, each kernel row's run padded
        stacked = np.pad(stacked, ((0, 0), (0, g.patch_channels - c), (0, 0), (0, 0), (0, 0))).transpose(0, 3, 4, 2, 1)
        stacked = stacked.reshape(g.pixels, g.kernel[0], -1)
        stacked = np.pad(stacked, ((0, 0), (0, 0), (0, g.run_depth - stacked.shape[2])))
    return np.ascontiguousarray(stacked.reshape(g.pixels, g.depth))

"""Winograd F(m x m, 3 x 3) for dense 3x3 stride-1 convs in the blocked layout NCHW[x]c.

A direct 3x3 conv does 9 multiply-adds per output and input channel. Winograd's minimal
filtering computes an m x m output tile from an (m+2) x (m+2) input tile with (m+2)^2
multiply-adds per channel pair: F(4x4, 3x3) does 36 for 16 outputs (2.25 per output, 4x fewer),
F(2x2, 3x3) 16 for 4 (2.25x fewer). The multiply-adds become 36 (or 16) independent matrix
products, one per point of the transformed tile, of the tiles' transformed inputs
``V = B^T d B`` by the transformed weights ``U = G g G^T``; the output tile is ``A^T M A``.

Stages (``winograd_conv2d_nchwc``), each a block named ``winograd_*`` (``WINOGRAD_STAGES``) by
which the CPU rule ``WinogradConv2dNCHWc`` knows the kernel and its stages:

    winograd_weight       U[e1, e2, oc, ic, ib, ob]     = G g G^T per (oc, ic) channel pair
    winograd_input_rows   [e1, c, n, ty, tx, ic, ib]    = B^T d per input tile
    winograd_input        V[e1, e2, n, ty, tx, ic, ib]  = (B^T d) B
    winograd_gemm         M[e1, e2, n, ty, tx, oc, ob]  = sum over input channels of V U
    winograd_output_rows  [a, e2, n, ty, tx, oc, ob]    = A^T M
    winograd_output       out[n, oc, y, x, ob]          = (A^T M) A at the tile's (y % m, x % m)

The transforms are sums with constant coefficients: each point is written as the sum of only
its nonzero terms, chosen by a select on the point that folds away once the schedule unrolls
the points. ``U`` depends on the weight alone; ``PrecomputeWinogradWeights`` computes it at
build time when the weight is a constant, so the kernel only reads it. The blocked conv's
legalization (``passes/blocked_layout_legalize.py``) emits this kernel where ``winograd_tile``
chooses a tile.

The tile size is the one with fewer multiply-adds over whole tiles covering the map (F(4x4)
where 4 divides it; a map no tile divides gets a last row and column of tiles computed on
zeros, their outputs past the map not stored); maps one row or column wide, where neither
saves enough, and convs with few channels, keep the direct conv. The larger tile's transform
constants (up to 8) round more than the direct sum: on unit-scale maps the outputs differ
from the direct conv's by up to about 5e-5, within the verifier's tolerances
(tests/passes/test_winograd_conv2d.py, tests/schedules/cpu/test_winograd_conv2d_nchwc.py).
"""

from __future__ import annotations

import re

import numpy as np
from tvm import te, tirx, topi

# The kernel's blocks, by name: its transformed weight (dropped when the build computes it,
# ``PrecomputeWinogradWeights``), input tiles (rows first), matrix products and output tiles
# (rows first). FuseTIR may add a "_1" to a name (``is_winograd_block``).
WINOGRAD_WEIGHT = "winograd_weight"
WINOGRAD_INPUT_ROWS = "winograd_input_rows"
WINOGRAD_INPUT = "winograd_input"
WINOGRAD_GEMM = "winograd_gemm"
WINOGRAD_OUTPUT_ROWS = "winograd_output_rows"
WINOGRAD_OUTPUT = "winograd_output"
WINOGRAD_STAGES = (WINOGRAD_WEIGHT, WINOGRAD_INPUT_ROWS, WINOGRAD_INPUT, WINOGRAD_GEMM, WINOGRAD_OUTPUT_ROWS,
                   WINOGRAD_OUTPUT)

# Lavin & Gray (2016), interpolation points 0, +-1, +-2 (m = 4) and 0, +-1 (m = 2).
_TRANSFORMS = {
    4: {
        "BT": [[4, 0, -5, 0, 1, 0],
               [0, -4, -4, 1, 1, 0],
               [0, 4, -4, -1, 1, 0],
               [0, -2, -1, 2, 1, 0],
               [0, 2, -1, -2, 1, 0],
               [0, 4, 0, -5, 0, 1]],
        "G": [[1 / 4, 0, 0],
              [-1 / 6, -1 / 6, -1 / 6],
              [-1 / 6, 1 / 6, -1 / 6],
              [1 / 24, 1 / 12, 1 / 6],
              [1 / 24, -1 / 12, 1 / 6],
              [0, 0, 1]],
        "AT": [[1, 1, 1, 1, 1, 0],
               [0, 1, -1, 2, -2, 0],
               [0, 1, 1, 4, 4, 0],
               [0, 1, -1, 8, -8, 1]],
    },
    2: {
        "BT": [[1, 0, -1, 0],
               [0, 1, 1, 0],
               [0, -1, 1, 0],
               [0, 1, 0, -1]],
        "G": [[1, 0, 0],
              [1 / 2, 1 / 2, 1 / 2],
              [1 / 2, -1 / 2, 1 / 2],
              [0, 0, 1]],
        "AT": [[1, 1, 1, 0],
               [0, 1, -1, -1]],
    },
}

# Below this the transforms cost more than the multiply-adds they save: the matrix products
# reduce over the input channels.
_MIN_CHANNELS = 16
# F(4x4) over fewer tiles loses to F(2x2) (a 3x3 map with 256 channels: one F(4x4) tile 469
# us, F(2x2) 214, direct 287 on Zen 1): a task's 36 products cannot spread over the cores.
_MIN_LARGE_TILES = 4
# The transforms cost about as much as a few multiply-adds per output; a cover with more than
# this many (a map one row high, 8 by F(2x2): tiles half of zeros) keeps the direct conv's 9.
_MAX_MULTIPLY_ADDS_PER_OUTPUT = 7.5
# The transformed filters, (m+2)^2 values per channel pair against the direct conv's 9, are
# read from memory on every call, by every task; on a deep conv over a small map they outweigh
# the map many times over, and the direct conv, whose tasks are then channel tiles that read
# each filter once (Conv2dNCHWc), wins. With 16 lanes (AVX-512) Winograd declines a conv whose
# transformed filters exceed both an L2 share in bytes and ``_MAX_FILTER_VALUES_PER_MAP_VALUE``
# values per input map value ((m+2)^2 x out channels / pixels). resnet18 on Emerald Rapids,
# each conv's time in the model, Winograd against direct: 28x28, 128 channels (5.9) 432 against
# 626 us; 14x14, 256 (47) 773 against 769; 7x7, 512 (376) 1775 against 999. Not measured with
# 8 lanes, where the FMAs are half as fast per byte moved: AVX2 keeps Winograd there.
_MAX_FILTER_VALUES_PER_MAP_VALUE = 32
_FILTER_BYTES_IN_CACHE = 1 << 20
# Multiply-adds two cores do in the time one float32 filter value streams in from memory: the
# FMA peak over the triad bandwidth (Emerald Rapids, 2 cores: 268 G multiply-adds/s, 49.6 GB/s:
# 5.4 per byte, 22 per value). A conv whose tiles reuse each transformed filter value fewer
# times waits on its filters: opennsfw-tf's 3x3 convs of 128 channels over 14x14 (16 tiles of
# F(4x4), 49 of F(2x2)) ran the model 7 % faster as F(2x2) (6.20 -> 5.77 ms, OpenVINO f32 6.04).
_MULTIPLY_ADDS_PER_STREAMED_VALUE = 24


def is_winograd_block(name: str, stage: str) -> bool:
    """Whether a block named ``name`` is the Winograd ``stage`` (a WINOGRAD_* name)."""
    return re.fullmatch(re.escape(stage) + r"(_\d+)?", name) is not None


def transform_matrices(tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B^T, G, A^T) of F(tile x tile, 3 x 3) in float64."""
    matrices = _TRANSFORMS[tile]
    return tuple(np.array(matrices[name], dtype="float64") for name in ("BT", "G", "AT"))


def winograd_tile(kernel_size, strides, dilation, groups: int, data_shape, out_shape, dtype: str) -> int | None:
    """The output tile (4 or 2) of a blocked conv (``data_shape`` and ``out_shape`` NCHW[x]c,
    None when symbolic), or None where the direct conv stays: not a 3x3 stride-1 undilated
    ungrouped float32 conv, a symbolic map, few channels, or a map where no tile saves enough.

    A map the tile does not divide is covered by whole tiles, the last row and column of tiles
    reaching past it (computed on zeros, not stored). The tile is the one with the fewest
    multiply-adds over that cover, or the longer time its transformed filters take to stream
    in where they are too large to stay in cache (``_cost_per_output``; ties: F(2x2), whose
    constants round less); F(4x4) needs ``_MIN_LARGE_TILES`` tiles. A deep conv over a small
    map, whose transformed filters outweigh the map (``_MAX_FILTER_VALUES_PER_MAP_VALUE``, with
    16 lanes), stays direct."""
    if (tuple(kernel_size) != (3, 3) or tuple(strides) != (1, 1) or tuple(dilation) != (1, 1)
            or groups != 1 or dtype != "float32" or data_shape is None or out_shape is None):
        return None
    _, in_chunks, _, _, in_block = data_shape
    _, out_chunks, rows, columns, out_block = out_shape
    if min(in_chunks * in_block, out_chunks * out_block) < _MIN_CHANNELS:
        return None
    channel_pairs = in_chunks * in_block * out_chunks * out_block
    candidates = [(_cost_per_output(tile, rows, columns, channel_pairs), tile) for tile in (2, 4)
                  if tile == 2 or -(-rows // tile) * -(-columns // tile) >= _MIN_LARGE_TILES]
    _, tile = min(candidates, default=(None, None))
    if tile is None or _multiply_adds_per_output(tile, rows, columns) > _MAX_MULTIPLY_ADDS_PER_OUTPUT:
        return None
    filter_values = (tile + 2) ** 2 * channel_pairs
    outweigh = (in_block >= 16 and filter_values * 4 > _FILTER_BYTES_IN_CACHE
                and filter_values > _MAX_FILTER_VALUES_PER_MAP_VALUE * in_chunks * in_block * rows * columns)
    return None if outweigh else tile


def _cost_per_output(tile: int, rows: int, columns: int, channel_pairs: int) -> float:
    """F(tile x tile)'s time per output and channel pair in multiply-adds: its multiply-adds,
    or, where its transformed filters are past ``_FILTER_BYTES_IN_CACHE`` (read from memory on
    every call), the time their bytes take to stream in when that is longer: each of the
    (tile+2)^2 matrix products reuses a filter value once per tile of the map, and a map of few
    tiles waits on the filters (``_MULTIPLY_ADDS_PER_STREAMED_VALUE``)."""
    tiles = -(-rows // tile) * -(-columns // tile)
    if (tile + 2) ** 2 * channel_pairs * 4 > _FILTER_BYTES_IN_CACHE:
        tiles = max(tiles, _MULTIPLY_ADDS_PER_STREAMED_VALUE)
    return tiles * (tile + 2) ** 2 / (rows * columns)


def _multiply_adds_per_output(tile: int, rows: int, columns: int) -> float:
    """Multiply-adds per output and channel pair of F(tile x tile) over whole tiles covering
    the map (9 for the direct conv)."""
    return -(-rows // tile) * -(-columns // tile) * (tile + 2) ** 2 / (rows * columns)


def weight_transform(weight: np.ndarray, tile: int) -> np.ndarray:
    """``U`` of a blocked weight [OC/o, IC/i, 3, 3, i, o] -> [e1, e2, OC/o, IC/i, i, o], in
    float64 then cast (what ``winograd_weight`` computes in the kernel)."""
    _, g, _ = transform_matrices(tile)
    transformed = np.einsum("ak,bl,ocklij->abocij", g, g, weight.astype("float64"))
    return np.ascontiguousarray(transformed.astype(weight.dtype))


def winograd_conv2d_nchwc(data: te.Tensor, kernel: te.Tensor, padding, tile: int) -> te.Tensor:
    """The conv ``_conv2d_nchwc`` computes (3x3, stride 1), by F(tile x tile, 3 x 3)."""
    _, g, _ = transform_matrices(tile)
    points = tile + 2
    out_chunks, in_chunks, _, _, in_block, out_block = (int(dim) for dim in kernel.shape)
    transformed = te.compute(
        (points, points, out_chunks, in_chunks, in_block, out_block),
        lambda e1, e2, oc, ic, ib, ob: _by_index(e1, points, lambda a: _by_index(
            e2, points, lambda b: _weighted_sum([(g[a, ky] * g[b, kx], kernel[oc, ic, ky, kx, ib, ob])
                                                 for ky in range(3) for kx in range(3)]))),
        name=WINOGRAD_WEIGHT)
    return winograd_conv2d_transformed(data, transformed, padding, tile)


def winograd_conv2d_transformed(data: te.Tensor, transformed: te.Tensor, padding, tile: int) -> te.Tensor:
    """The conv of ``data`` by the weight whose transform is ``transformed`` [e1, e2, OC/o,
    IC/i, i, o]: what a Winograd conv's kernel computes once its weight is precomputed.

    The input and output transforms are each two passes of one matrix (``B^T d`` then its rows
    times ``B``), not one pass of their product: a third of the arithmetic for F(4x4), and each
    point's select chooses among (m+2) short sums rather than (m+2)^2 long ones (the unrolled
    chains of long sums took compile times up by a minute per model)."""
    bt, _, at = transform_matrices(tile)
    points = tile + 2
    batch, in_chunks, _, _, in_block = (int(dim) for dim in data.shape)
    out_chunks, out_block = int(transformed.shape[2]), int(transformed.shape[5])
    padded, out_h, out_w = _padded(data, padding, tile)
    tiles_y, tiles_x = -(-out_h // tile), -(-out_w // tile)
    input_rows = te.compute(  # (B^T d)[e1, c]
        (points, points, batch, tiles_y, tiles_x, in_chunks, in_block),
        lambda e1, c, n, ty, tx, ic, ib: _by_index(
            e1, points, lambda a: _weighted_sum([(bt[a, r], padded[n, ic, ty * tile + r, tx * tile + c, ib])
                                                 for r in range(points)])),
        name=WINOGRAD_INPUT_ROWS)
    tiles = te.compute(  # (B^T d B)[e1, e2]
        (points, points, batch, tiles_y, tiles_x, in_chunks, in_block),
        lambda e1, e2, n, ty, tx, ic, ib: _by_index(
            e2, points, lambda b: _weighted_sum([(bt[b, c], input_rows[e1, c, n, ty, tx, ic, ib])
                                                 for c in range(points)])),
        name=WINOGRAD_INPUT)
    ic = te.reduce_axis((0, in_chunks), "ic")
    ib = te.reduce_axis((0, in_block), "ib")
    products = te.compute(
        (points, points, batch, tiles_y, tiles_x, out_chunks, out_block),
        lambda e1, e2, n, ty, tx, oc, ob: te.sum(
            tiles[e1, e2, n, ty, tx, ic, ib] * transformed[e1, e2, oc, ic, ib, ob], axis=[ic, ib]),
        name=WINOGRAD_GEMM)
    output_rows = te.compute(  # (A^T M)[a, e2]
        (tile, points, batch, tiles_y, tiles_x, out_chunks, out_block),
        lambda a, e2, n, ty, tx, oc, ob: _by_index(
            a, tile, lambda row: _weighted_sum([(at[row, e1], products[e1, e2, n, ty, tx, oc, ob])
                                                for e1 in range(points)])),
        name=WINOGRAD_OUTPUT_ROWS)
    return te.compute(  # (A^T M A)[y % m, x % m]
        (batch, out_chunks, out_h, out_w, out_block),
        lambda n, oc, y, x, ob: _by_index(
            x % tile, tile, lambda column: _weighted_sum(
                [(at[column, e2], output_rows[y % tile, e2, n, y // tile, x // tile, oc, ob])
                 for e2 in range(points)])),
        name=WINOGRAD_OUTPUT)


def _by_index(index, extent: int, value):
    """``value(i)`` at ``index == i``: a chain of selects, one per value of the index."""
    result = value(extent - 1)
    for i in reversed(range(extent - 1)):
        result = tirx.Select(index == i, value(i), result)
    return result


def _weighted_sum(terms: list) -> tirx.PrimExpr:
    """``sum(coefficient * value)`` over the nonzero coefficients (unit ones multiply nothing)."""
    result = None
    for coefficient, value in terms:
        if coefficient == 0:
            continue
        term = value if coefficient == 1 else (-value if coefficient == -1
                                                else value * tirx.const(coefficient, value.dtype))
        result = term if result is None else result + term
    return result


def _padded(data: te.Tensor, padding, tile: int) -> tuple[te.Tensor, int, int]:
    """The map padded for a 3x3 stride-1 window (``padding``: top, left, bottom, right) and
    with zeros below and right to whole tiles, and the output rows and columns."""
    top, left, bottom, right = padding
    rows, columns = (int(dim) for dim in data.shape[2:4])
    out_rows, out_columns = rows + top + bottom - 2, columns + left + right - 2
    bottom += -out_rows % tile
    right += -out_columns % tile
    if top or left or bottom or right:
        data = topi.nn.pad(data, [0, 0, top, left, 0], [0, 0, bottom, right, 0], name="pad_temp")
    return data, out_rows, out_columns

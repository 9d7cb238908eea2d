"""The weight layout both integer and bf16 matmul kernels read: column panels of 16 output
columns, each holding ``depth_block`` consecutive k per column (4 for ``vpdpbusd``/``tdpbusd``'s
int8, 2 for ``tdpbf16ps``'s bf16), ``[N16/16, Kd/d, 16, d]``, zero-padded (the padding adds
nothing to a sum). It is also AMX's B-tile layout, so one packing serves every rule."""

from __future__ import annotations

import numpy as np

COLUMN_BLOCK = 16  # output columns per panel: 16 four-byte accumulator lanes
# The most rows of a register tile of these kernels (schedules/cpu/register_tiles.py): a bf16
# matmul's rows are padded to a multiple of it where no AMX tile takes them (passes/bf16_matmuls.py).
REGISTER_TILE_ROWS = 4


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def packed_shape(depth: int, columns: int, depth_block: int) -> tuple[int, int, int, int]:
    """The packed shape of a ``[depth, columns]`` weight."""
    return (round_up(columns, COLUMN_BLOCK) // COLUMN_BLOCK, round_up(depth, depth_block) // depth_block,
            COLUMN_BLOCK, depth_block)


def pack_panels(weight: np.ndarray, depth_block: int) -> np.ndarray:
    """``[K, N]`` as ``[N16/16, Kd/d, 16, d]`` in ``weight``'s dtype, zero-padded:
    ``packed[j, q, c, r] = weight[d*q + r, 16*j + c]``."""
    depth, columns = weight.shape
    padded = np.zeros((round_up(depth, depth_block), round_up(columns, COLUMN_BLOCK)), weight.dtype)
    padded[:depth, :columns] = weight
    blocks = padded.reshape(padded.shape[0] // depth_block, depth_block, padded.shape[1] // COLUMN_BLOCK,
                            COLUMN_BLOCK)
    return np.ascontiguousarray(blocks.transpose(2, 0, 3, 1))

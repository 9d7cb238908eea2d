"""Grouped convs with narrow groups, computed as groups of whole channel blocks.

RegNet's and ResNeXt's 3x3 convs have groups 8 channels wide, below AVX-512's 16-channel
block, and such a conv used to keep the whole model in NCHW. Merging neighbouring groups until
each is whole blocks, in and out, gives a grouped conv the blocked dense kernel runs (output
block ``o`` reads only its group's input blocks, ``blocked_layout_legalize._conv2d_nchwc``): the merged
weight is block diagonal, its off-group filters zero, which add exactly 0 and cost
``merge`` times the original multiply-adds. At most ``MAX_MERGE`` of them: two 8-wide groups
per 16-channel block.
"""

from __future__ import annotations

import numpy as np

MAX_MERGE = 2


def merged_groups(filters: np.ndarray, groups: int, positions: tuple[int, ...], width: int,
                  block: int) -> tuple[np.ndarray, int] | None:
    """A grouped conv's OIHW ``filters`` (``groups`` groups, as many outputs as inputs each),
    rewritten for an input map ``width`` channels wide that holds input channel ``i`` at
    ``positions[i]`` (the other channels padding): the filters of a conv with the same channel
    positions in its output and whole ``block``s per group, and its groups. None when the
    groups are not as wide in as out, or merged groups would be more than ``MAX_MERGE`` times
    as wide."""
    out_channels, group_width = filters.shape[:2]
    if (groups == 1 or out_channels != len(positions) or out_channels != groups * group_width
            or width % block):
        return None
    positions = np.asarray(positions)
    group_of = np.arange(out_channels) // group_width
    for blocks_per_group in range(1, width // block + 1):
        merged_width = blocks_per_group * block
        if width % merged_width:
            continue
        chunk = positions // merged_width
        if all(len(set(chunk[group_of == group])) == 1 for group in range(groups)):
            break
    else:
        return None
    if merged_width > MAX_MERGE * group_width:
        return None
    merged = np.zeros((width, merged_width, *filters.shape[2:]), filters.dtype)
    for out_channel, position in enumerate(positions):
        group = group_of[out_channel]
        inputs = positions[group * group_width:(group + 1) * group_width] % merged_width
        merged[position, inputs] = filters[out_channel]
    return merged, width // merged_width

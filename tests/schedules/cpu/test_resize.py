"""Resize: (n, c, rows) across cores, output columns on vectors, with a fused add or concat."""

import pytest
from loop_structure import largest_divisor, loop_kinds, whole_vectors
from tvm import relax
from tvm.relax.op import image, nn

from tvm_fusion.schedules.cpu import Resize


def upsample(x, size, method="nearest_neighbor", mode="asymmetric", rounding="floor"):
    return image.resize2d(x, size, method=method, coordinate_transformation_mode=mode,
                          rounding_method=rounding)


MODES = {
    "nearest_asymmetric_floor": {"method": "nearest_neighbor", "mode": "asymmetric", "rounding": "floor"},
    "nearest_half_pixel_round_prefer_floor": {"method": "nearest_neighbor", "mode": "half_pixel",
                                              "rounding": "round_prefer_floor"},
    "linear_half_pixel": {"method": "linear", "mode": "half_pixel", "rounding": ""},
    "linear_align_corners": {"method": "linear", "mode": "align_corners", "rounding": ""},
}


def assert_rows_and_column_vectors(func, lanes, rows: int, columns: int):
    """(n, c, y) fused into one parallel row loop; the columns in tiles of up to 4 vectors (a
    divisor of the row when vectors do not divide it), vectorized."""
    tile = whole_vectors(columns, lanes, 4) or largest_divisor(columns, lanes)
    loops = loop_kinds(func)
    assert loops.parallel == [rows]
    assert loops.vectorized == [tile]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_resize_matches_unscheduled(assert_schedule_matches, lanes, mode):
    funcs = assert_schedule_matches(Resize(), lambda x: upsample(x, (18, 26), **MODES[mode]), x=(1, 16, 9, 13))
    assert_rows_and_column_vectors(*funcs.values(), lanes, rows=16 * 18, columns=26)


def test_resize_add_relu_matches_unscheduled(assert_schedule_matches):
    def merge(top, lateral):
        return nn.relu(relax.op.add(lateral, upsample(top, (20, 28))))

    assert_schedule_matches(Resize(), merge, top=(1, 16, 10, 14), lateral=(1, 16, 20, 28))


def test_concat_of_resized_levels_matches_unscheduled(assert_schedule_matches):
    def neck_output(p4, p3, p2):
        bilinear = upsample(p3, (24, 32), **MODES["linear_half_pixel"])
        return relax.op.concat([upsample(p4, (24, 32)), bilinear, p2], axis=1)

    assert_schedule_matches(Resize(), neck_output, p4=(1, 8, 6, 8), p3=(1, 8, 12, 16), p2=(1, 8, 24, 32))


def test_declines_conv_and_plain_elementwise(lowered, prim_funcs, target):
    mod = lowered(lambda x, w: nn.conv2d(x, w), x=(1, 4, 8, 8), w=(4, 4, 1, 1))
    mod_add = lowered(lambda a, b: relax.op.add(a, b), a=(1, 4, 8, 8), b=(1, 4, 8, 8))
    for func in [*prim_funcs(mod).values(), *prim_funcs(mod_add).values()]:
        assert Resize().apply(func, target, False) is None


def test_rows_run_in_parallel_and_columns_on_vectors(lowered, prim_funcs, target, lanes):
    mod = lowered(lambda top, lateral: relax.op.add(lateral, upsample(top, (56, 56))),
                  top=(1, 32, 28, 28), lateral=(1, 32, 56, 56))
    (func,) = prim_funcs(mod).values()
    scheduled = Resize().apply(func, target, False).mod["main"]
    assert_rows_and_column_vectors(scheduled, lanes, rows=32 * 56, columns=56)


@pytest.mark.parametrize("method", ["linear_half_pixel", "nearest_asymmetric_floor"])
@pytest.mark.parametrize("classes", [21, 1])
def test_a_blocked_map_resized_into_nchw_unrolls_each_pixels_channel_block(assert_schedule_matches, method,
                                                                           classes):
    """A segmentation head's class maps (blocked, 8 channels a block, 3 blocks) upsampled to
    the image in NCHW, 21 or 1 classes kept: rows of a channel block across cores, the block's
    channels unrolled (their loads contiguous), no gathered column vectors."""
    def head(x):
        blocked = image.resize2d(
            x, (20, 28), layout="NCHW8c", method=MODES[method]["method"],
            coordinate_transformation_mode=MODES[method]["mode"], rounding_method=MODES[method]["rounding"])
        nchw = relax.op.reshape(relax.op.permute_dims(blocked, [0, 1, 4, 2, 3]), (1, 24, 20, 28))
        return relax.op.strided_slice(nchw, [1], [0], [classes])

    (func,) = assert_schedule_matches(Resize(), head, x=(1, 3, 5, 7, 8)).values()
    loops = loop_kinds(func)
    assert loops.parallel == [-(-classes // 8) * 20]
    assert 8 in loops.unrolled and loops.vectorized == []

"""Conv2dNCHW: register-blocked direct conv with its epilogue fused per output tile."""

import pytest
from tvm import relax
from tvm.relax.op import add, matmul, nn

from tvm_fusion.schedules.cpu import Conv2dNCHW


@pytest.mark.parametrize(
    "x, w, strides, padding, dilation, groups",
    [((1, 16, 28, 28), (32, 16, 3, 3), 1, 1, 1, 1),     # 3x3, 2 vectors of columns
     ((1, 3, 30, 30), (16, 3, 3, 3), 2, 1, 1, 1),       # stem: 3 input channels, stride 2
     ((1, 24, 14, 14), (40, 24, 1, 1), 1, 0, 1, 1),     # 1x1, columns not a vector multiple
     ((2, 8, 9, 11), (12, 4, 3, 3), 1, 2, 2, 2),        # batch 2, dilated, grouped, odd sizes
     ((1, 16, 7, 7), (24, 16, 5, 5), 2, 2, 1, 1)],      # 5x5 stride 2 on a 7x7 map
)
def test_conv_bias_relu_matches_unscheduled(assert_schedule_matches, x, w, strides, padding, dilation, groups):
    channels = w[0]

    def block(x, w, b):
        conv = nn.conv2d(x, w, strides=strides, padding=padding, dilation=dilation, groups=groups)
        return nn.relu(add(conv, b))

    assert_schedule_matches(Conv2dNCHW(), block, rtol=1e-4, atol=1e-4, x=x, w=w, b=(1, channels, 1, 1))


def test_residual_and_hardswish_epilogue(assert_schedule_matches):
    def block(x, w, r):
        conv = nn.conv2d(x, w, padding=1)
        hardswish = relax.op.multiply(conv, relax.op.clip(relax.op.add(relax.op.multiply(
            conv, relax.const(1 / 6, "float32")), relax.const(0.5, "float32")), 0, 1))
        return nn.relu(add(hardswish, r))

    assert_schedule_matches(Conv2dNCHW(), block, rtol=1e-4, atol=1e-4, x=(1, 8, 12, 12), w=(8, 8, 3, 3),
                            r=(1, 8, 12, 12))


def test_declines_depthwise_and_matmul(lowered, prim_funcs, target):
    depthwise = lowered(lambda x, w: nn.conv2d(x, w, padding=1, groups=8), x=(1, 8, 10, 10), w=(8, 1, 3, 3))
    dense = lowered(matmul, x=(16, 32), w=(32, 16))
    for func in [*prim_funcs(depthwise).values(), *prim_funcs(dense).values()]:
        assert Conv2dNCHW().apply(func, target, False) is None

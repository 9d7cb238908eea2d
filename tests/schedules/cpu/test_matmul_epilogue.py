"""MatmulEpilogue: register-tiled matmul with its epilogue fused per tile."""

import pytest
from tvm import relax
from tvm.relax.op import add, divide, matmul, multiply, nn, permute_dims, sigmoid

from tvm_fusion.schedules.cpu import MatmulEpilogue


def _bias_gelu(x, w, b):
    return nn.gelu(add(matmul(x, w), b))


@pytest.mark.parametrize(
    "m, k, n",
    [(128, 256, 64), (7, 13, 4), (1, 64, 100), (33, 17, 48), (5, 8, 1)],
)
def test_bias_gelu_matches_unscheduled(assert_schedule_matches, m, k, n):
    assert_schedule_matches(
        MatmulEpilogue(), _bias_gelu, rtol=1e-4, atol=1e-4, x=(m, k), w=(k, n), b=(n,)
    )


def test_plain_matmul_writes_output_directly(assert_schedule_matches):
    assert_schedule_matches(MatmulEpilogue(), matmul, rtol=1e-4, atol=1e-4, x=(24, 40), w=(40, 48))


def test_residual_and_scale_epilogue(assert_schedule_matches):
    def block(x, w, b, r):
        return add(divide(add(matmul(x, w), b), relax.const(8.0)), r)

    assert_schedule_matches(
        MatmulEpilogue(), block, rtol=1e-4, atol=1e-4, x=(16, 32), w=(32, 48), b=(48,), r=(16, 48)
    )


def test_silu_epilogue(assert_schedule_matches):
    def block(x, w):
        y = matmul(x, w)
        return multiply(y, sigmoid(y))

    assert_schedule_matches(MatmulEpilogue(), block, rtol=1e-4, atol=1e-4, x=(9, 32), w=(32, 20))


def test_batched_attention_matmul(assert_schedule_matches):
    assert_schedule_matches(
        MatmulEpilogue(), matmul, rtol=1e-4, atol=1e-4, q=(1, 4, 24, 16), k=(1, 4, 16, 24)
    )


def test_weight_broadcast_over_batch(assert_schedule_matches):
    assert_schedule_matches(MatmulEpilogue(), matmul, rtol=1e-4, atol=1e-4, x=(3, 10, 16), w=(16, 32))


def test_declines_softmax(lowered, prim_funcs, target):
    mod = lowered(lambda x: nn.softmax(x, axis=-1), x=(8, 32))
    for func in prim_funcs(mod).values():
        assert MatmulEpilogue().apply(func, target, False) is None


def test_declines_transposed_weight(lowered, prim_funcs, target):
    mod = lowered(lambda x, w: matmul(x, permute_dims(w)), x=(8, 32), w=(16, 32))
    funcs = prim_funcs(mod)
    assert any(MatmulEpilogue().apply(f, target, False) is None for f in funcs.values())

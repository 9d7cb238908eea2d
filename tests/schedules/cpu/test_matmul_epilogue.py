"""MatmulEpilogue: register-tiled matmul with its epilogue fused per tile."""

import pytest
from loop_structure import largest_divisor, loop_kinds, matmul_row_tiles, whole_vectors
from tvm import relax, te
from tvm.relax.op import add, divide, matmul, multiply, nn, permute_dims, sigmoid

from tvm_fusion.schedules.cpu import MatmulEpilogue


def _bias_gelu(x, w, b):
    return nn.gelu(add(matmul(x, w), b))


def assert_register_tiled(funcs, lanes, batch, m, k, n):
    """One kernel; its (batch x column panel x row tile) loop runs in parallel over tiles of
    up to 8 rows (6 on AVX2; rows zero-padded where that fills the tiles better) x 2 vectors of
    columns (a divisor of the extent when vectors do not fit), the rows unrolled and the columns
    (update, init and epilogue store) vectorized; padded rows of A are copied K-wide vectors."""
    (func,) = funcs.values()
    rows, row_tiles = matmul_row_tiles(m, lanes)
    cols = whole_vectors(n, lanes, 2) or largest_divisor(n, 2 * lanes)
    loops = loop_kinds(func)
    assert loops.parallel == [batch * row_tiles * (n // cols)]
    padded = rows * row_tiles > m
    assert loops.vectorized.count(cols) >= 2
    assert sorted(loops.vectorized) == sorted([cols] * loops.vectorized.count(cols) + ([k] if padded else []))
    assert rows in loops.unrolled


@pytest.mark.parametrize(
    "m, k, n",
    [(128, 256, 64), (7, 13, 4), (1, 64, 100), (33, 17, 48), (5, 8, 1)],
)
def test_bias_gelu_matches_unscheduled(assert_schedule_matches, lanes, m, k, n):
    funcs = assert_schedule_matches(
        MatmulEpilogue(), _bias_gelu, rtol=1e-4, atol=1e-4, x=(m, k), w=(k, n), b=(n,)
    )
    assert_register_tiled(funcs, lanes, 1, m, k, n)


def test_plain_matmul_writes_output_directly(assert_schedule_matches, lanes):
    funcs = assert_schedule_matches(MatmulEpilogue(), matmul, rtol=1e-4, atol=1e-4, x=(24, 40), w=(40, 48))
    assert_register_tiled(funcs, lanes, 1, 24, 40, 48)


def test_residual_and_scale_epilogue(assert_schedule_matches, lanes):
    def block(x, w, b, r):
        return add(divide(add(matmul(x, w), b), relax.const(8.0)), r)

    funcs = assert_schedule_matches(
        MatmulEpilogue(), block, rtol=1e-4, atol=1e-4, x=(16, 32), w=(32, 48), b=(48,), r=(16, 48)
    )
    assert_register_tiled(funcs, lanes, 1, 16, 32, 48)


def test_silu_epilogue(assert_schedule_matches, lanes):
    def block(x, w):
        y = matmul(x, w)
        return multiply(y, sigmoid(y))

    funcs = assert_schedule_matches(MatmulEpilogue(), block, rtol=1e-4, atol=1e-4, x=(9, 32), w=(32, 20))
    assert_register_tiled(funcs, lanes, 1, 9, 32, 20)


def test_batched_attention_matmul(assert_schedule_matches, lanes):
    funcs = assert_schedule_matches(
        MatmulEpilogue(), matmul, rtol=1e-4, atol=1e-4, q=(1, 4, 24, 16), k=(1, 4, 16, 24)
    )
    assert_register_tiled(funcs, lanes, 4, 24, 16, 24)


def test_weight_broadcast_over_batch(assert_schedule_matches, lanes):
    funcs = assert_schedule_matches(MatmulEpilogue(), matmul, rtol=1e-4, atol=1e-4, x=(3, 10, 16), w=(16, 32))
    assert_register_tiled(funcs, lanes, 3, 10, 16, 32)


def test_declines_softmax(lowered, prim_funcs, target):
    mod = lowered(lambda x: nn.softmax(x, axis=-1), x=(8, 32))
    for func in prim_funcs(mod).values():
        assert MatmulEpilogue().apply(func, target, False) is None


def test_takes_the_matmul_after_a_separate_transpose_kernel(lowered, prim_funcs, target):
    """FuseOps leaves permute_dims in a kernel of its own: the matmul then reads the
    materialized B[k, j] and is this rule's, the transpose kernel is not."""
    mod = lowered(lambda x, w: matmul(x, permute_dims(w)), x=(8, 32), w=(16, 32))
    answered = {name: MatmulEpilogue().apply(f, target, False) is not None
                for name, f in prim_funcs(mod).items()}
    assert answered == {"matmul": True, "transpose": False}


def test_declines_a_matmul_reading_its_weight_transposed(target):
    """C[i, j] += A[i, k] * B[j, k]: B has no row along j to load as vectors."""
    a = te.placeholder((8, 32), name="A")
    b = te.placeholder((16, 32), name="B")
    k = te.reduce_axis((0, 32), name="k")
    c = te.compute((8, 16), lambda i, j: te.sum(a[i, k] * b[j, k], axis=k), name="matmul")
    assert MatmulEpilogue().apply(te.create_prim_func([a, b, c]), target, False) is None

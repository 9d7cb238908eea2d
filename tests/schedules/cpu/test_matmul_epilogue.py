"""MatmulEpilogue: register-tiled matmul with its epilogue fused per tile."""

import numpy as np
import pytest
import tvm
from conftest import TARGET
from loop_structure import loop_kinds, matmul_column_tile, matmul_row_tiles, matmul_tasks
from tvm import relax, te
from tvm.relax.op import add, divide, matmul, multiply, nn, permute_dims, sigmoid

from tvm_fusion.passes.pack_matmul_weights import PackMatmulWeights, pack_columns
from tvm_fusion.schedules.cpu import MatmulEpilogue
from tvm_fusion.schedules.cpu.matchers import matmul_tile_columns
from tvm_fusion.targets.target_info import num_cores, vector_lanes


def _bias_gelu(x, w, b):
    return nn.gelu(add(matmul(x, w), b))


def assert_register_tiled(funcs, lanes, batch, m, k, n):
    """One kernel; its (batch x column panel x row tile) loop runs over tiles of up to 8 rows
    (6 on AVX2; rows zero-padded where that fills the tiles better) x 2 vectors of columns
    (narrower power-of-two vectors, or a divisor of the extent, when whole ones do not fit),
    several column tiles a task where the rows are few, in parallel unless the matmul is
    small; the rows unrolled and the columns (update, init and epilogue store) vectorized, the
    update and init in register-wide pieces; padded rows of A are copied K-wide vectors."""
    (func,) = funcs.values()
    rows, row_tiles = matmul_row_tiles(m, lanes)
    cols, piece = matmul_column_tile(n, lanes)
    loops = loop_kinds(func)
    assert_tasks(loops, batch * m * k * n, batch * row_tiles, n // cols, rows, lanes)
    padded = rows * row_tiles > m
    assert loops.vectorized.count(piece) >= 2  # the update and its init
    stores = [cols] * loops.vectorized.count(cols) if piece != cols else []
    expected = [piece] * loops.vectorized.count(piece) + stores + ([k] if padded else [])
    assert sorted(loops.vectorized) == sorted(expected)
    assert rows in loops.unrolled
    if piece != cols:
        assert cols // piece in loops.unrolled


def assert_tasks(loops, work: int, row_tiles: int, column_tiles: int, rows: int, lanes: int) -> None:
    """The tile loop: parallel over the tasks (or serial, for a small matmul); a task's column
    tiles an unrolled loop."""
    tasks, group, parallel = matmul_tasks(work, row_tiles, column_tiles, rows, lanes, num_cores(TARGET))
    assert loops.parallel == ([tasks] if parallel else [])
    assert parallel or tasks == 1 or tasks in loops.serial
    assert group == 1 or group in loops.unrolled


@pytest.mark.parametrize(
    "m, k, n",
    [(128, 256, 64), (32, 24, 48), (7, 13, 4), (1, 64, 100), (33, 17, 48), (5, 8, 1),
     (40, 240, 120), (16, 32, 72), (24, 16, 36)],
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


def test_one_row_per_batch_item_tiles_the_batch_as_rows(assert_schedule_matches, lanes):
    """An RNN's outputs [steps, 1, K] times a shared weight: the steps are the rows of one GEMM
    (tiles of several steps, each weight panel read once per tile), not a matrix-vector product
    per step."""
    funcs = assert_schedule_matches(MatmulEpilogue(), matmul, rtol=1e-4, atol=1e-4, x=(30, 1, 16), w=(16, 32))
    assert_register_tiled(funcs, lanes, 1, 30, 16, 32)


def test_must_not_tile_the_batch_as_rows_when_the_weight_differs_per_item(assert_schedule_matches, lanes):
    funcs = assert_schedule_matches(MatmulEpilogue(), matmul, rtol=1e-4, atol=1e-4, x=(6, 1, 16), w=(6, 16, 32))
    assert_register_tiled(funcs, lanes, 6, 1, 16, 32)


def test_a_block_before_the_matmul_that_only_the_epilogue_reads_is_inlined(assert_schedule_matches, lanes):
    """An LSTM step: this step's slice of the input projection, squeezed, plus ``h @ R``. FuseOps
    puts the squeeze before the matmul; it feeds only the add, so the kernel is still a
    matmul with an epilogue."""
    from tvm.relax.op import squeeze

    def step(projected, h, r):
        return add(squeeze(projected, [0]), matmul(h, r))

    funcs = assert_schedule_matches(MatmulEpilogue(), step, rtol=1e-4, atol=1e-4,
                                    projected=(1, 2, 48), h=(2, 16), r=(16, 48))
    assert_register_tiled(funcs, lanes, 1, 2, 16, 48)


def test_declines_a_block_that_feeds_the_matmul(target):
    """``(2 * A) @ B`` computed in one kernel: a prologue, not this rule's shape."""
    a = te.placeholder((8, 32), name="A")
    b = te.placeholder((32, 16), name="B")
    doubled = te.compute((8, 32), lambda i, k: a[i, k] * 2.0, name="doubled")
    k = te.reduce_axis((0, 32), name="k")
    c = te.compute((8, 16), lambda i, j: te.sum(doubled[i, k] * b[k, j], axis=k), name="matmul")
    assert MatmulEpilogue().apply(te.create_prim_func([a, b, c]), target, False) is None


def test_declines_a_prologue_chain_before_inlining_any_of_it(target, monkeypatch):
    """``3 * (2 * A) @ B``: the second block feeds the matmul, so the first is not inlined only to
    decline after (a Winograd conv's input transform took 0.75 s to inline)."""
    from tvm import s_tir

    from tvm_fusion.kernels.matmul import matmul_kernel

    a = te.placeholder((8, 32), name="A")
    b = te.placeholder((32, 16), name="B")
    doubled = te.compute((8, 32), lambda i, k: a[i, k] * 2.0, name="doubled")
    tripled = te.compute((8, 32), lambda i, k: doubled[i, k] * 3.0, name="tripled")
    k = te.reduce_axis((0, 32), name="k")
    c = te.compute((8, 16), lambda i, j: te.sum(tripled[i, k] * b[k, j], axis=k), name="matmul")
    inlined = []
    original = s_tir.Schedule.compute_inline
    monkeypatch.setattr(s_tir.Schedule, "compute_inline",
                        lambda sch, block: inlined.append(block) or original(sch, block))
    assert matmul_kernel(te.create_prim_func([a, b, c]), target) is None
    assert inlined == []


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


@pytest.mark.parametrize("m, batch, n_panels, extra", [(13, 1, 8, 5), (1, 1, 4, 0), (7, 3, 2, 0)],
                         ids=["odd rows, padded last panel", "one row", "batched rows"])
def test_packed_weight_tiles_one_panel_per_column_tile(target, lanes, m, batch, n_panels, extra):
    """With the weight in column panels (passes/pack_matmul_weights.py), a column tile is one
    panel: the parallel loop runs row tiles x panels, the panel's columns are one vectorized
    loop, and only the real columns are stored."""
    panel = 2 * lanes
    k, n = 24, n_panels * panel + extra
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, m, k)).astype("float32")
    w = rng.standard_normal((k, n)).astype("float32")
    b = rng.standard_normal(n).astype("float32")
    params = [relax.Var("x", relax.TensorType((batch, m, k), "float32")), relax.Var("b", relax.TensorType((n,), "float32"))]
    builder = relax.BlockBuilder()
    with builder.function("main", params):
        with builder.dataflow():
            out = builder.emit_output(nn.relu(add(matmul(params[0], relax.const(w)), params[1])))
        builder.emit_func_output(out)
    mod = PackMatmulWeights(target)(relax.get_pipeline("zero")(builder.get()))
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert [int(d) for d in func.params[1].ty.shape] == [-(-n // panel), k, panel]
    sch = MatmulEpilogue().apply(func, target, False)
    assert sch is not None
    scheduled = sch.mod["main"]
    rows, row_tiles = matmul_row_tiles(m, lanes)
    loops = loop_kinds(scheduled)
    assert_tasks(loops, batch * m * k * -(-n // panel) * panel, batch * row_tiles, -(-n // panel), rows, lanes)
    assert loops.vectorized.count(panel) >= 2  # the update and the init
    assert rows in loops.unrolled
    result = tvm.runtime.tensor(np.zeros((batch, m, n), "float32"))
    kernel = tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target=target)
    kernel["main"](*[tvm.runtime.tensor(a) for a in (x, pack_columns(w, panel), b)], result)
    np.testing.assert_allclose(result.numpy(), np.maximum(x @ w + b, 0), rtol=1e-4, atol=1e-4)


# Machines by their vector features, not by CPU name (tests/machine.py): the rule is a pure
# function of the target, so both classes are checked on any host.
_AVX512 = ["+avx512f"]
_AVX2 = ["+avx2", "+fma"]


@pytest.mark.parametrize("features, n, columns", [
    (_AVX512, 120, 24),  # 3 x 8 lanes: PP-OCRv4-rec's 40 x 240 x 120, 138 -> 34 us
    (_AVX512, 72, 24),
    (_AVX512, 100, 4),   # 25 = 5 x 5: one 4-lane vector a row
    (_AVX512, 64, 32),   # whole vectors: unchanged
    (_AVX512, 25, 25),   # no 4-lane vector divides: one vector of the divisor
    (_AVX2, 36, 4),      # AVX2: 36 = 4 x 9, one 4-lane vector a row
    (_AVX2, 48, 16),
])
def test_odd_column_counts_take_narrower_power_of_two_vectors(features, n, columns):
    """Columns off the vector width: one vector of 24 or 30 lanes ran at a quarter of the speed
    of the same tile as unrolled 8-lane vectors (matchers.matmul_tile_columns)."""
    target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mattr": features})
    assert matmul_tile_columns(n, vector_lanes(target, "float32"), target) == columns

"""WarpSoftmax: softmax over the last axis (with its scale and mask) as one-pass warp reductions.

Structure only (no GPU here): rows over blockIdx.x x threadIdx.y, a warp a row, the logits read
from global memory by one block, each exponential computed once (kept in shared memory), max and
sum lowered to warp shuffles, ptxas without spills. Numbers: the GPU pack (docs/gpu-check.md).
"""

from __future__ import annotations

import pytest
from gpu_kernels import CUDA, REGISTER_BOUND, cuda_source, kernel, kernel_bodies, readers, thread_extents
from tvm.relax.op import add, divide, nn
from tvm.s_tir import dlight as dl

from tvm_fusion import targets
from tvm_fusion.schedules.gpu import WarpSoftmax
from tvm_fusion.targets.kernel_resources import kernel_resources


def scaled_masked(bb, x, scale, mask):
    return nn.softmax(add(divide(x, scale), mask))


SCALED = {"x": (2, 4, 128, 128), "scale": (), "mask": (2, 1, 1, 128)}


@pytest.mark.parametrize("rows, cols", [(8, 128), (1024, 128), (6, 50), (3, 1000)])
def test_rows_over_blocks_columns_over_a_warp(rows, cols):
    _, func = kernel(lambda bb, x: nn.softmax(x), {"x": (rows, cols)})
    sch = WarpSoftmax().apply(func, CUDA, False)
    assert sch is not None
    scheduled = sch.mod["main"]
    bound = thread_extents(scheduled)
    assert bound["threadIdx.x"] == {32}
    rows_per_block = max(bound.get("threadIdx.y", {1}))
    assert rows % rows_per_block == 0 and bound["blockIdx.x"] == {rows // rows_per_block}
    assert len(readers(scheduled)["x"]) == 1  # copied once; max and exp read the copy
    [body] = kernel_bodies(cuda_source(scheduled))
    assert "__shfl_down_sync" in body


def test_scale_and_mask_are_computed_once_per_element():
    _, func = kernel(scaled_masked, SCALED, ("softmax",))
    sch = WarpSoftmax().apply(func, CUDA, False)
    assert sch is not None
    scheduled = sch.mod["main"]
    reads = readers(scheduled)
    assert len(reads["x"]) == 1 and len(reads["mask"]) == 1  # the masked logits go to shared memory
    assert thread_extents(scheduled)["blockIdx.x"] == {2 * 4 * 128 // 4}
    # Each exponential computed once into shared memory, read by the sum and the normalization.
    assert sorted(reads["T_fast_exp_shared"]) == ["T_softmax_expsum", "T_softmax_norm"]
    assert "__shfl_down_sync" in kernel_bodies(cuda_source(scheduled))[0]


def test_dlight_reads_the_logits_three_times_and_computes_exp_twice():
    _, func = kernel(scaled_masked, SCALED, ("softmax",))
    reads = readers(dl.gpu.GeneralReduction().apply(func, CUDA, False).mod["main"])
    assert len(reads["x"]) == 3 and not any(name.startswith("T_fast_exp") for name in reads)  # inlined twice
    assert len(readers(WarpSoftmax().apply(func, CUDA, False).mod["main"])["x"]) == 1


def test_declines_a_norm_and_other_targets():
    import tvm

    _, norm = kernel(lambda bb, x, g, b: nn.layer_norm(x, g, b, axes=[-1]), {"x": (8, 64), "g": (64,), "b": (64,)})
    assert WarpSoftmax().apply(norm, CUDA, False) is None
    _, softmax = kernel(lambda bb, x: nn.softmax(x), {"x": (8, 128)})
    assert WarpSoftmax().apply(softmax, tvm.target.Target({"kind": "llvm"}), False) is None
    _, outer = kernel(lambda bb, x: nn.softmax(x, axis=1), {"x": (2, 16, 64)})
    assert WarpSoftmax().apply(outer, CUDA, False) is None  # not the last axis


def test_registers_stay_under_the_bound_without_spills():
    if targets.NVCC.path() is None:
        pytest.skip("nvcc is not installed")
    _, func = kernel(scaled_masked, SCALED, ("softmax",))
    source = cuda_source(WarpSoftmax().apply(func, CUDA, False).mod["main"])
    [(name, usage)] = kernel_resources(source, "sm_90").items()
    assert usage.registers <= REGISTER_BOUND and not usage.spills, (name, usage)
    # Four rows of float32: TVM stores each exponential over its (then dead) masked logit.
    assert usage.shared_bytes == 4 * 128 * 4

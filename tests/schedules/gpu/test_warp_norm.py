"""WarpNorm: LayerNorm / skip LayerNorm / RMSNorm kernels as one-pass warp reductions on CUDA.

Structure only (no GPU here): the rule takes the kernel; rows go to blockIdx.x (x threadIdx.y),
columns to a warp (threadIdx.x, a multiple of 32); every input row is read by one block (into
shared memory); the reductions lower to warp shuffles; ptxas keeps the kernel in registers
(no spills, no local memory). Numbers are checked on a GPU by the GPU pack (docs/gpu-check.md).
"""

from __future__ import annotations

import pytest
import tvm
from gpu_kernels import CUDA, REGISTER_BOUND, cuda_source, kernel, kernel_bodies, readers, thread_extents
from tvm import relax
from tvm.relax.op import add, nn
from tvm.s_tir import dlight as dl

from tvm_fusion import targets
from tvm_fusion.schedules.gpu import WarpNorm, WarpSoftmax
from tvm_fusion.targets.kernel_resources import kernel_resources

SKIP_NORMS = ("skip_layernorm", "skip_rms_norm")


def skip_norm(norm: str, sum_output: bool):
    """``norm(x + bias + skip)`` [and the sum], as the skip-norm patterns fuse it."""

    def build(bb, x, bias, skip, gamma, beta):
        summed = bb.emit(add(bb.emit(add(x, bias)), skip))
        normed = bb.emit(nn.layer_norm(summed, gamma, beta, axes=[-1]) if norm == "layer_norm"
                         else nn.rms_norm(summed, gamma, axes=[-1]))
        return relax.Tuple([normed, summed]) if sum_output else normed

    return build


def shapes(rows: int, cols: int) -> dict:
    return {"x": (rows, cols), "bias": (cols,), "skip": (rows, cols), "gamma": (cols,), "beta": (cols,)}


def plain_layer_norm(bb, x, gamma, beta):
    return nn.layer_norm(x, gamma, beta, axes=[-1])


@pytest.fixture(scope="module")
def nvcc():
    if targets.NVCC.path() is None:  # the image has it (/usr/local/bin/nvcc); ptxas comes with it
        pytest.skip("nvcc is not installed")


@pytest.mark.parametrize("sum_output", [False, True])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("rows, cols", [(128, 256), (7, 33), (1, 256)])
def test_rows_over_blocks_columns_over_a_warp(norm, sum_output, rows, cols):
    _, func = kernel(skip_norm(norm, sum_output), shapes(rows, cols), SKIP_NORMS)
    sch = WarpNorm().apply(func, CUDA, False)
    assert sch is not None
    scheduled = sch.mod["main"]
    bound = thread_extents(scheduled)
    assert bound["threadIdx.x"] == {32}  # a warp a row
    rows_per_block = max(bound.get("threadIdx.y", {1}))
    assert rows % rows_per_block == 0 and bound["blockIdx.x"] == {rows // rows_per_block}
    # x and skip are read once, by the block that writes their sum to shared memory.
    reads = readers(scheduled)
    assert len(reads["x"]) == 1 and len(reads["skip"]) == 1
    source = cuda_source(scheduled)
    [body] = kernel_bodies(source)  # one kernel
    assert "__shfl_down_sync" in body
    if cols == 256:  # unrolled: one load of x per column a thread takes, 256 / 32
        assert body.count("x_ptr[") == 8


def test_plain_layer_norm_copies_its_input_row_once():
    _, func = kernel(plain_layer_norm, {"x": (128, 256), "gamma": (256,), "beta": (256,)})
    sch = WarpNorm().apply(func, CUDA, False)
    assert sch is not None
    reads = readers(sch.mod["main"])
    assert len(reads["x"]) == 1  # the copy into shared memory; mean, variance and output read that
    assert any(name.endswith("_shared") for name in reads)


def test_dlight_reads_the_residual_three_times_where_warp_norm_reads_it_once():
    _, func = kernel(skip_norm("layer_norm", False), shapes(128, 256), SKIP_NORMS)
    default = dl.gpu.GeneralReduction().apply(func, CUDA, False)
    assert len(readers(default.mod["main"])["x"]) == 3  # sum, variance, output: each re-adds x + bias + skip
    assert len(readers(WarpNorm().apply(func, CUDA, False).mod["main"])["x"]) == 1


def test_wide_rows_take_a_block_of_warps():
    _, func = kernel(plain_layer_norm, {"x": (4, 4096), "gamma": (4096,), "beta": (4096,)})
    scheduled = WarpNorm().apply(func, CUDA, False).mod["main"]
    bound = thread_extents(scheduled)
    assert bound["threadIdx.x"] == {128} and bound["blockIdx.x"] == {4} and "threadIdx.y" not in bound
    assert "__shfl_down_sync" in cuda_source(scheduled)


def test_a_row_too_wide_for_shared_memory_is_left_to_dlight():
    _, func = kernel(plain_layer_norm, {"x": (2, 16384), "gamma": (16384,), "beta": (16384,)})
    assert WarpNorm().apply(func, CUDA, False) is None


def test_declines_what_is_not_a_norm():
    _, func = kernel(lambda bb, x: nn.softmax(x), {"x": (8, 128)})
    assert WarpNorm().apply(func, CUDA, False) is None
    _, norm = kernel(plain_layer_norm, {"x": (8, 128), "gamma": (128,), "beta": (128,)})
    assert WarpNorm().apply(norm, tvm.target.Target({"kind": "llvm"}), False) is None


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_registers_stay_under_the_bound_without_spills(nvcc, norm):
    _, func = kernel(skip_norm(norm, True), shapes(128, 256), SKIP_NORMS)
    source = cuda_source(WarpNorm().apply(func, CUDA, False).mod["main"])
    [(name, usage)] = kernel_resources(source, "sm_90").items()
    assert usage.registers <= REGISTER_BOUND and not usage.spills, (name, usage)
    assert usage.shared_bytes == 4 * 256 * 4  # four rows of the sum, in float32


def test_rules_are_registered_for_cuda_before_dlight():
    from tvm_fusion.schedules import schedule_rules

    names = [type(rule).__name__ for rule in schedule_rules(CUDA)]
    assert names.index("WarpNorm") < names.index("GeneralReduction")
    assert names.index("WarpSoftmax") < names.index("GeneralReduction")
    assert WarpSoftmax  # re-exported from schedules.gpu

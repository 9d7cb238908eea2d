"""profile --mine and ablate on small graphs whose answers are known (structure, never timings)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.profile import KernelCall, KernelProfile, build_profiled, kernel_graph, mine_chains

from helpers import mlp_model


def _kernel(name: str, kind: str, us: float) -> KernelProfile:
    return KernelProfile(name, "single op", "-", kind, 1, us, us, 0.0, 0, 0, 0.0, 0.0, 0.0, "memory", 0.0, [])


def test_mining_follows_single_consumer_edges_and_counts_the_saved_bytes():
    # conv -> injective -> reduction (a model output); the injective's output also feeds "other",
    # so only conv -> injective can keep its intermediate out of DRAM.
    calls = [KernelCall("conv", 1000, []), KernelCall("inj", 400, [0]), KernelCall("red", 8, [1], model_output=True),
             KernelCall("other", 8, [1], model_output=True)]
    kernels = {k.name: k for k in (_kernel("conv", "conv", 50.0), _kernel("inj", "injective", 10.0),
                                   _kernel("red", "reduction", 5.0), _kernel("other", "injective", 1.0))}
    chains = mine_chains(calls, kernels, gbytes_per_s=10.0, per_launch_us=2.0)
    (chain,) = chains
    assert chain.label == "conv -> injective"
    assert chain.saved_bytes == 2 * 1000
    assert chain.us == 60.0
    assert chain.gain_us == 2 * 1000 / 10e3 + 2.0  # bytes at 10 GB/s, plus one launch


def test_mining_ranks_by_gain_and_extends_to_three_kernels():
    calls = [KernelCall("a", 100, []), KernelCall("b", 10_000, [0]), KernelCall("c", 8, [1], model_output=True)]
    kernels = {n: _kernel(n, k, 100.0) for n, k in (("a", "matmul"), ("b", "injective"), ("c", "reduction"))}
    chains = mine_chains(calls, kernels, gbytes_per_s=1.0, per_launch_us=0.0)
    assert [c.label for c in chains] == ["matmul -> injective -> reduction", "injective -> reduction",
                                         "matmul -> injective"]
    assert [c.saved_bytes for c in chains] == [20_200, 20_000, 200]


def test_kernel_graph_of_an_unfused_matmul_then_reduction(tmp_path):
    """MatMul -> ReduceSum: no pattern takes it and TVM does not fuse a reduction after a
    matmul: one chain, the [4, 32] float32 product written and read back."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
         helper.make_node("ReduceSum", ["m", "axes"], ["y"], name="sum", keepdims=1)],
        "mm_sum", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 1])],
        [numpy_helper.from_array(np.ones((16, 32), np.float32), "w"),
         numpy_helper.from_array(np.array([-1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "mm_sum.onnx"
    onnx.save(model, path)
    profiled = build_profiled(api.prepare(path), tuning_log=False)
    calls = kernel_graph(profiled.lowered)
    assert [c.inputs for c in calls] == [[], [0]] and calls[1].model_output
    assert calls[0].output_bytes == 4 * 32 * 4
    assert profiled.covers[calls[0].kernel] == ["mm"] and profiled.covers[calls[1].kernel] == ["sum"]
    kernels = {c.kernel: _kernel(c.kernel, kind, 1.0) for c, kind in zip(calls, ("matmul", "reduction"))}
    (chain,) = mine_chains(calls, kernels, 10.0, 0.0)
    assert chain.saved_bytes == 2 * 4 * 32 * 4


def test_ablation_builds_each_fired_pattern_off_in_turn(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), path)
    config = dataclasses.replace(load_config(None), patterns=("gelu_erf", "silu", "gemm_epilogue"))
    result = api.ablate_model(path, config, ["x:4x16"], rounds=2, warmup=0)
    names = [v.name for v in result.variants]
    assert names == ["all patterns", "without gelu_erf", "without gemm_epilogue", "no patterns"]
    assert result.not_fired == ["silu"]
    kernels = {v.name: v.kernels for v in result.variants}
    # Two fused linears (the first with its GELU); without the GELU rewrite the decomposed GELU
    # stays outside; without gemm_epilogue, TVM's FuseOps groups matmul with its epilogue itself.
    assert kernels["all patterns"] == 2
    assert kernels["without gelu_erf"] > kernels["all patterns"]
    assert all(v.median_ms > 0 for v in result.variants)
    assert result.lines()[0].startswith("gelu_erf: ") and result.lines()[0].endswith("% of the latency on this model")
    assert set(result.to_json()) == {"model", "threads", "rounds", "not_fired", "variants", "summary"}

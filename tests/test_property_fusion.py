"""Property: on random chains of fusable ops, fused == unfused == ONNX Runtime, and the fusions
each chain was built for fired.

Each example is one ONNX graph holding several independent chains (so one compile checks
many cases): MatMul, optional bias, optional activation (as exporters write it, decomposed
GELUs included), optional residual add, optional normalization (LayerNormalization, the
opset-14 decomposed LayerNorm, or a decomposed RMSNorm) whose sum may also be an output,
with random small shapes and broadcasts. ``intended(spec)`` says which rewrites and fusions
(with their variants) a chain must trigger and how many kernels it becomes; the test checks
the PatternReport and the kernel count against the sum over the chains, so a fusion that
silently stops firing fails here even though the numbers still match.

The default run checks a few derandomized graphs (about a minute on 2 cores);
``pytest -m slow tests/test_property_fusion.py`` checks new random graphs of at least 2,000
chains in all (about half an hour), and ``TVM_FUSION_PROPERTY_EXAMPLES`` sets the number of
graphs of either run.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion import api
from tvm_fusion.config import load_config
from tvm_fusion.runtime import CompiledModel
from tvm_fusion.verify import reference_outputs

CHAINS_PER_GRAPH = 16
# Graphs per run: the default keeps the file near a minute on 2 cores; the slow run covers
# SLOW_CHAINS chains at least.
EXAMPLES = int(os.environ.get("TVM_FUSION_PROPERTY_EXAMPLES", "5"))
SLOW_CHAINS = 2000
SLOW_EXAMPLES = int(os.environ.get("TVM_FUSION_PROPERTY_EXAMPLES", str(-(-SLOW_CHAINS // CHAINS_PER_GRAPH))))
# float32 with reductions over <= 48 elements; LayerNorm divides by a std that can be small.
RTOL, ATOL = 1e-3, 2e-4

ACTIVATIONS = [None, "relu", "sigmoid", "silu", "gelu_erf", "gelu_tanh"]
NORMS = [None, "layer_norm", "layer_norm_decomposed", "rms_norm_decomposed"]

chain_strategy = st.fixed_dictionaries({
    "batch": st.sampled_from([(), (1,), (2,)]),
    "rows": st.integers(1, 6),
    "k": st.sampled_from([4, 8, 16, 24]),
    "n": st.sampled_from([8, 16, 32, 48]),
    "bias": st.sampled_from([None, "vector", "row"]),  # [N] or [1, N]
    "activation": st.sampled_from(ACTIVATIONS),
    "residual": st.sampled_from([None, "full", "broadcast"]),  # [.., rows, N] or [rows, N]
    "norm": st.sampled_from(NORMS),
    "sum_output": st.booleans(),
})

# The rewrite rule that turns each exporter spelling into one Relax op.
ACTIVATION_REWRITES = {"silu": "silu", "gelu_erf": "gelu_erf", "gelu_tanh": "gelu_tanh"}
NORM_REWRITES = {"layer_norm_decomposed": "layernorm_decomposed", "rms_norm_decomposed": "rmsnorm_decomposed"}
# gemm_epilogue's name for each activation (once rewritten) in its variant names.
GEMM_ACTIVATIONS = {"relu": "relu", "sigmoid": "sigmoid", "silu": "silu", "gelu_erf": "gelu",
                    "gelu_tanh": "gelu_tanh"}


@dataclasses.dataclass
class Intent:
    """What the default pipeline must make of some chains."""

    rewrites: collections.Counter  # rewrite rule -> times fired
    fusions: collections.Counter   # "pattern.variant" -> times fired
    kernels: int                   # kernel launches of main

    def __add__(self, other: Intent) -> Intent:
        return Intent(self.rewrites + other.rewrites, self.fusions + other.fusions, self.kernels + other.kernels)


def gemm_variant(bias: bool, activation: str | None, residual: bool) -> str:
    return "gemm_epilogue." + "_".join(["matmul"] + (["bias"] if bias else [])
                                       + ([GEMM_ACTIVATIONS[activation]] if activation else [])
                                       + (["residual"] if residual else []))


def intended(spec: dict) -> Intent:
    """The rewrites, fusions (with variants) and kernels one chain must give.

    * Each exporter-decomposed activation or norm is first rewritten to its op.
    * A norm takes the adds right before it (skip_layernorm / skip_rms_norm run before
      gemm_epilogue): the residual add, and the bias add too when no activation sits between
      ("bias_skip"); without a residual, a bias add right before the norm is its skip.
      gemm_epilogue fuses the matmul with the activation (and its bias) if there is one.
      Two kernels: the matmul's and the norm's.
    * Without a norm, gemm_epilogue takes bias, activation and residual add: one kernel. It
      declines a residual of another shape than its output (broadcast over a batch), which
      then is a kernel of its own after a fused epilogue, is fused with a bare matmul by
      FuseOps, or (a [1, N] residual on a bare matmul) is taken as the bias.
    """
    bias, activation, residual, norm = (spec[key] for key in ("bias", "activation", "residual", "norm"))
    rewrites = collections.Counter(r for r in (ACTIVATION_REWRITES.get(activation), NORM_REWRITES.get(norm)) if r)
    fusions: collections.Counter = collections.Counter()
    if norm:
        skip_norm = "skip_rms_norm" if norm == "rms_norm_decomposed" else "skip_layernorm"
        bias_with_norm = bool(bias) and not activation
        if residual or bias_with_norm:
            fusions[f"{skip_norm}.{'bias_skip' if residual and bias_with_norm else 'skip'}"] += 1
        if activation:
            fusions[gemm_variant(bool(bias), activation, residual=False)] += 1
        return Intent(rewrites, fusions, kernels=2)
    exact_residual = residual == "full" or (residual == "broadcast" and not spec["batch"])
    if residual and not exact_residual:
        if bias or activation:
            fusions[gemm_variant(bool(bias), activation, residual=False)] += 1
            return Intent(rewrites, fusions, kernels=2)
        if spec["rows"] == 1:
            fusions[gemm_variant(True, None, residual=False)] += 1
        return Intent(rewrites, fusions, kernels=1)
    if bias or activation or residual:
        fusions[gemm_variant(bool(bias), activation, bool(residual))] += 1
    return Intent(rewrites, fusions, kernels=1)


class GraphBuilder:
    def __init__(self, rng: np.random.Generator):
        self.rng, self.nodes, self.inits, self.inputs, self.outputs = rng, [], [], [], []

    def const(self, name: str, value) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def weight(self, name: str, shape) -> str:
        return self.const(name, self.rng.standard_normal(shape) / math.sqrt(shape[0] if shape else 1))

    def op(self, op_type: str, inputs: list[str], out: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def chain(self, c: str, spec: dict) -> None:
        shape = [*spec["batch"], spec["rows"], spec["k"]]
        self.inputs.append(helper.make_tensor_value_info(f"{c}_x", TensorProto.FLOAT, shape))
        y = self.op("MatMul", [f"{c}_x", self.weight(f"{c}_w", (spec["k"], spec["n"]))], f"{c}_mm")
        if spec["bias"]:
            bias_shape = (spec["n"],) if spec["bias"] == "vector" else (1, spec["n"])
            y = self.op("Add", [self.const(f"{c}_b", self.rng.standard_normal(bias_shape) * 0.1), y], f"{c}_bias")
        y = self.activation(c, spec["activation"], y)
        if spec["residual"]:
            rows = [*spec["batch"], spec["rows"]] if spec["residual"] == "full" else [spec["rows"]]
            self.inputs.append(helper.make_tensor_value_info(f"{c}_r", TensorProto.FLOAT, [*rows, spec["n"]]))
            y = self.op("Add", [y, f"{c}_r"], f"{c}_sum")
        out_shape = [*spec["batch"], spec["rows"], spec["n"]]
        if spec["norm"]:
            if spec["sum_output"]:
                self.outputs.append((y, out_shape))
            y = self.norm(c, spec["norm"], y, spec["n"])
        self.outputs.append((y, out_shape))

    def activation(self, c: str, kind: str | None, x: str) -> str:
        if kind in ("relu", "sigmoid"):
            return self.op(kind.capitalize(), [x], f"{c}_act")
        if kind == "silu":
            return self.op("Mul", [x, self.op("Sigmoid", [x], f"{c}_sig")], f"{c}_act")
        if kind == "gelu_erf":  # as torch exports F.gelu
            erf = self.op("Erf", [self.op("Div", [x, self.const(f"{c}_s2", math.sqrt(2))], f"{c}_div")], f"{c}_erf")
            one = self.op("Add", [erf, self.const(f"{c}_one", 1.0)], f"{c}_erf1")
            return self.op("Mul", [self.op("Mul", [x, one], f"{c}_xm"), self.const(f"{c}_half", 0.5)], f"{c}_act")
        if kind == "gelu_tanh":  # as torch exports gelu_new
            cube = self.op("Pow", [x, self.const(f"{c}_three", 3.0)], f"{c}_cube")
            inner = self.op("Add", [x, self.op("Mul", [cube, self.const(f"{c}_coef", 0.044715)], f"{c}_cc")], f"{c}_in")
            tanh = self.op("Tanh", [self.op("Mul", [inner, self.const(f"{c}_k", math.sqrt(2 / math.pi))], f"{c}_sc")],
                           f"{c}_tanh")
            half_x = self.op("Mul", [x, self.const(f"{c}_half", 0.5)], f"{c}_hx")
            return self.op("Mul", [half_x, self.op("Add", [tanh, self.const(f"{c}_one", 1.0)], f"{c}_t1")], f"{c}_act")
        return x

    def norm(self, c: str, kind: str, x: str, n: int) -> str:
        gamma = self.const(f"{c}_g", 1 + 0.1 * self.rng.standard_normal(n))
        if kind == "layer_norm":
            beta = self.const(f"{c}_beta", 0.1 * self.rng.standard_normal(n))
            return self.op("LayerNormalization", [x, gamma, beta], f"{c}_ln", axis=-1, epsilon=1e-5)
        eps = self.const(f"{c}_eps", 1e-5)
        two = self.const(f"{c}_two", 2.0)
        if kind == "layer_norm_decomposed":
            centered = self.op("Sub", [x, self.op("ReduceMean", [x], f"{c}_mean", axes=[-1])], f"{c}_cen")
            var = self.op("ReduceMean", [self.op("Pow", [centered, two], f"{c}_sq")], f"{c}_var", axes=[-1])
            std = self.op("Sqrt", [self.op("Add", [var, eps], f"{c}_ve")], f"{c}_std")
            scaled = self.op("Mul", [self.op("Div", [centered, std], f"{c}_nrm"), gamma], f"{c}_scl")
            return self.op("Add", [scaled, self.const(f"{c}_beta", 0.1 * self.rng.standard_normal(n))], f"{c}_ln")
        ms = self.op("ReduceMean", [self.op("Pow", [x, two], f"{c}_sq")], f"{c}_ms", axes=[-1])
        inv = self.op("Div", [self.const(f"{c}_one_n", 1.0),
                              self.op("Sqrt", [self.op("Add", [ms, eps], f"{c}_mse")], f"{c}_rt")], f"{c}_inv")
        return self.op("Mul", [gamma, self.op("Mul", [x, inv], f"{c}_nrm")], f"{c}_rms")

    def model(self) -> onnx.ModelProto:
        outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in self.outputs]
        graph = helper.make_graph(self.nodes, "chains", self.inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model


def run_tvm(executable, prepared, inputs) -> dict[str, np.ndarray]:
    metadata = {"inputs": [s.to_json() for s in prepared.inputs],
                "outputs": [{"name": n} for n in prepared.output_names], "threads": prepared.config.threads}
    return CompiledModel(executable, metadata).run(inputs)


def check_chains(tmp_path_factory, chains: list[dict], seed: int) -> None:
    """Build one graph of ``chains``; the intended fusions fired, and fused == unfused == ORT."""
    import tvm
    from tvm import relax

    builder = GraphBuilder(np.random.default_rng(seed))
    for index, spec in enumerate(chains):
        builder.chain(f"c{index}", spec)
    path = tmp_path_factory.mktemp("chains") / "chains.onnx"
    onnx.save(builder.model(), str(path))
    prepared = api.prepare(path, load_config())
    optimized = api.optimize(prepared)
    want = sum((intended(spec) for spec in chains), Intent(collections.Counter(), collections.Counter(), 0))
    instances = optimized.report.instances
    assert collections.Counter(i.pattern for i in instances if i.variant == i.pattern) == want.rewrites, chains
    assert collections.Counter(i.variant for i in instances if i.variant != i.pattern) == want.fusions, chains
    assert api.kernel_calls(optimized.module) == want.kernels, chains

    rng = np.random.default_rng(seed)
    inputs = {s.name: rng.standard_normal(s.shape).astype("float32") for s in prepared.inputs}
    fused = run_tvm(api.build(optimized.module, prepared.config), prepared, inputs)
    unfused = run_tvm(tvm.compile(relax.get_pipeline("zero")(prepared.relax_module),
                                  target=prepared.config.tvm_target()), prepared, inputs)
    expected = reference_outputs(prepared.onnx_model, inputs)
    for name, value in expected.items():
        np.testing.assert_allclose(fused[name], value, rtol=RTOL, atol=ATOL, err_msg=f"{name} vs ORT")
        np.testing.assert_allclose(fused[name], unfused[name], rtol=RTOL, atol=ATOL, err_msg=f"{name} vs unfused")


graphs = st.lists(chain_strategy, min_size=CHAINS_PER_GRAPH, max_size=CHAINS_PER_GRAPH)
HYPOTHESIS_SETTINGS = {"deadline": None, "database": None,
                       "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]}


@settings(max_examples=EXAMPLES, derandomize=True, **HYPOTHESIS_SETTINGS)
@given(chains=graphs, seed=st.integers(0, 2**16))
def test_fused_equals_unfused_equals_onnxruntime(tmp_path_factory, chains, seed):
    check_chains(tmp_path_factory, chains, seed)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, **HYPOTHESIS_SETTINGS)
@given(chains=graphs, seed=st.integers(0, 2**16))
def test_many_random_chains(tmp_path_factory, chains, seed):
    """The long run: new random graphs each time (not derandomized), SLOW_CHAINS chains at least."""
    check_chains(tmp_path_factory, chains, seed)

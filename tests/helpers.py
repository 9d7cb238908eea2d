"""Builders for tiny ONNX models (seeded weights) shared by the tests.

Each builder returns an ``onnx.ModelProto`` that passes ``onnx.checker``; ``save`` writes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IN_FEATURES = 16
HIDDEN = 32
OUT_FEATURES = 8
REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = REPO_ROOT / "examples" / "models"


def _model(graph: onnx.GraphProto, opsets=None) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=opsets or [helper.make_opsetid("", OPSET)],
                              producer_name="tvm_fusion-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _const(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(value, name)


def mlp_model(seed: int = 0, in_features: int = IN_FEATURES, hidden: int = HIDDEN,
              out_features: int = OUT_FEATURES) -> onnx.ModelProto:
    """x[batch, in] -> MatMul -> Add(bias) -> erf GELU as exported (Div, Erf, Add, Mul, Mul) -> MatMul -> Add."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((in_features, hidden)) / np.sqrt(in_features)).astype(np.float32)
    b1 = rng.standard_normal(hidden).astype(np.float32) * 0.1
    w2 = (rng.standard_normal((hidden, out_features)) / np.sqrt(hidden)).astype(np.float32)
    b2 = rng.standard_normal(out_features).astype(np.float32) * 0.1
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["mm1"], name="fc1_matmul"),
        helper.make_node("Add", ["mm1", "b1"], ["h"], name="fc1_bias"),
        helper.make_node("Div", ["h", "sqrt2"], ["h_div"], name="gelu_div"),
        helper.make_node("Erf", ["h_div"], ["h_erf"], name="gelu_erf"),
        helper.make_node("Add", ["h_erf", "one"], ["h_erf1"], name="gelu_add"),
        helper.make_node("Mul", ["h", "h_erf1"], ["h_mul"], name="gelu_mul"),
        helper.make_node("Mul", ["h_mul", "half"], ["g"], name="gelu_half"),
        helper.make_node("MatMul", ["g", "w2"], ["mm2"], name="fc2_matmul"),
        helper.make_node("Add", ["mm2", "b2"], ["y"], name="fc2_bias"),
    ]
    initializers = [
        _const("w1", w1), _const("b1", b1), _const("w2", w2), _const("b2", b2),
        _const("sqrt2", np.array(1.4142135381698608, np.float32)),
        _const("one", np.array(1.0, np.float32)),
        _const("half", np.array(0.5, np.float32)),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", in_features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", out_features])],
        initializers)
    return _model(graph)


def unsupported_op_model() -> onnx.ModelProto:
    """Two Celu nodes (no converter in TVM 0.27) and two ops from a custom domain, around a supported Relu."""
    nodes = [
        helper.make_node("Celu", ["x"], ["c1"], name="celu_first", alpha=1.0),
        helper.make_node("Relu", ["c1"], ["r"], name="relu_ok"),
        helper.make_node("Celu", ["r"], ["c2"], name="celu_second", alpha=0.5),
        helper.make_node("FancyOp", ["c2"], ["c3"], name="fancy_node", domain="com.example"),
        # Same op_type as a supported op, but from a custom domain: TVM must not treat it as Relu.
        helper.make_node("Relu", ["c3"], ["y"], name="custom_relu", domain="com.example"),
    ]
    graph = helper.make_graph(
        nodes, "unsupported",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    return _model(graph, [helper.make_opsetid("", OPSET), helper.make_opsetid("com.example", 1)])


def shape_subgraph_model(seed: int = 0, features: int = 4, groups: int = 2) -> onnx.ModelProto:
    """x[batch, groups*features] -> [batch, groups, features], times a per-group scale, MatMul + Add.

    Both shape targets are computed from x's dynamic batch dim the way PyTorch's exporter
    writes them: ``Shape -> Gather -> Unsqueeze -> Concat -> Reshape`` for ``x.view(b, g, f)``
    and, for ``scale.expand(b, -1, -1)``, ``Concat -> Equal(-1) -> Where -> Expand``. TVM's
    importer cannot compare a shape with -1 (the Equal), so stock ``from_onnx`` fails even
    with a static ``shape_dict``; once the batch dim is bound, onnxslim folds it all.
    """
    rng = np.random.default_rng(seed)
    scale = rng.standard_normal((1, groups, features)).astype(np.float32)
    w = rng.standard_normal((features, features)).astype(np.float32)
    b = rng.standard_normal(features).astype(np.float32)
    nodes = [
        helper.make_node("Shape", ["x"], ["x_shape"], name="shape"),
        helper.make_node("Gather", ["x_shape", "zero"], ["batch_dim"], name="gather_batch", axis=0),
        helper.make_node("Unsqueeze", ["batch_dim", "axes0"], ["batch_1d"], name="unsqueeze_batch"),
        helper.make_node("Concat", ["batch_1d", "tail"], ["view_shape"], name="concat_view", axis=0),
        helper.make_node("Reshape", ["x", "view_shape"], ["x3"], name="reshape"),
        helper.make_node("Concat", ["batch_1d", "minus_ones"], ["expand_req"], name="concat_expand", axis=0),
        helper.make_node("Equal", ["expand_req", "minus_one"], ["is_keep"], name="equal_minus_one"),
        helper.make_node("Where", ["is_keep", "ones3", "expand_req"], ["expand_shape"], name="where_keep"),
        helper.make_node("Expand", ["scale", "expand_shape"], ["scale_b"], name="expand_scale"),
        helper.make_node("Mul", ["x3", "scale_b"], ["scaled"], name="mul_scale"),
        helper.make_node("MatMul", ["scaled", "w"], ["mm"], name="matmul"),
        helper.make_node("Add", ["mm", "b"], ["y"], name="bias"),
    ]
    initializers = [
        _const("zero", np.array(0, np.int64)),
        _const("axes0", np.array([0], np.int64)),
        _const("tail", np.array([groups, features], np.int64)),
        _const("minus_ones", np.array([-1, -1], np.int64)),
        _const("minus_one", np.array([-1], np.int64)),
        _const("ones3", np.array([1, 1, 1], np.int64)),
        _const("scale", scale), _const("w", w), _const("b", b),
    ]
    graph = helper.make_graph(
        nodes, "shape_subgraph",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features * groups])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", groups, features])],
        initializers)
    return _model(graph)


def embedding_model(vocab: int = 10, dim: int = 4, seed: int = 0) -> onnx.ModelProto:
    """ids[batch, seq] int64 -> Gather(table[vocab, dim]); plus a 'flags' int64 input not used as an index."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((vocab, dim)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed", axis=0),
        helper.make_node("Cast", ["flags"], ["flags_f"], name="cast", to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes, "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("flags", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["batch", "seq", dim]),
         helper.make_tensor_value_info("flags_f", TensorProto.FLOAT, ["batch", "seq"])],
        [_const("table", table)])
    return _model(graph)


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


DEFAULT_DIMS = {"batch": 1, "sequence": 16}


def write_config(path: Path, schedule: str = "none", patterns: list[str] | None = None,
                 dims: dict[str, int] | None = None, extra: str = "") -> Path:
    """A host config like configs/x86_64-host.toml with the given schedule mode, patterns
    (None = all registered) and [inputs] dim defaults (None = DEFAULT_DIMS, {} = none)."""
    dims = DEFAULT_DIMS if dims is None else dims
    lines = ['[target]', 'kind = "llvm"', 'mcpu = "host"', 'num-cores = "host"', '',
             '[pipeline]', f'schedule = "{schedule}"']
    if patterns is not None:
        lines.append("patterns = [" + ", ".join(f'"{p}"' for p in patterns) + "]")
    lines += ['', '[verify]', 'rtol = 1e-3', 'atol = 1e-4', 'seed = 0', '', '[inputs]']
    lines += [f"{name} = {size}" for name, size in dims.items()]
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def run_imported(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model as imported (no fusion, TVM's zero pipeline) run on ``inputs``: converters' numerics."""
    import tvm
    from tvm import relax

    from tvm_fusion.frontend import onnx as onnx_frontend

    specs = [onnx_frontend.TensorSpec(name, value.shape, str(value.dtype)) for name, value in inputs.items()]
    module = onnx_frontend.import_model(model, specs)
    vm = relax.VirtualMachine(tvm.compile(relax.get_pipeline("zero")(module), target="llvm"), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(v) for v in inputs.values()])
    return [got.numpy()] if isinstance(got, tvm.runtime.Tensor) else [g.numpy() for g in got]


def run_lowered(mod, *args: np.ndarray) -> np.ndarray:
    """A Relax module after our lowering (LegalizeOps with our legalizations, FuseOps, FuseTIR),
    compiled for llvm and run on ``args``: for passes compared before and after on numbers."""
    import tvm
    from tvm import relax

    from tvm_fusion.passes.pipeline import lowering_passes

    lowered = tvm.transform.Sequential(lowering_passes())(mod)
    vm = relax.VirtualMachine(tvm.compile(lowered, target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def ort_outputs(model_path: Path | str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs)))


def run_python(code: str, *args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (same venv); returns the completed process."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def read_metadata(artifact: Path) -> dict:
    return json.loads((Path(artifact) / "metadata.json").read_text())


def assert_fused_matches_references(model: onnx.ModelProto, prepared, optimized, inputs: dict[str, np.ndarray],
                                    rtol: float, atol: float) -> list[np.ndarray]:
    """Run the fused module (``api.optimize``'s) and the unfused one (TVM's zero pipeline) on
    ``inputs``; the fused outputs must match ONNX Runtime and the unfused ones. Returns them."""
    import tvm
    from tvm import relax

    from tvm_fusion.verify import reference_outputs

    arrays = [tvm.runtime.tensor(inputs[spec.name]) for spec in prepared.inputs]
    outputs = {}
    for label, module in (("fused", optimized.module), ("unfused", relax.get_pipeline("zero")(prepared.relax_module))):
        vm = relax.VirtualMachine(tvm.compile(module, target=prepared.config.tvm_target()), tvm.cpu())
        result = vm["main"](*arrays)
        outputs[label] = [result.numpy()] if hasattr(result, "numpy") else [r.numpy() for r in result]
    expected = list(reference_outputs(model, inputs).values())
    for fused, unfused, reference in zip(outputs["fused"], outputs["unfused"], expected, strict=True):
        np.testing.assert_allclose(fused, reference, rtol=rtol, atol=atol)
        np.testing.assert_allclose(fused, unfused, rtol=rtol, atol=atol)
    return outputs["fused"]


def blocked_weight(weight: np.ndarray, block: int = 16) -> np.ndarray:
    """An OIHW conv weight as OIHW{block}i{block}o, as the blocked layout stores it."""
    o, i, kh, kw = weight.shape
    return np.ascontiguousarray(weight.reshape(o // block, block, i // block, block, kh, kw).transpose(0, 2, 4, 5, 3, 1))

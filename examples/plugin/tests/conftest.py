"""Small ONNX models with Mish in the spellings exporters write."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper


def mish_model(spelling: str, shape=(1, 8, 16, 16), opset: int = 18) -> onnx.ModelProto:
    """``spelling``: "op" (ONNX Mish, opset 18), "softplus" (Softplus -> Tanh -> Mul, older
    exporters), or "shared" (as "softplus", but the softplus is also a graph output)."""
    nodes, outputs = [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)]
    if spelling == "op":
        nodes.append(helper.make_node("Mish", ["x"], ["y"]))
    else:
        nodes += [helper.make_node("Softplus", ["x"], ["sp"]), helper.make_node("Tanh", ["sp"], ["t"]),
                  helper.make_node("Mul", ["x", "t"], ["y"])]
        if spelling == "shared":
            outputs.append(helper.make_tensor_value_info("sp", TensorProto.FLOAT, shape))
    graph = helper.make_graph(nodes, "mish", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.fixture
def save(tmp_path):
    def write(model: onnx.ModelProto) -> str:
        path = tmp_path / "model.onnx"
        onnx.save(model, path)
        return str(path)
    return write


@pytest.fixture
def wide_input():
    # Both tails: softplus(x) ~ x for large x (exp overflows in the plain spelling) and ~ 0 below.
    return np.linspace(-30.0, 30.0, 8 * 16 * 16, dtype=np.float32).reshape(1, 8, 16, 16)


def run_optimized(path: str, x: np.ndarray) -> tuple[np.ndarray, dict]:
    """Compile ``path`` with the default config and run it on ``x``: (output, kernel -> rule)."""
    import tvm
    from tvm import relax

    from tvm_fusion import api

    prepared = api.prepare(path)
    optimized = api.optimize(prepared, tuning_log=False)
    vm = relax.VirtualMachine(api.build(optimized.module, prepared.config), tvm.cpu())
    result = vm["main"](tvm.runtime.tensor(x))
    first = result[0] if isinstance(result, tvm.ir.Array) or hasattr(result, "__getitem__") and not hasattr(result, "numpy") else result
    return first.numpy(), optimized.schedule_rules

"""LSTM and GRU converters (frontend/recurrent.py) against ONNX Runtime, and the nodes they refuse."""

from __future__ import annotations

import platform

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax, te

from helpers import run_imported
from test_quantized import lstm_model, quantized, random_feeds
from tvm_fusion.errors import ModelError
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.frontend.ort_arithmetic import fence
from tvm_fusion.verify import reference_outputs

SEQ, BATCH, INPUT, HIDDEN = 5, 3, 4, 6
GATES = {"LSTM": 4, "GRU": 3}


def recurrent_model(kind: str, direction: str = "forward", layout: int = 0, bias: bool = True,
                    initial: bool = False, peepholes: bool = False, seed: int = 0,
                    sequence_lens: np.ndarray | None = None, outputs: tuple[str, ...] | None = None,
                    seq: int = SEQ, **attrs) -> onnx.ModelProto:
    """One LSTM/GRU node with random weights as initializers; x (and states) as graph inputs."""
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    gates = GATES[kind]
    x_shape = [BATCH, seq, INPUT] if layout else [seq, BATCH, INPUT]
    state_shape = [BATCH, dirs, HIDDEN] if layout else [dirs, BATCH, HIDDEN]
    y_shape = [BATCH, seq, dirs, HIDDEN] if layout else [seq, dirs, BATCH, HIDDEN]
    inits = [numpy_helper.from_array(rng.uniform(-0.6, 0.6, (dirs, gates * HIDDEN, INPUT)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.uniform(-0.6, 0.6, (dirs, gates * HIDDEN, HIDDEN)).astype(np.float32), "R")]
    names = ["x", "W", "R", "", "", "", "", ""]
    if bias:
        inits.append(numpy_helper.from_array(rng.uniform(-0.5, 0.5, (dirs, 2 * gates * HIDDEN)).astype(np.float32), "B"))
        names[3] = "B"
    if sequence_lens is not None:
        inits.append(numpy_helper.from_array(sequence_lens.astype(np.int32), "lens"))
        names[4] = "lens"
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)]
    if initial:
        names[5] = "h0"
        graph_inputs.append(helper.make_tensor_value_info("h0", TensorProto.FLOAT, state_shape))
        if kind == "LSTM":
            names[6] = "c0"
            graph_inputs.append(helper.make_tensor_value_info("c0", TensorProto.FLOAT, state_shape))
    if peepholes:
        inits.append(numpy_helper.from_array(rng.uniform(-0.5, 0.5, (dirs, 3 * HIDDEN)).astype(np.float32), "P"))
        names[7] = "P"
    names = names[:8 if kind == "LSTM" else 6]
    while names[-1] == "":
        names.pop()
    outputs = outputs or (("Y", "Y_h", "Y_c") if kind == "LSTM" else ("Y", "Y_h"))
    node = helper.make_node(kind, names, list(outputs), name=f"{kind.lower()}_node", hidden_size=HIDDEN,
                            direction=direction, **({"layout": layout} if layout else {}), **attrs)
    graph = helper.make_graph([node], kind.lower(), graph_inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, y_shape if o == "Y" else state_shape)
                               for o in outputs if o],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {value.name: rng.standard_normal([d.dim_value for d in value.type.tensor_type.shape.dim]).astype(np.float32)
            for value in model.graph.input}


def assert_matches_onnxruntime(model: onnx.ModelProto) -> None:
    inputs = feeds(model)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)
    got = run_imported(model, inputs)
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected):
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_directions_match_onnxruntime(kind, direction):
    assert_matches_onnxruntime(recurrent_model(kind, direction))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("bias, initial", [(False, False), (True, True), (False, True)])
def test_with_and_without_biases_and_initial_states(kind, bias, initial):
    assert_matches_onnxruntime(recurrent_model(kind, "bidirectional", bias=bias, initial=initial))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_batch_major_layout(kind):
    """ONNX Runtime refuses layout 1, so the reference is the same weights in layout 0 on
    transposed inputs, with the outputs transposed back."""
    batch_major = recurrent_model(kind, "bidirectional", layout=1, initial=True)
    time_major = recurrent_model(kind, "bidirectional", layout=0, initial=True)
    inputs = feeds(batch_major)
    to_time_major = {name: value.transpose(1, 0, 2) for name, value in inputs.items()}
    expected = ort.InferenceSession(time_major.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, to_time_major)
    got = run_imported(batch_major, inputs)
    np.testing.assert_allclose(got[0], expected[0].transpose(2, 0, 1, 3), rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(got[1:], expected[1:]):
        np.testing.assert_allclose(ours, theirs.transpose(1, 0, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_one_step_matches_onnxruntime(kind):
    """A streaming model's frame (silero VAD): the step's input projection is computed on the
    squeezed frame, with no per-step slice."""
    assert_matches_onnxruntime(recurrent_model(kind, "bidirectional", initial=True, seq=1))


def test_lstm_peepholes_and_clip():
    assert_matches_onnxruntime(recurrent_model("LSTM", "bidirectional", peepholes=True, clip=0.4))


@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_gru_linear_before_reset(linear_before_reset):
    assert_matches_onnxruntime(recurrent_model("GRU", "reverse", linear_before_reset=linear_before_reset))


def test_custom_activations():
    assert_matches_onnxruntime(recurrent_model("GRU", "forward", activations=["HardSigmoid", "Relu"],
                                               activation_alpha=[0.25], activation_beta=[0.4]))


def run_on_host(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model as imported, compiled for this CPU (with its fma, as ONNX Runtime's MLAS uses it)."""
    specs = [onnx_frontend.TensorSpec(name, value.shape, str(value.dtype)) for name, value in inputs.items()]
    module = relax.get_pipeline("zero")(onnx_frontend.import_model(model, specs))
    host = tvm.target.Target({"kind": "llvm", "mcpu": str(tvm.target.Target.from_device(tvm.cpu()).attrs["mcpu"])})
    vm = relax.VirtualMachine(tvm.compile(module, target=host), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(v) for v in inputs.values()])
    return [got.numpy()] if isinstance(got, tvm.runtime.Tensor) else [g.numpy() for g in got]


def assert_equals_onnxruntime(model: onnx.ModelProto, inputs: dict, expected: list[np.ndarray]) -> None:
    got = run_on_host(model, inputs)
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected):
        different = int(np.count_nonzero(ours != theirs))
        assert different == 0, f"{different} of {ours.size} differ, by up to {np.abs(ours - theirs).max():.3g}"


# The old order, ``(X·Wᵀ + Wb + Rb) + H·Rᵀ`` with TVM's sigmoid/tanh and fma-contracted sums,
# differed from ONNX Runtime in 68-86 % of the elements of each case here, by up to 1.5e-7.
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="MLAS's x86 kernels are the reference")
@pytest.mark.parametrize("kind, attrs", [
    ("LSTM", {"direction": "bidirectional", "initial": True}),
    ("LSTM", {"peepholes": True, "clip": 0.9, "seed": 3}),
    ("GRU", {"direction": "bidirectional", "initial": True}),
    ("GRU", {"linear_before_reset": 1}),
    ("GRU", {"activations": ["HardSigmoid", "Relu"], "activation_alpha": [0.25], "activation_beta": [0.4]})])
def test_equals_onnxruntime_bit_for_bit(kind, attrs):
    """Gate sums in ONNX Runtime's order, its sigmoid and tanh, its roundings: no ulp apart."""
    model = recurrent_model(kind, **attrs)
    inputs = feeds(model)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)
    assert_equals_onnxruntime(model, inputs, expected)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="MLAS's x86 kernels are the reference")
@pytest.mark.parametrize("direction, initial, per_channel", [("bidirectional", False, False), ("forward", True, True)])
def test_dynamic_quantize_lstm_equals_onnxruntime_bit_for_bit(direction, initial, per_channel, tmp_path):
    """DynamicQuantizeLSTM (quantize_dynamic's LSTM): a step's hidden state is quantized, so a
    last-bit difference would move whole quantization steps in the next one."""
    model = quantized(lstm_model(direction, initial), tmp_path, per_channel=per_channel)
    inputs = random_feeds(model)
    assert_equals_onnxruntime(model, inputs, list(reference_outputs(model, inputs).values()))


def test_the_rounding_fence_is_dropped_for_gpu_code_generators():
    """CUDA's code generator knows no LLVM intrinsic; LLVM targets keep the fence."""
    x = te.placeholder((4,), "float32", name="x")
    func = te.create_prim_func([x, fence(x)])
    lowered = {kind: str(tvm.tirx.transform.LowerIntrin()(
        tvm.IRModule({"main": func.with_attr("target", tvm.target.Target(target))})))
        for kind, target in (("cuda", {"kind": "cuda", "arch": "sm_80"}), ("llvm", "llvm"))}
    assert "call_llvm_pure_intrin" not in lowered["cuda"]
    assert "call_llvm_pure_intrin" in lowered["llvm"]


def test_only_the_sequence_output_is_used():
    assert_matches_onnxruntime(recurrent_model("LSTM", "forward", outputs=("Y",)))


def test_full_length_constant_sequence_lens_is_accepted():
    assert_matches_onnxruntime(recurrent_model("GRU", "forward", sequence_lens=np.full(BATCH, SEQ)))


def test_shorter_sequence_lens_is_refused_naming_the_node():
    model = recurrent_model("LSTM", "forward", sequence_lens=np.array([SEQ, 2, SEQ]))
    with pytest.raises(ModelError) as info:
        onnx_frontend.import_model(model, [onnx_frontend.TensorSpec("x", (SEQ, BATCH, INPUT), "float32")])
    assert "LSTM node 'lstm_node'" in str(info.value) and "sequence_lens" in str(info.value)


def test_unknown_activation_is_refused_naming_it():
    model = recurrent_model("GRU", "forward", activations=["Softsign", "Tanh"])
    with pytest.raises(ModelError, match="GRU node 'gru_node': activation 'Softsign'"):
        onnx_frontend.import_model(model, [onnx_frontend.TensorSpec("x", (SEQ, BATCH, INPUT), "float32")])


def test_an_op_neither_importer_knows_is_still_named_with_its_node():
    model = recurrent_model("GRU", "forward")
    model.graph.node[0].op_type = "RNN"  # plain RNN: no converter anywhere
    with pytest.raises(ModelError, match=r"RNN \(nodes: gru_node\)"):
        onnx_frontend.import_model(model, [onnx_frontend.TensorSpec("x", (SEQ, BATCH, INPUT), "float32")])


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_compiles_through_the_pipeline_and_verifies(kind, tmp_path, config_path):
    """The fused, scheduled artifact matches ONNX Runtime (compile_model verifies it)."""
    from tvm_fusion.api import compile_model

    path = tmp_path / f"{kind}.onnx"
    onnx.save(recurrent_model(kind, "bidirectional", initial=True), path)
    result = compile_model(path, config_path(), [], output_dir=tmp_path / "build")
    outputs = result.metadata["verification"]["outputs"]
    assert len(outputs) == (3 if kind == "LSTM" else 2) and all(o["within_tolerance"] for o in outputs)

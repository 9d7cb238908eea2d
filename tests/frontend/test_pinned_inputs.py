"""``--input-value sr=16000``: a one-element input compiled for one value. An If on it keeps the
branch that value takes (silero VAD's spox export: its 8 kHz branch cannot run on 512 samples),
the artifact refuses another value, and a pinned input may be left out at run time."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import helpers
from test_if import if_model
from tvm_fusion import api
from tvm_fusion.cli import build_parser
from tvm_fusion.errors import ArtifactError, ModelError, ShapeError
from tvm_fusion.frontend import onnx as onnx_frontend
from tvm_fusion.runtime import load


def test_value_flags_parse_beside_shape_flags():
    assert api.parse_input_shapes(["x:2x8", "sr=16000", "gain=0.5"]) == {"x": (2, 8), "sr": 16000, "gain": 0.5}
    args = build_parser().parse_args(["compile", "m.onnx", "--input-shape", "x:2x8", "--input-value", "sr=16000"])
    assert args.input_shape == ["x:2x8", "sr=16000"]
    with pytest.raises(ShapeError, match=r"--input-value sr=16000 and --input-value sr=8000"):
        api.parse_input_shapes(["sr=16000", "sr=8000"])


def test_a_pinned_input_is_bound_with_its_value_and_sampled_as_it():
    model = if_model()
    specs = onnx_frontend.bind_input_shapes(model, {"sr": 16000})
    assert specs[1] == onnx_frontend.TensorSpec("sr", (), "int64", 16000)
    assert specs[1].to_json() == {"name": "sr", "shape": [], "dtype": "int64", "value": 16000}
    assert onnx_frontend.random_inputs(model, specs, seed=3)["sr"] == 16000


@pytest.mark.parametrize(("pinned", "message"), [
    ({"x": 1}, r"pins input 'x', but it has shape 2x8: only a one-element input"),
    ({"sr": 1.5}, r"--input-value sr=1.5 is not a int64 value"),
    ({"rate": 8000}, r"--input-value names 'rate', which is not an input of the model"),
])
def test_bad_pins_name_the_input(pinned, message):
    with pytest.raises(ShapeError, match=message):
        onnx_frontend.bind_input_shapes(if_model(), pinned)


def test_a_pinned_input_keeps_the_branch_its_value_takes():
    """Branches of different shapes ([2, 4] and [1, 4]) stay an If unless ``sr`` is pinned."""
    model = if_model(else_shape_differs=True)
    for rate, kept in ((16000, "by_rate/then_branch/"), (8000, "by_rate/else_branch/")):
        simplified = onnx_frontend.simplify(model, onnx_frontend.bind_input_shapes(model, {"sr": rate}))
        ops = [node.op_type for node in simplified.graph.node]
        assert "If" not in ops and "Where" not in ops
        assert all(node.name.startswith(kept) for node in simplified.graph.node if node.op_type == "MatMul")
        assert [value.name for value in simplified.graph.input] == ["x", "sr"]  # the signature stays


def test_must_not_keep_one_branch_of_an_unpinned_input():
    model = if_model(else_shape_differs=True)
    simplified = onnx_frontend.simplify(model, onnx_frontend.bind_input_shapes(model))
    assert "If" in [node.op_type for node in simplified.graph.node]


def test_the_artifact_runs_its_value_and_refuses_another(tmp_path, config_path):
    path = helpers.save(if_model(else_shape_differs=True), tmp_path / "rate_switch.onnx")
    result = api.compile_model(path, config_path(schedule="default"), ["sr=8000"], output_dir=tmp_path / "build")
    assert result.report.fired["gemm_epilogue"] == 0  # only the one-row branch is compiled: a bare MatMul
    model = load(result.artifact)
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    expected = helpers.ort_outputs(path, {"x": x, "sr": np.array(8000, np.int64)})["y"]
    np.testing.assert_allclose(model.run({"x": x, "sr": np.array(8000, np.int64)})["y"], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.run({"x": x})["y"], expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ArtifactError, match=r"input 'sr' is 16000, but the model was compiled for sr=8000 only"):
        model.run({"x": x, "sr": np.array(16000, np.int64)})


def _reshaping_branch() -> object:
    """``x`` reshaped to three rows: 16 elements do not split so, at any batch."""
    return helper.make_graph([helper.make_node("Reshape", ["x", "three_rows"], ["rows_out"])], "rows", [],
                             [helper.make_tensor_value_info("rows_out", TensorProto.FLOAT, None)],
                             [numpy_helper.from_array(np.array([3, -1], np.int64), "three_rows")])


def test_an_if_that_does_not_import_suggests_pinning_its_input(tmp_path):
    model = if_model()
    next(a for a in model.graph.node[1].attribute if a.name == "else_branch").g.CopyFrom(_reshaping_branch())
    path = helpers.save(model, tmp_path / "broken_branch.onnx")
    with pytest.raises(ModelError, match=r"branches on the value of sr: .* --input-value sr=VALUE"):
        api.prepare(path)
    assert api.prepare(path, input_shapes=["sr=16000"]).relax_module is not None

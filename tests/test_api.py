"""The Python API's argument handling (the CLI's flags are tested in test_cli.py)."""

import sys

import pytest

from tvm_fusion import api
from tvm_fusion.commands import bench
from tvm_fusion.errors import ShapeError, ToolchainError


@pytest.mark.parametrize("shapes", ["input:1x3x8x8", ["input:1x3x8x8"], {"input": [1, 3, 8, 8]},
                                    {"input": (1, 3, 8, 8)}, {"input": "1x3x8x8"}, [("input", (1, 3, 8, 8))],
                                    [("input", "1x3x8x8")], (("input", [1, 3, 8, 8]),)])
def test_input_shapes_as_one_flag_a_list_or_a_dict(shapes):
    assert api.parse_input_shapes(shapes) == {"input": (1, 3, 8, 8)}


def test_input_shapes_from_python_take_ranges_and_values():
    assert api.parse_input_shapes({"ids": "1x1..512", "sr": 16000}) == {"ids": (1, (1, 512, 1)), "sr": 16000}
    assert api.parse_input_shapes([("ids", (1, (32, 640, 32)))]) == {"ids": (1, (32, 640, 32))}


@pytest.mark.parametrize("shapes, culprit", [({"input": (1, 0.5)}, "input_shapes['input'] is (1, 0.5)"),
                                             ({"input": (1, 0)}, "input_shapes['input'] is (1, 0)"),
                                             ([(1, 2)], "input_shapes entry (1, 2)"),
                                             ({"input": None}, "input_shapes['input'] is None")])
def test_a_python_shape_that_is_not_one_names_the_parameter(shapes, culprit):
    with pytest.raises(ShapeError) as info:
        api.parse_input_shapes(shapes)
    assert culprit in info.value.message


def test_a_bad_shape_flag_names_itself():
    with pytest.raises(ShapeError, match="input:1xthree"):
        api.parse_input_shapes("input:1xthree")


def test_bench_compares_a_bool_output_too(tmp_path, config_path):
    """A model that also returns a mask (the romanizer encoder's src_mask_out) benches."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Greater", ["x", "zero"], ["mask"])],
        "with_mask", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8]),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 8])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    path = tmp_path / "with_mask.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    report = api.bench_model(path, config_path(), repeat=2, warmup=1, include_stock=False)
    assert report.max_abs_error == {"tvm_fusion": 0.0}
    assert set(report.medians_ms) == {"onnxruntime", "tvm_fusion"}


def test_bench_peer_openvino(mlp_path, config_path):
    report = api.bench_model(mlp_path, config_path(), "x:4x16", repeat=2, warmup=1, include_stock=False,
                             peers=("openvino",))
    assert set(report.medians_ms) == {"onnxruntime", "tvm_fusion", "openvino", "openvino_default"}
    assert 0 <= report.max_abs_error["openvino"] < 1e-4
    assert report.peer_precision["openvino"] == "f32" and report.peer_precision["openvino_default"]
    assert report.peak is not None and report.peak.gflops > 0
    assert report.to_json()["peak"]["gbytes_per_s"] == report.peak.gbytes_per_s


def test_bench_peer_openvino_missing_fails_before_any_build(monkeypatch, mlp_path, config_path):
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` raises ImportError
    monkeypatch.setattr(bench, "ModelSession", lambda *a, **k: pytest.fail("prepared before checking the peers"))
    with pytest.raises(ToolchainError, match=r"pip install 'tvm_fusion\[peers\]'"):
        api.bench_model(mlp_path, config_path(), "x:4x16", peers=("openvino",))


def test_bench_unknown_peer_names_the_choices(mlp_path, config_path):
    with pytest.raises(api.TvmFusionError, match="unknown benchmark peer 'tensorrt'") as error:
        api.bench_model(mlp_path, config_path(), "x:4x16", peers="tensorrt")
    assert "openvino" in error.value.hint

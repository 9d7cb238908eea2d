"""Dims given as ranges: parsing (flag and config), binding, and the bad-input cases."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from tvm_fusion.config import parse_config
from tvm_fusion.errors import ConfigError, ShapeError
from tvm_fusion.frontend.dims import DimRange, evaluate_dim, size_points
from tvm_fusion.frontend.onnx import bind_input_shapes, parse_shape_flag


def encoder_model():
    """input_ids and attention_mask [batch, sequence] int64 (one named dim shared), pixel [1, 3, -1, ?]."""
    graph = helper.make_graph(
        [helper.make_node("Identity", [name], [f"y_{name}"]) for name in ("input_ids", "attention_mask", "pixel")],
        "encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("pixel", TensorProto.FLOAT, [1, 3, -1, "?"])],
        [helper.make_tensor_value_info(f"y_{n}", t, None) for n, t in
         [("input_ids", TensorProto.INT64), ("attention_mask", TensorProto.INT64), ("pixel", TensorProto.FLOAT)]])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("flag,expected", [
    ("input_ids:1x1..512", ("input_ids", (1, (1, 512, 1)))),
    ("pixel:1,3,32..640/32,32..640/32", ("pixel", (1, 3, (32, 640, 32), (32, 640, 32)))),
    ("x:8..8x16", ("x", ((8, 8, 1), 16))),
])
def test_a_dim_may_be_a_range(flag, expected):
    assert parse_shape_flag(flag) == expected


@pytest.mark.parametrize("flag,words", [
    ("x:512..1", "inverted"), ("x:0..16", "starts at 0"), ("x:1...16", "cannot parse"),
    ("x:..16", "cannot parse"), ("x:1..", "cannot parse"), ("x:30..640/32", "not multiples of its step 32"),
    ("x:32..640/0", "step is 0"),
])
def test_bad_ranges_are_one_clear_error(flag, words):
    with pytest.raises(ShapeError) as info:
        parse_shape_flag(flag)
    assert words in info.value.message and info.value.exit_code == 4


def test_a_range_binds_symbolically_under_the_models_dim_name_for_every_input_sharing_it():
    specs = bind_input_shapes(encoder_model(), {"input_ids": (1, (1, 512, 1)), "pixel": (1, 3, 7, 9)})
    by_name = {s.name: s for s in specs}
    assert by_name["input_ids"].shape == (1, DimRange("sequence", 1, 512))
    assert by_name["attention_mask"].shape == (1, DimRange("sequence", 1, 512))
    assert by_name["input_ids"].dynamic and not by_name["pixel"].dynamic
    assert by_name["input_ids"].to_json()["shape"] == [1, "sequence"]


def test_unnamed_dims_get_ranges_named_after_input_and_axis():
    specs = bind_input_shapes(encoder_model(), {"input_ids": (1, 4), "pixel": (1, 3, (16, 64, 1), (8, 32, 8))})
    pixel = next(s for s in specs if s.name == "pixel")
    assert pixel.shape == (1, 3, DimRange("pixel_dim2", 16, 64), DimRange("pixel_dim3", 8, 32, 8))
    assert str(pixel.shape[3]) == "8..32/8" and pixel.shape[3].var_name == "pixel_dim3_div8"


def test_a_range_of_one_size_is_that_size():
    specs = bind_input_shapes(encoder_model(), {"input_ids": (1, (7, 7, 1)), "pixel": (1, 3, 2, 2)})
    assert specs[0].shape == (1, 7) and not specs[0].dynamic


def test_a_range_on_a_dim_the_model_fixes_is_refused():
    with pytest.raises(ShapeError) as info:
        bind_input_shapes(encoder_model(), {"input_ids": (1, 4), "pixel": (1, (1, 3, 1), 2, 2)})
    assert "dim 1 is fixed to 3" in info.value.message and "range 1..3" in info.value.message


def test_one_named_dim_given_two_different_ranges_is_refused():
    with pytest.raises(ShapeError) as info:
        bind_input_shapes(encoder_model(), {"input_ids": (1, (1, 512, 1)), "attention_mask": (1, (1, 256, 1)),
                                            "pixel": (1, 3, 2, 2)})
    assert "'sequence' is 1..512" in info.value.message and "1..256" in info.value.message


def test_config_inputs_take_a_range():
    cfg = parse_config({"inputs": {"sequence": "1..512", "batch": 1, "height": "32..640/32"}}, "t")
    assert cfg.dim_defaults == {"sequence": (1, 512, 1), "batch": 1, "height": (32, 640, 32)}
    specs = bind_input_shapes(encoder_model(), {"pixel": (1, 3, 2, 2)}, cfg.dim_defaults)
    assert specs[0].shape == (1, DimRange("sequence", 1, 512))


@pytest.mark.parametrize("value,words", [("512..1", "inverted"), ("big", "not LOW..HIGH"), ("0..4", "starts at 0")])
def test_bad_config_ranges_name_the_key(value, words):
    with pytest.raises(ConfigError) as info:
        parse_config({"inputs": {"sequence": value}}, "t", "my.toml")
    assert "my.toml" in info.value.message and "inputs.sequence" in info.value.message
    assert words in info.value.message


def test_sizes_to_verify_are_the_low_end_typical_and_high_end():
    ranges = {"sequence": DimRange("sequence", 1, 512), "height": DimRange("height", 32, 128)}
    assert size_points(ranges) == [{"sequence": 1, "height": 32}, {"sequence": 23, "height": 64},
                                   {"sequence": 512, "height": 128}]
    assert size_points({"n": DimRange("n", 4, 4)}) == [{"n": 4}]
    assert DimRange("height", 32, 640, 32).typical == 128  # sqrt(32 * 640) = 143, to the nearest step


def test_symbolic_dims_evaluate_at_a_runs_sizes():
    from tvm import tirx

    sequence = tirx.Var("sequence", "int64")
    assert evaluate_dim(tirx.floordiv(sequence - 1, 2) + 1, {"sequence": 9}) == 5
    assert evaluate_dim(7, {}) == 7

"""ONNX frontend: loading, shape binding, unsupported ops, shape-subgraph simplification."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import helpers
import tvm_fusion
from tvm_fusion import api
from tvm_fusion.errors import ArtifactError, ModelError, ShapeError
from tvm_fusion.frontend.onnx import (TensorSpec, bind_input_shapes, load_onnx, parse_shape_flag,
                                      random_inputs, unsupported_ops)

BERT = helpers.EXAMPLES / "bert_tiny.onnx"
GPT2 = helpers.EXAMPLES / "gpt2_tiny.onnx"


def model_error(path) -> ModelError:
    with pytest.raises(ModelError) as info:
        load_onnx(path)
    assert info.value.exit_code == 3
    assert str(path) in str(info.value)
    return info.value


def shape_error(call, *args) -> ShapeError:
    with pytest.raises(ShapeError) as info:
        call(*args)
    assert info.value.exit_code == 4
    return info.value


# --- load_onnx -------------------------------------------------------------------------------

def test_load_valid_model(mlp_path):
    model = load_onnx(mlp_path)
    assert [n.op_type for n in model.graph.node] == [
        "MatMul", "Add", "Div", "Erf", "Add", "Mul", "Mul", "MatMul", "Add"]


def test_load_missing_file(tmp_path):
    err = model_error(tmp_path / "absent.onnx")
    assert "does not exist" in err.message


def test_load_directory(tmp_path):
    err = model_error(tmp_path)
    assert "is a directory" in err.message


def test_load_text_file(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("this is a text file, not a protobuf\n" * 20)
    err = model_error(path)
    assert "is not an ONNX model" in err.message and "exporter" in err.hint


def test_load_random_bytes(tmp_path):
    path = tmp_path / "noise.onnx"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    err = model_error(path)
    assert "not" in err.message and "ONNX model" in err.message


def test_load_empty_file(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    err = model_error(path)
    assert "no graph nodes" in err.message


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 0.99])
def test_load_truncated_model(tmp_path, mlp_path, fraction):
    data = mlp_path.read_bytes()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: int(len(data) * fraction)])
    err = model_error(path)
    assert "is not an ONNX model" in err.message


def test_load_model_that_fails_the_checker(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["undefined_tensor"], ["y"], name="relu")], "bad",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "invalid.onnx"
    path.write_bytes(model.SerializeToString())
    err = model_error(path)
    assert "not a valid ONNX model" in err.message and "undefined_tensor" in err.message
    assert "\n" not in err.message  # only the checker's first line


# --- parse_shape_flag ------------------------------------------------------------------------

@pytest.mark.parametrize("flag,expected", [
    ("x:4x16", ("x", (4, 16))),
    ("input_ids:1,128", ("input_ids", (1, 128))),
    ("  pixel_values:1x3x224x224 ", ("pixel_values", (1, 3, 224, 224))),
    ("scalar_len:7", ("scalar_len", (7,))),
    ("onnx::Reshape_0:2x3", ("onnx::Reshape_0", (2, 3))),  # exporter names contain colons
])
def test_parse_shape_flag(flag, expected):
    assert parse_shape_flag(flag) == expected


@pytest.mark.parametrize("flag", ["x", "x:", ":4x16", "x:4x", "x:4xx16", "x:-1x16", "x:Nx16",
                                  "x=4x16", "x:4.0x16"])
def test_parse_shape_flag_rejects(flag):
    err = shape_error(parse_shape_flag, flag)
    assert repr(flag) in err.message and "NAME:DIMxDIM" in err.hint


def test_parse_shape_flag_rejects_zero_dim():
    err = shape_error(parse_shape_flag, "x:0x16")
    assert "'x:0x16'" in err.message and "zero" in err.message


# --- bind_input_shapes -----------------------------------------------------------------------

def two_input_model():
    """a[batch, seq, 8] float, b[batch] int64, c[3, 'n'] float."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["a"], ["ya"]), helper.make_node("Identity", ["b"], ["yb"]),
         helper.make_node("Identity", ["c"], ["yc"])], "multi",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "seq", 8]),
         helper.make_tensor_value_info("b", TensorProto.INT64, ["batch"]),
         helper.make_tensor_value_info("c", TensorProto.FLOAT, [3, None])],
        [helper.make_tensor_value_info(n, t, None) for n, t in
         [("ya", TensorProto.FLOAT), ("yb", TensorProto.INT64), ("yc", TensorProto.FLOAT)]])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_bind_explicit_shapes():
    specs = bind_input_shapes(two_input_model(), {"a": (2, 5, 8), "b": (2,), "c": (3, 4)})
    assert specs == [TensorSpec("a", (2, 5, 8), "float32"), TensorSpec("b", (2,), "int64"),
                     TensorSpec("c", (3, 4), "float32")]


def test_bind_dim_defaults_by_name():
    specs = bind_input_shapes(two_input_model(), {"c": (3, 9)}, {"batch": 6, "seq": 11, "other": 2})
    assert [s.shape for s in specs] == [(6, 11, 8), (6,), (3, 9)]


def test_explicit_shape_beats_dim_default_for_every_input_sharing_the_dim():
    specs = bind_input_shapes(two_input_model(), {"a": (1, 2, 8), "c": (3, 1)}, {"batch": 6, "seq": 11})
    assert [s.shape for s in specs] == [(1, 2, 8), (1,), (3, 1)]


def test_unbound_named_dim():
    err = shape_error(bind_input_shapes, two_input_model(), {}, {"batch": 2})
    assert "input 'a' dim 1 ('seq') is dynamic and unbound" in err.message
    assert "--input-shape a:Nx" in err.hint and "x8" in err.hint
    assert "seq = N under [inputs]" in err.hint


def test_unbound_anonymous_dim_is_named_after_input_and_axis():
    err = shape_error(bind_input_shapes, two_input_model(), {}, {"batch": 2, "seq": 3})
    assert "input 'c' dim 1 ('c_dim1') is dynamic and unbound" in err.message
    assert "--input-shape c:3xN" in err.hint and "c_dim1 = N under [inputs]" in err.hint
    assert bind_input_shapes(two_input_model(), {}, {"batch": 2, "seq": 3, "c_dim1": 7})[2].shape == (3, 7)


def negative_dim_model() -> onnx.ModelProto:
    """paddle2onnx's spelling of a dynamic batch: ``dim_value: -1`` instead of a ``dim_param``."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 3, 8])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "negative_dim", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_negative_dim_value_is_dynamic_and_binds_from_the_flag():
    assert bind_input_shapes(negative_dim_model(), {"x": (4, 3, 8)})[0].shape == (4, 3, 8)
    err = shape_error(bind_input_shapes, negative_dim_model(), {"x": (4, 2, 8)})
    assert "'x' dim 1 is fixed to 3" in err.message  # the positive dims stay fixed


def test_negative_dim_value_binds_from_config_under_its_generated_name():
    err = shape_error(bind_input_shapes, negative_dim_model(), {})
    assert "input 'x' dim 0 ('x_dim0') is dynamic and unbound" in err.message
    assert "--input-shape x:Nx3x8" in err.hint and "x_dim0 = N under [inputs]" in err.hint
    assert bind_input_shapes(negative_dim_model(), {}, {"x_dim0": 5})[0].shape == (5, 3, 8)


def test_negative_dim_model_compiles_and_verifies(tmp_path, config_path):
    from tvm_fusion.api import compile_model

    path = tmp_path / "negative_dim.onnx"
    onnx.save(negative_dim_model(), path)
    result = compile_model(path, config_path(), ["x:2x3x8"], output_dir=tmp_path / "build")
    assert result.metadata["inputs"][0]["shape"] == [2, 3, 8]
    assert all(o["within_tolerance"] for o in result.metadata["verification"]["outputs"])


def test_wrong_rank():
    err = shape_error(bind_input_shapes, two_input_model(), {"a": (2, 8)}, {"batch": 1, "seq": 1})
    assert "'a' has rank 3" in err.message and "2 dims" in err.message and "give 3 dims" in err.hint


def test_conflicting_static_dim():
    err = shape_error(bind_input_shapes, two_input_model(), {"a": (2, 5, 9)}, {"batch": 1})
    assert "'a' dim 2 is fixed to 8" in err.message and "gives 9" in err.message
    assert "use 8" in err.hint


def test_unknown_input_name_lists_real_inputs():
    err = shape_error(bind_input_shapes, two_input_model(), {"input_ids": (1, 4)}, {})
    assert "'input_ids'" in err.message and "not an input" in err.message
    assert "a, b, c" in err.hint


def test_initializers_listed_as_inputs_are_not_inputs(mlp_path):
    model = load_onnx(mlp_path)
    model.graph.input.extend([helper.make_tensor_value_info("w1", TensorProto.FLOAT, [16, 32])])
    assert [s.name for s in bind_input_shapes(model, {}, {"batch": 2})] == ["x"]
    err = shape_error(bind_input_shapes, model, {"w1": (16, 32)}, {})
    assert "the model's inputs are: x" in err.hint


def test_input_without_shape_needs_an_explicit_shape():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "unranked",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    err = shape_error(bind_input_shapes, model, {}, {"batch": 1})
    assert "'x' has no shape" in err.message and "--input-shape x:" in err.hint
    assert bind_input_shapes(model, {"x": (2, 3)}) == [TensorSpec("x", (2, 3), "float32")]


def test_unsupported_input_dtype():
    graph = helper.make_graph([helper.make_node("Identity", ["s"], ["y"])], "strings",
                              [helper.make_tensor_value_info("s", TensorProto.STRING, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.STRING, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelError) as info:
        bind_input_shapes(model, {})
    assert "'s'" in info.value.message and "STRING" in info.value.message
    assert "float32" in info.value.hint and "bfloat16" in info.value.hint


# --- unsupported ops -------------------------------------------------------------------------

def test_unsupported_ops_lists_op_types_and_nodes(unsupported_path):
    assert unsupported_ops(load_onnx(unsupported_path)) == {
        "Celu": ["celu_first", "celu_second"], "com.example.FancyOp": ["fancy_node"],
        "com.example.Relu": ["custom_relu"]}


def test_prepare_reports_all_unsupported_ops_in_one_error(unsupported_path, config_path):
    with pytest.raises(ModelError) as info:
        api.prepare(unsupported_path, config_path())
    message = str(info.value)
    assert info.value.exit_code == 3
    assert "Celu (nodes: celu_first, celu_second)" in message
    assert "com.example.FancyOp (nodes: fancy_node)" in message
    assert "com.example.Relu (nodes: custom_relu)" in message
    assert "relu_ok" not in message and message.count("\n") == 1


def test_stock_importer_rejects_the_same_ops(unsupported_path):
    """Our list must agree with TVM: stock from_onnx refuses Celu too."""
    from tvm.relax.frontend.onnx import from_onnx

    with pytest.raises(NotImplementedError, match="Celu"):
        from_onnx(onnx.load(str(unsupported_path)), shape_dict={"x": [2, 4]})


# --- exporter shape subgraphs ----------------------------------------------------------------

def test_stock_import_fails_on_shape_subgraph(shape_model_path):
    from tvm.relax.frontend.onnx import from_onnx

    model = onnx.load(str(shape_model_path))
    assert {"Shape", "Gather", "Unsqueeze", "Concat", "Reshape", "Equal", "Where", "Expand"} <= {
        n.op_type for n in model.graph.node}
    with pytest.raises(ValueError, match="Cannot compare two tensors"):  # the Equal on a shape
        from_onnx(model, shape_dict={"x": [3, 8]}, dtype_dict={"x": "float32"})


def test_prepare_imports_shape_subgraph_and_compiled_result_matches_ort(shape_model_path, config_path,
                                                                        tmp_path):
    import tvm_fusion

    prepared = api.prepare(shape_model_path, config_path(), ["x:3x8"])
    main = prepared.relax_module["main"]
    assert [int(d) for d in main.params[0].ty.shape] == [3, 8]
    assert [int(d) for d in main.ret_ty.shape] == [3, 2, 4]
    # The reference model is the original, not the simplified one.
    assert "Shape" in {n.op_type for n in prepared.onnx_model.graph.node}

    result = api.compile_model(shape_model_path, config_path(), ["x:3x8"], output_dir=tmp_path)
    assert all(c.within_tolerance for c in result.comparisons)
    x = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32)
    got = tvm_fusion.load(result.artifact).run({"x": x})
    expected = helpers.ort_outputs(shape_model_path, {"x": x})
    np.testing.assert_allclose(got["y"], expected["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path,shapes", [
    (BERT, ["input_ids:1x16", "attention_mask:1x16"]),
    (GPT2, ["input_ids:1x16"]),
], ids=["bert_tiny", "gpt2_tiny"])
def test_bundled_exporter_graphs_import(path, shapes, config_path):
    prepared = api.prepare(path, config_path(), shapes)
    main = prepared.relax_module["main"]
    assert [(p.name, [int(d) for d in p.ty.shape], p.ty.dtype) for p in main.params] == [
        (s.split(":")[0], [1, 16], "int64") for s in shapes]
    assert [int(d) for d in main.ret_ty.shape] == [1, 16, 256]
    assert prepared.output_names == ["last_hidden_state"]


def test_gpt2_needs_the_simplification():
    """GPT-2's causal-mask Expand idiom is what stock import trips over."""
    from tvm.relax.frontend.onnx import from_onnx

    with pytest.raises(Exception):
        from_onnx(onnx.load(str(GPT2)), shape_dict={"input_ids": [1, 16]}, dtype_dict={"input_ids": "int64"})


# --- random_inputs ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_inputs_stay_inside_gathered_tables(embedding_path, seed):
    model = load_onnx(embedding_path)
    specs = bind_input_shapes(model, {"ids": (4, 64), "flags": (4, 64)})
    values = random_inputs(model, specs, seed)
    ids, flags = values["ids"], values["flags"]
    assert ids.dtype == np.int64 and ids.shape == (4, 64)
    assert ids.min() >= 0 and ids.max() < 10  # the table has 10 rows
    assert ids.max() >= 2  # the index range is the table's, not the default 0/1
    assert set(np.unique(flags)) <= {0, 1}
    helpers.ort_outputs(embedding_path, values)  # ORT accepts them (it checks Gather indices)


def test_random_inputs_are_seeded_and_typed(mlp_path):
    model = load_onnx(mlp_path)
    specs = bind_input_shapes(model, {"x": (3, 16)})
    first, again, other = (random_inputs(model, specs, s)["x"] for s in (0, 0, 1))
    assert first.dtype == np.float32 and first.shape == (3, 16)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_random_inputs_for_bert_ids_within_vocab():
    model = load_onnx(BERT)
    specs = bind_input_shapes(model, {"input_ids": (2, 128), "attention_mask": (2, 128)})
    values = random_inputs(model, specs, 0)
    vocab = next(i.dims[0] for i in model.graph.initializer if "word_embeddings" in i.name)
    assert 0 <= values["input_ids"].min() and values["input_ids"].max() < vocab
    assert values["input_ids"].max() >= 2
    assert set(np.unique(values["attention_mask"])) <= {0, 1}


def test_a_graph_onnxslim_refuses_is_imported_as_it_is(monkeypatch):
    import onnxslim

    from tvm_fusion.frontend import onnx as onnx_frontend

    model = helpers.mlp_model()
    specs = bind_input_shapes(model, {"x": (4, helpers.IN_FEATURES)})

    def refuse(*_args, **_kwargs):
        raise RuntimeError("onnxslim cannot handle this graph")

    monkeypatch.setattr(onnxslim, "slim", refuse)
    assert onnx_frontend.simplify(model, specs) is model
    assert onnx_frontend.import_model(model, specs)["main"] is not None


# --- bfloat16 and optional-tensor inputs (what stock TVM's importer accepts) -----------------

def einsum_bf16_model(opset: int) -> onnx.ModelProto:
    """y = x @ w in bfloat16; ONNX Runtime has a bfloat16 Einsum kernel from opset 28 only."""
    graph = helper.make_graph(
        [helper.make_node("Einsum", ["x", "w"], ["y"], equation="ij,jk->ik")], "einsum_bf16",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [3, 4]),
         helper.make_tensor_value_info("w", TensorProto.BFLOAT16, [4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [3, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def test_bfloat16_inputs_bind_and_get_random_float_data():
    model = einsum_bf16_model(28)
    specs = bind_input_shapes(model, {})
    assert specs == [TensorSpec("x", (3, 4), "bfloat16"), TensorSpec("w", (4, 5), "bfloat16")]
    x = random_inputs(model, specs, 0)["x"]
    assert str(x.dtype) == "bfloat16" and x.shape == (3, 4)
    assert not np.array_equal(x.astype(np.float32), np.round(x.astype(np.float32)))  # normal, not 0/1


def test_bfloat16_model_compiles_verifies_and_runs_from_npy(tmp_path, config_path, capsys):
    import ml_dtypes

    import tvm_fusion
    from tvm_fusion import cli

    path = helpers.save(einsum_bf16_model(28), tmp_path / "einsum_bf16.onnx")
    result = api.compile_model(path, config_path(), output_dir=tmp_path / "build")
    assert result.verification == "matches ONNX Runtime"
    assert result.comparisons and all(c.within_tolerance for c in result.comparisons)
    assert [s["dtype"] for s in result.metadata["inputs"]] == ["bfloat16", "bfloat16"]

    x = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    w = np.ones((4, 5), ml_dtypes.bfloat16)
    model = tvm_fusion.load(result.artifact)
    y = model.run({"x": x, "w": w})["y"]
    assert str(y.dtype) == "bfloat16"
    np.testing.assert_array_equal(y.astype(np.float32), np.repeat([[6.0], [22.0], [38.0]], 5, axis=1))
    with pytest.raises(ArtifactError, match="expected bfloat16") as info:
        model.run({"x": x.astype(np.float32), "w": w})
    assert "ml_dtypes" in info.value.hint

    # np.save stores bfloat16 as raw 2-byte records; `run --input` must read them back as bfloat16.
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "w.npy", w)
    assert np.load(tmp_path / "x.npy").dtype.kind == "V"
    code = cli.main(["run", str(result.artifact), "--input", f"x={tmp_path / 'x.npy'}",
                     "--input", f"w={tmp_path / 'w.npy'}"])
    out = capsys.readouterr().out
    assert code == 0 and "y: shape [3, 5] dtype bfloat16 mean 22" in out


def test_a_model_onnxruntime_cannot_run_is_built_but_marked_not_verified(tmp_path, config_path):
    """ORT rejects bfloat16 Einsum before opset 28: there is no reference, and the result says so."""
    path = helpers.save(einsum_bf16_model(17), tmp_path / "einsum_bf16_old.onnx")
    result = api.compile_model(path, config_path(), output_dir=tmp_path / "build")
    assert result.verification.startswith("NOT VERIFIED: ONNX Runtime cannot run the model")
    assert result.metadata["verification"]["status"] == "not run"
    assert "Einsum" in result.metadata["verification"]["reason"]
    assert result.metadata["outputs"][0]["dtype"] == "bfloat16"  # the artifact still ran
    assert (result.artifact / "metadata.json").is_file()


def typed_input_model(input_type: onnx.TypeProto, op: str) -> onnx.ModelProto:
    output = (helper.make_tensor_value_info("y", TensorProto.BOOL, []) if op == "OptionalHasElement"
              else helper.make_tensor_value_info("y", TensorProto.FLOAT, [4]))
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "typed_input",
                              [helper.make_value_info("x", input_type)], [output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("op", ["OptionalHasElement", "OptionalGetElement"])
def test_optional_tensor_input_is_compiled_as_its_tensor(tmp_path, config_path, op):
    optional = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [4]))
    model = typed_input_model(optional, op)
    assert bind_input_shapes(model, {}) == [TensorSpec("x", (4,), "float32")]
    path = helpers.save(model, tmp_path / f"{op}.onnx")
    result = api.compile_model(path, config_path(), output_dir=tmp_path / "build")
    assert result.verification == "matches ONNX Runtime"


@pytest.mark.parametrize("input_type,described", [
    (helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [4])), "sequence"),
    (helper.make_optional_type_proto(helper.make_sequence_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, [4]))), "optional sequence"),
], ids=["sequence", "optional_sequence"])
def test_non_tensor_input_is_refused_naming_the_input(input_type, described):
    model = typed_input_model(input_type, "OptionalHasElement")
    with pytest.raises(ModelError) as info:
        bind_input_shapes(model, {})
    assert info.value.exit_code == 3
    assert f"input 'x' has type {described}, not a tensor type" in info.value.message
    assert "tensor inputs" in info.value.hint


def test_a_named_dim_bound_by_one_flag_binds_every_input_that_shares_it():
    specs = bind_input_shapes(two_input_model(), {"a": (3, 5, 8), "c": (3, 2)})
    assert [s.shape for s in specs] == [(3, 5, 8), (3,), (3, 2)]  # b is [batch]: 3 from a's flag


def test_a_named_dim_given_two_sizes_by_flags_is_an_error():
    err = shape_error(bind_input_shapes, two_input_model(), {"a": (3, 5, 8), "b": (4,), "c": (3, 2)})
    assert "dim 'batch' is 3 in --input-shape a but 4 in --input-shape b" in err.message


def test_question_mark_dims_are_anonymous_not_one_shared_size():
    """paddle2onnx writes '?' for every unknown dim: they are not one size, and bind by axis."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "?", "?"])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "paddle", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert bind_input_shapes(model, {"x": (1, 3, 48, 192)})[0].shape == (1, 3, 48, 192)
    err = shape_error(bind_input_shapes, model, {})
    assert "input 'x' dim 2 ('x_dim2') is dynamic and unbound" in err.message
    assert bind_input_shapes(model, {}, {"x_dim2": 48, "x_dim3": 320})[0].shape == (1, 3, 48, 320)


def test_an_input_no_node_reads_stays_in_the_compiled_signature(tmp_path, config_path):
    """onnxslim drops it; callers still pass every input the ONNX model declares (LAC's length)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "unused_input",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("length", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    path = tmp_path / "unused_input.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    result = api.compile_model(path, config_path(), [], output_dir=tmp_path / "build")
    assert [i["name"] for i in result.metadata["inputs"]] == ["x", "length"]
    out = tvm_fusion.load(result.artifact).run({"x": -np.ones((2, 3), np.float32), "length": np.array([3])})
    np.testing.assert_array_equal(out["y"], np.zeros((2, 3), np.float32))

"""inspect --graph: the before/after drawing, and the ONNX nodes each fusion absorbed."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from tvm_fusion import api, cli
from tvm_fusion.errors import ArtifactError
from tvm_fusion.graph_render import check_graph_path, fused_graph, layered_layout, node_edges

DATA = Path(__file__).resolve().parent / "data"
GPT2_BLOCK = DATA / "gpt2_block_opset17.onnx"


@pytest.fixture(scope="module")
def gpt2_inspected(tmp_path_factory):
    folder = tmp_path_factory.mktemp("graphs")
    report = api.inspect_model(GPT2_BLOCK, input_shapes=["input_ids:1x8"], graph=folder / "gpt2.svg")
    return report, folder / "gpt2.svg"


def test_each_skip_layernorm_names_the_onnx_nodes_it_absorbed(gpt2_inspected):
    report, _ = gpt2_inspected
    norms = [i for i in report.instances if i.pattern == "skip_layernorm"]
    assert len(norms) == 3
    for instance in norms:
        assert instance.ops[-1] == "LayerNormalization" and "Add" in instance.ops
        assert all(name.startswith("/") for name in instance.nodes)  # the exporter's node names
    assert {n for i in norms for n in i.nodes} >= {"/model/ln_f/LayerNormalization", "/model/h.0/Add_1"}
    json_instances = report.to_json()["instances"]
    assert [i["variant"] for i in json_instances] == [i.variant for i in report.instances]


def test_no_onnx_node_is_claimed_by_two_fusions(gpt2_inspected):
    report, _ = gpt2_inspected
    claimed = [index for instance in report.instances for index in instance.indices]
    assert len(claimed) == len(set(claimed))


def test_svg_is_written_with_both_panels_and_the_pattern_labels(gpt2_inspected):
    _, svg = gpt2_inspected
    text = svg.read_text()
    assert text.startswith("<?xml") and "</svg>" in text
    assert "before fusion" in text and "after fusion" in text and "skip_layernorm.skip" in text
    assert not list(svg.parent.glob(".*tmp*"))  # written atomically, no staging file left


def test_collapsed_graph_has_one_box_per_group():
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Add", ["x", "r"], ["s"], name="add"),
             helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], name="ln"),
             helper.make_node("Relu", ["y"], ["z"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4])
                                           for n in ("x", "r")] +
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("g", "b")],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4])])
    model = helper.make_model(graph)
    group = SimpleNamespace(pattern="skip_layernorm", variant="skip_layernorm.skip",
                            ops=["Add", "LayerNormalization"], indices=[0, 1])
    labels, edges, patterns = fused_graph(model, [group])
    assert labels == ["skip_layernorm.skip\nAdd + LayerNormalization", "Relu"]
    assert edges == [(0, 1)] and patterns == {0: "skip_layernorm"}
    assert node_edges(model) == [(0, 1), (1, 2)]
    layout = layered_layout(3, node_edges(model))
    assert [layout[i][1] for i in range(3)] == [0, -1, -2]  # one layer per step, top to bottom
    assert onnx.checker.check_model(model) is None


@pytest.mark.parametrize("name", ["graph.pdf", "graph"])
def test_unknown_format_is_refused_before_any_work(tmp_path, name):
    with pytest.raises(ArtifactError, match="svg or .png"):
        check_graph_path(tmp_path / name)
    assert not (tmp_path / name).exists()


def test_cli_inspect_draws_png(tmp_path, capsys):
    target = tmp_path / "out" / "block.png"
    code = cli.main(["-q", "inspect", str(GPT2_BLOCK), "--input-shape", "input_ids:1x8", "--graph", str(target)])
    assert code == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "ONNX nodes absorbed" in out and "/model/ln_f/LayerNormalization" in out


def test_cli_inspect_rejects_a_bad_graph_path(tmp_path, capsys):
    code = cli.main(["-q", "inspect", str(GPT2_BLOCK), "--graph", str(tmp_path / "g.jpeg")])
    assert code == ArtifactError.exit_code
    assert "give --graph a path ending in .svg or .png" in capsys.readouterr().err

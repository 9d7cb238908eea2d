"""inspect --graph: the fused graph drawn (.png/.svg/.html), and the ONNX nodes each fusion absorbed."""

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion import api, cli
from tvm_fusion.errors import ArtifactError
from tvm_fusion.render.layout import layers_of, layout
from tvm_fusion.render.model import fused_graph, node_edges
from tvm_fusion.render import check_graph_path, render_fusion_graph
from tvm_fusion.render.repeats import find_repeats, fold_repeats

DATA = Path(__file__).resolve().parent / "data"
GPT2_BLOCK = DATA / "gpt2_block_opset17.onnx"
MODELS = Path(__file__).resolve().parents[1] / "examples" / "models"


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


def test_svg_is_written_with_the_fused_boxes(gpt2_inspected):
    _, svg = gpt2_inspected
    text = svg.read_text()
    assert text.startswith("<?xml") and "</svg>" in text
    assert "ONNX nodes" in text and "skip_layernorm.skip" in text and "Add + LayerNormalization" in text
    assert not list(svg.parent.glob(".*tmp*"))  # written atomically, no staging file left


def collapsible_model() -> onnx.ModelProto:
    """x + r -> LayerNorm -> Relu, and shape arithmetic (Shape -> Gather) feeding a Reshape."""
    nodes = [helper.make_node("Add", ["x", "r"], ["s"], name="add"),
             helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], name="ln"),
             helper.make_node("Relu", ["y"], ["z"], name="relu"),
             helper.make_node("Shape", ["z"], ["shape"], name="shape"),
             helper.make_node("Reshape", ["z", "shape"], ["out"], name="reshape")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4])
                                           for n in ("x", "r")] +
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("g", "b")],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4])])
    return helper.make_model(graph)


SKIP_NORM = SimpleNamespace(pattern="skip_layernorm", variant="skip_layernorm.skip", ops=["Add", "LayerNormalization"],
                            indices=[0, 1])


def test_collapsed_graph_has_one_box_per_group_and_leaves_out_shape_arithmetic():
    model = collapsible_model()
    graph = fused_graph(model, [SKIP_NORM])
    assert [box.lines for box in graph.boxes] == [["skip_layernorm.skip", "Add + LayerNormalization"], ["Relu"],
                                                  ["Reshape"]]
    assert graph.boxes[0].members == ["add (Add)", "ln (LayerNormalization)"] and graph.folded_nodes == 1
    assert graph.edges == [(0, 1), (1, 2)] and graph.boxes[0].pattern == "skip_layernorm"
    assert node_edges(model) == [(0, 1), (1, 2), (2, 3), (2, 4), (3, 4)]
    assert layers_of(3, graph.edges) == [0, 1, 2]  # one layer per step, top to bottom


def repeated_blocks_model(blocks: int, parallel: bool = False) -> onnx.ModelProto:
    """``blocks`` times MatMul -> Relu -> Add(block input), each block reading the one before
    (or, ``parallel``, all reading x: look-alike branches, not a sequence)."""
    nodes, current = [], "x"
    for k in range(blocks):
        source = "x" if parallel else current
        nodes += [helper.make_node("MatMul", [source, "w"], [f"m{k}"], name=f"mm{k}"),
                  helper.make_node("Relu", [f"m{k}"], [f"r{k}"], name=f"relu{k}"),
                  helper.make_node("Add", [f"r{k}", source], [f"a{k}"], name=f"add{k}")]
        current = f"a{k}"
    outputs = [f"a{k}" for k in range(blocks)] if parallel else [current]
    graph = helper.make_graph(nodes, "blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, [4, 4]) for o in outputs],
                              [numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")])
    return helper.make_model(graph)


def test_a_run_of_identical_layers_is_drawn_once_with_its_count():
    graph = fused_graph(repeated_blocks_model(4), [])
    assert find_repeats(graph) == [(0, 3, 4)]
    folded = fold_repeats(graph)
    assert [box.lines[0] for box in folded.boxes] == ["MatMul", "Relu", "Add"]
    assert folded.frames == [([0, 1, 2], 4)] and folded.edges == [(0, 1), (1, 2)]
    assert layout(folded).frames[0][4] == "this block x4"


def test_look_alike_parallel_branches_are_not_folded():
    assert find_repeats(fused_graph(repeated_blocks_model(3, parallel=True), [])) == []


def boxes_overlap(a, b) -> bool:
    return (abs(a.x - b.x) < (a.width + b.width) / 2 and a.y < b.y + b.height and b.y < a.y + a.height)


def test_long_graphs_wrap_into_columns_without_overlapping_boxes():
    scene = layout(fused_graph(repeated_blocks_model(12), []))  # 36 boxes in a chain, unfolded
    assert len({box.column for box in scene.boxes}) >= 2
    assert 0.5 < scene.width / scene.height < 4
    assert not any(boxes_overlap(a, b) for i, a in enumerate(scene.boxes) for b in scene.boxes[i + 1:])
    assert scene.connectors  # edges between columns end in numbered connectors
    tags = [tag for _, _, tag in scene.connectors]
    assert all(tags.count(tag) >= 2 for tag in tags)  # one where the edge leaves, one where each arrives


def test_html_view_is_self_contained_searchable_and_lists_every_node(tmp_path):
    model = repeated_blocks_model(3)
    path = render_fusion_graph(model, [], tmp_path / "g.html", title="blocks")
    text = path.read_text()
    assert '<input id="search"' in text and "addEventListener(\"wheel\"" in text
    assert "this block" not in text  # every box drawn: search finds every node
    for node in model.graph.node:
        assert f"{node.name} ({node.op_type})" in text
    assert re.findall(r'(?:src|href)="(?:https?:)?//', text) == []  # nothing fetched from the network
    assert set(re.findall(r"https?://[^\s\"']+", text)) <= {"http://www.w3.org/2000/svg"}


def test_bundled_gpt2_png_stays_a_readable_size(tmp_path):
    """The fused gpt2_tiny at its natural size: a screen, not a poster (it was 4765x5560 px)."""
    from PIL import Image

    api.inspect_model(MODELS / "gpt2_tiny.onnx", graph=tmp_path / "gpt2.png")
    width, height = Image.open(tmp_path / "gpt2.png").size
    assert width <= 1400 and height <= 1100 and 0.6 < width / height < 2.5


@pytest.mark.parametrize("name", ["graph.pdf", "graph"])
def test_unknown_format_is_refused_before_any_work(tmp_path, name):
    with pytest.raises(ArtifactError, match="svg, .png or .html"):
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
    assert "give --graph a path ending in .svg, .png or .html" in capsys.readouterr().err

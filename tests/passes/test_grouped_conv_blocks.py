"""grouped_conv_blocks: narrow conv groups merged into groups of whole channel blocks."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.relax.op import nn

from helpers import ort_outputs, run_lowered
from tvm_fusion import api
from tvm_fusion.passes.grouped_conv_blocks import merged_groups
from tvm_fusion.passes.pad_conv_channels import pad_conv_channels

RNG = np.random.default_rng(0)


def filters(out_channels, group_width, kernel=3):
    return RNG.standard_normal((out_channels, group_width, kernel, kernel)).astype("float32")


def grouped_reference(x, weight, groups, padding=1):
    """NCHW grouped conv in numpy (stride 1), the semantics the merged conv must keep."""
    _, channels, height, width = x.shape
    group_width, kernel = weight.shape[1], weight.shape[2]
    padded = np.pad(x, [(0, 0), (0, 0), (padding, padding), (padding, padding)])
    out = np.zeros((x.shape[0], weight.shape[0], height + 2 * padding - kernel + 1, width + 2 * padding - kernel + 1),
                   "float64")
    per_group = weight.shape[0] // groups
    for o in range(weight.shape[0]):
        inputs = range(o // per_group * group_width, (o // per_group + 1) * group_width)
        for i_local, i in enumerate(inputs):
            for ky in range(kernel):
                for kx in range(kernel):
                    out[:, o] += weight[o, i_local, ky, kx] * padded[:, i, ky:ky + out.shape[2], kx:kx + out.shape[3]]
    return out


def test_two_8_wide_groups_share_a_16_channel_block_with_zero_filters_between():
    weight = filters(48, 8)
    merged, groups = merged_groups(weight, 6, tuple(range(48)), 48, 16)
    assert groups == 3 and merged.shape == (48, 16, 3, 3)
    np.testing.assert_array_equal(merged[:8, :8], weight[:8])  # group 0: block 0's first half
    np.testing.assert_array_equal(merged[8:16, 8:], weight[8:16])  # group 1: its second half
    assert not merged[:8, 8:].any() and not merged[8:16, :8].any()
    x = RNG.standard_normal((1, 48, 5, 7)).astype("float32")
    np.testing.assert_allclose(grouped_reference(x, merged, 3), grouped_reference(x, weight, 6), rtol=1e-6, atol=1e-5)


def test_a_padded_map_gets_its_padded_channels_as_a_group_of_zero_filters():
    """RegNet's 104 channels (13 groups of 8) padded to 112: 7 blocks, the padded block's
    filters zero, each real channel where the padded map holds it."""
    weight = filters(104, 8)
    merged, groups = merged_groups(weight, 13, tuple(range(104)), 112, 16)
    assert groups == 7 and merged.shape == (112, 16, 3, 3)
    assert not merged[104:].any()
    x = RNG.standard_normal((1, 104, 6, 6)).astype("float32")
    padded_x = np.concatenate([x, RNG.standard_normal((1, 8, 6, 6)).astype("float32")], axis=1)
    np.testing.assert_allclose(grouped_reference(padded_x, merged, 7)[:, :104], grouped_reference(x, weight, 13),
                               rtol=1e-6, atol=1e-5)


def test_groups_already_on_whole_blocks_keep_their_filters():
    weight = filters(64, 16)
    merged, groups = merged_groups(weight, 4, tuple(range(64)), 64, 16)
    assert groups == 4
    np.testing.assert_array_equal(merged, weight)


@pytest.mark.parametrize("group_width, groups, positions, width, why", [
    (4, 8, tuple(range(32)), 32, "four 4-wide groups per block: 4x the multiply-adds"),
    (8, 3, tuple(range(4, 28)), 32, "channels 12-19 straddle two blocks: 32 wide to merge"),
    (8, 3, tuple(range(24)), 24, "the map is not whole blocks"),
])
def test_must_not_merge(group_width, groups, positions, width, why):
    assert merged_groups(filters(groups * group_width, group_width), groups, positions, width, 16) is None, why


def test_groups_as_wide_in_as_out_only():
    """Two groups of 8 inputs and 16 outputs each: a channel multiplier, not merged."""
    assert merged_groups(filters(32, 8), 2, tuple(range(16)), 16, 16) is None


def _module(channels, groups):
    """conv 1x1 (16 -> channels) -> relu -> grouped 3x3 -> relu -> conv 1x1 (channels -> 16)."""
    x = relax.Var("x", relax.TensorType((1, 16, 7, 9), "float32"))

    def const(*shape):
        return relax.const((RNG.standard_normal(shape) * 0.3).astype("float32"))

    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            first = nn.relu(nn.conv2d(nn.relu(nn.conv2d(x, const(16, 16, 1, 1))), const(channels, 16, 1, 1)))
            grouped = nn.relu(nn.conv2d(first, const(channels, channels // groups, 3, 3), padding=1, groups=groups))
            out = builder.emit_output(nn.conv2d(grouped, const(16, channels, 1, 1)))
        builder.emit_func_output(out)
    return builder.get()


@pytest.mark.parametrize("channels, groups, merged", [(104, 13, 7), (48, 6, 3)])
def test_pad_conv_channels_merges_the_groups_of_a_regnet_block(channels, groups, merged):
    before = _module(channels, groups)
    after, _ = pad_conv_channels(before, 16)
    (grouped,) = [c for c in _convs(after) if int(c.attrs.groups) != 1]
    assert int(grouped.attrs.groups) == merged and tuple(grouped.args[1].value.shape)[1] == 16
    x = RNG.standard_normal((1, 16, 7, 9)).astype("float32")
    np.testing.assert_allclose(run_lowered(after, x), run_lowered(before, x), rtol=1e-5, atol=1e-5)


def test_must_not_merge_groups_of_a_map_from_outside_the_conv_region():
    """The grouped conv reads the graph input: nothing padded to follow, and its groups left."""
    x = relax.Var("x", relax.TensorType((1, 48, 5, 5), "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            out = builder.emit_output(nn.conv2d(x, relax.const(filters(48, 8)), padding=1, groups=6))
        builder.emit_func_output(out)
    before = builder.get()
    after, count = pad_conv_channels(before, 16)
    assert count == 0
    tvm.ir.assert_structural_equal(after, before)


def _convs(mod):
    found = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and getattr(e.op, "name", None) == "relax.nn.conv2d" else None)
    return found


def test_a_regnet_block_compiles_blocked_and_matches_onnx_runtime(tmp_path):
    """Stem, 1x1 expansion to 104 channels, a 3x3 conv in 13 groups of 8, 1x1 projection plus
    the residual: every conv runs blocked under Conv2dNCHWc, none in NCHW, on the host's block
    (8 or 16 channels); outputs agree with ONNX Runtime (rtol 1e-4, atol 1e-5)."""
    def weight(name, *shape):
        return numpy_helper.from_array((RNG.standard_normal(shape) * 0.2).astype("float32"), name)

    nodes = [
        helper.make_node("Conv", ["x", "stem"], ["s"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["s"], ["s_relu"]),
        helper.make_node("Conv", ["s_relu", "expand"], ["e"]), helper.make_node("Relu", ["e"], ["e_relu"]),
        helper.make_node("Conv", ["e_relu", "grouped"], ["g"], group=13, pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["g"], ["g_relu"]),
        helper.make_node("Conv", ["g_relu", "project"], ["p"]), helper.make_node("Add", ["p", "s_relu"], ["y"])]
    graph = helper.make_graph(
        nodes, "regnet_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 30, 22])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 15, 11])],
        [weight("stem", 32, 3, 3, 3), weight("expand", 104, 32, 1, 1), weight("grouped", 104, 8, 3, 3),
         weight("project", 32, 104, 1, 1)])
    path = tmp_path / "regnet_block.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    prepared = api.prepare(path)
    optimized = api.optimize(prepared, tuning_log=False)
    assert optimized.report.variants["blocked_layout.conv2d"] == 4
    assert set(optimized.schedule_rules.values()) - {"Injective"} == {"Conv2dNCHWc"}
    x = RNG.standard_normal((1, 3, 30, 22)).astype("float32")
    vm = relax.VirtualMachine(api.build(optimized.module, prepared.config), tvm.cpu())
    (expected,) = ort_outputs(path, {"x": x}).values()
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), expected, rtol=1e-4, atol=1e-5)

"""No kernel of the bundled CNNs runs as naive loops: each gets the rule written for it."""

import dataclasses

import pytest
import tvm
import tvm_ffi

from helpers import EXAMPLES, REPO_ROOT
from tvm_fusion import api
from tvm_fusion.config import load_config

# Kernels that only move data (layout transforms, the classifier's flatten) are Injective's.
DATA_MOVEMENT = ("layout_transform", "reshape")


@pytest.mark.parametrize("model, blocked_depthwise, conv_rules", [
    ("resnet_tiny", False, {"Conv2dNCHWc"}),                         # the RGB stem writes blocks
    ("mobilenetv3_tiny", False, {"Conv2dNCHW", "DepthwiseConv2d"}),
    # depthwise blocked too; on 8-channel blocks (AVX2), which its 24-, 40- and 96-channel
    # depthwise convs are whole multiples of (on AVX-512's 16 they are padded to whole blocks)
    ("mobilenetv3_tiny", True, {"Conv2dNCHWc", "DepthwiseConv2dNCHWc"}),
    ("dbnet_tiny", False, {"Conv2dNCHWc", "Conv2dTranspose"}),      # 24 and 8 channels padded to 32, 16
])
def test_every_kernel_gets_a_specific_schedule(model, blocked_depthwise, conv_rules):
    base = load_config(REPO_ROOT / "configs" / "x86_64-avx2.toml") if blocked_depthwise else load_config(None)
    config = dataclasses.replace(base, blocked_depthwise=blocked_depthwise)
    prepared = api.prepare(EXAMPLES / f"{model}.onnx", config, "input:1x3x64x64")
    optimized = api.optimize(prepared, tuning_log=False)
    rules = optimized.schedule_rules
    assert "Fallback" not in rules.values(), rules
    generic = [kernel for kernel, rule in rules.items() if rule == "Injective"]
    assert all(any(word in kernel for word in DATA_MOVEMENT) for kernel in generic), generic
    assert conv_rules <= set(rules.values())
    # Private tiles are stack arrays (helpers.TILE_SCOPE): TVM turns a "local" buffer on the
    # CPU into a workspace allocation and release per tile.
    scopes = set()
    for func in optimized.module.functions.values():
        if isinstance(func, tvm.tirx.PrimFunc):
            tvm_ffi.structural_walk(func.body, (tvm.s_tir.SBlock, lambda block: scopes.update(
                buf.scope() for buf in block.alloc_buffers)))
    assert scopes == {"global"}

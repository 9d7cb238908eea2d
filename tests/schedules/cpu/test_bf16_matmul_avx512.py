"""Bf16MatmulAvx512: the bf16 matmul kernel (frontend/bf16_matmul.py) and a conv's
(frontend/bf16_conv.py) on AVX512_BF16's ``vdpbf16ps`` register tiles, built for named targets
(assembly read, never run), run on the host where it has AVX512_BF16 (less its AMX features, if
any) against a numpy reference that rounds both operands to bf16 (bf16_kernels.assert_bf16_result)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from bf16_kernels import (assert_bf16_conv_result, assert_bf16_result, bf16_conv_module, bf16_kernel, bf16_module,
                          leading)
from int8_kernels import kernel_assembly, scheduled
from loop_structure import loop_kinds
from machine import host_target_without_amx
from test_bf16_matmul_amx import CONVS
from tvm import relax, te

from tvm_fusion.kernels.cpu_features import has_avx512_bf16
from tvm_fusion.schedules.cpu import Bf16MatmulAvx512
from tvm_fusion.schedules.registry import rules_for_kind

ZEN4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
NO_BF16 = [tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2}) for mcpu in ("znver3", "icelake-server")]
HOST_NO_AMX = tvm.target.Target(host_target_without_amx())
host_bf16 = pytest.mark.skipif(not has_avx512_bf16(HOST_NO_AMX), reason="the host CPU has no AVX512_BF16 (the "
                               "kernel's generic form is tested in tests/frontend/test_bf16_matmul.py)")


def on_registers(mod: tvm.IRModule, target) -> tvm.IRModule:
    return scheduled(mod, Bf16MatmulAvx512(), target, bf16_kernel)


def test_runs_after_the_tiles_and_before_the_float_matmul_rules():
    names = [type(rule).__name__ for rule in rules_for_kind("llvm")]
    assert names.index("Bf16MatmulAmx") < names.index("Bf16MatmulAvx512") < names.index("MatmulEpilogue")


def test_zen4_tiles_the_sum_in_registers_with_vdpbf16ps():
    """The activation rounded in a pass of its own (33 rows), then 33 rows in tiles of 3, 64
    columns in one tile of 4 blocks: 12 accumulators, each weight load read by 3 rows; the
    instruction itself in the code, no call left."""
    mod, _ = bf16_module(33, 100, 64)
    done = on_registers(mod, ZEN4)
    loops = loop_kinds(bf16_kernel(done)[1])
    assert loops.parallel == [33, 11] and sorted(loops.unrolled) == [3, 4]
    assembly = kernel_assembly(done, ZEN4)
    assert assembly.count("vdpbf16ps") >= 12 and "%zmm" in assembly
    assert "tvm_fusion_dpbf16ps" not in assembly  # inlined: no call
    assert "tdpbf16ps" not in assembly.replace("vdpbf16ps", "")  # no AMX tile


def test_a_recurrent_steps_small_sum_runs_on_one_core():
    """1 x 128 by 128 x 256 (a GRU step's, 32K multiply-adds): no loop across cores, neither the
    rounding pass nor the tiles; waking the other core costs more than the sum."""
    mod, _ = bf16_module(1, 128, 256)
    loops = loop_kinds(bf16_kernel(on_registers(mod, ZEN4))[1])
    assert loops.parallel == [] and 4 in loops.unrolled
    mod, _ = bf16_module(2, 128, 256)  # twice the work: shared
    assert loop_kinds(bf16_kernel(on_registers(mod, ZEN4))[1]).parallel


def test_a_tile_takes_up_to_six_column_blocks():
    """8 rows by 96 columns: tiles of 4 rows by 6 blocks of 16, 24 accumulators (the int8 rule's
    tiles stop at 4 blocks)."""
    mod, _ = bf16_module(8, 64, 96)
    loops = loop_kinds(bf16_kernel(on_registers(mod, ZEN4))[1])
    assert loops.parallel[-1] == 2 and sorted(loops.unrolled) == [4, 6]


@pytest.mark.parametrize("target", NO_BF16, ids=["znver3", "icelake-server"])
def test_must_not_apply_without_avx512_bf16(target):
    mod, _ = bf16_module(7, 64, 17)
    for gvar, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            assert Bf16MatmulAvx512().apply(func, target, False) is None, gvar.name_hint


def test_must_not_take_a_float_matmul():
    a = te.placeholder((8, 32), name="A")
    b = te.placeholder((32, 16), name="B")
    k = te.reduce_axis((0, 32), name="k")
    c = te.compute((8, 16), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="bf16_matmul")
    assert Bf16MatmulAvx512().apply(te.create_prim_func([a, b, c]), ZEN4, False) is None


def test_kernels_of_one_module_share_the_imported_instruction():
    """Each kernel links the same LLVM function in (linkonce_odr): two kernels build as one module."""
    first, _ = bf16_module(8, 64, 32)
    second, _ = bf16_module(5, 48, 48, seed=1)
    gvar, func = bf16_kernel(on_registers(first, ZEN4))
    other_gvar, other = bf16_kernel(on_registers(second, ZEN4))
    both = tvm.IRModule({"first": func.with_attr("global_symbol", "first"),
                         "second": other.with_attr("global_symbol", "second")})
    assembly = tvm.tirx.build(both, target=ZEN4).inspect_source("asm")
    assert "first" in assembly and "second" in assembly and "vdpbf16ps" in assembly


@host_bf16
@pytest.mark.parametrize("m, k, n", [(1, 13, 20), (1, 768, 768), (3, 64, 17), (7, 13, 20), (33, 100, 64),
                                     (17, 100, 48), (197, 256, 72), ((2, 3), 13, 20), ((2, 19), 64, 20),
                                     (16, 1100, 1030)])
def test_scheduled_kernel_matches_the_bf16_reference_on_the_host(m, k, n):
    """M=1, odd K (padded to even), N not a multiple of 16, prime M, batched data (its rows
    merged), a weight past 1 MiB (its column tiles outermost)."""
    mod, weight = bf16_module(m, k, n)
    a = np.random.default_rng(1).standard_normal((*leading(m), k)).astype(np.float32)
    vm = relax.VirtualMachine(tvm.compile(on_registers(mod, HOST_NO_AMX), target=HOST_NO_AMX), tvm.cpu())
    assert_bf16_result(vm["main"](tvm.runtime.tensor(a)).numpy(), a, weight)


@pytest.mark.parametrize("conv", CONVS, ids=list(CONVS))
def test_a_conv_kernel_builds_its_patches_per_tile_of_rows(conv):
    mod, _ = bf16_conv_module(CONVS[conv])
    done = on_registers(mod, ZEN4)
    script = bf16_kernel(done)[1].script()
    rounded_once = CONVS[conv].kernel != (1, 1)  # a 1x1 conv's patches round each value they read
    assert ('T.sblock("bf16_conv_input")' in script) == rounded_once
    assert script.count("T.parallel") >= 1 + rounded_once  # [the rounded input,] the tiles
    assert "vdpbf16ps" in kernel_assembly(done, ZEN4)


def test_a_flat_convs_epilogue_follows_each_tile():
    """17 output columns (prime, past 16): the tiles straddle output rows; the output layout, the
    bias and the ReLU still follow each tile, over the epilogue's (n, y, x) as one pixel axis,
    instead of waiting for the whole sum in memory."""
    mod, _ = bf16_conv_module(CONVS["strided-k-tail"])
    script = bf16_kernel(on_registers(mod, ZEN4))[1].script()
    blocks = re.findall(r'T\.sblock\("(\w+)"\)', script)
    assert blocks[blocks.index("bf16_matmul_update_o") + 1:] == ["compute"]  # layout, bias, ReLU in one
    assert "bf16_matmul = T.sblock_alloc_buffer" not in script  # no sum in memory
    assert len(re.findall(r"T\.parallel", script)) == 2  # input rounding, tiles with their epilogue


@host_bf16
@pytest.mark.parametrize("conv", CONVS, ids=list(CONVS))
def test_scheduled_conv_matches_the_bf16_reference_on_the_host(conv):
    geometry = g = CONVS[conv]
    mod, matrix = bf16_conv_module(geometry)
    shape = (g.batch, g.channels // g.data_block, g.height, g.width, g.data_block) if g.data_block else (
        g.batch, g.channels, g.height, g.width)
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    vm = relax.VirtualMachine(tvm.compile(on_registers(mod, HOST_NO_AMX), target=HOST_NO_AMX), tvm.cpu())
    assert_bf16_conv_result(vm["main"](tvm.runtime.tensor(x)).numpy(), x, matrix, geometry)

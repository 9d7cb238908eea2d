"""Bf16MatmulAmx: the bf16 matmul kernel (frontend/bf16_matmul.py) on AMX tiles (``tdpbf16ps``),
built for named targets (assembly read, never run), run on the host where it has AMX-BF16
against a numpy reference that rounds both operands to bf16 (bf16_kernels.assert_bf16_result)."""

from __future__ import annotations

import re
import ml_dtypes
import numpy as np
import pytest
import tvm
from bf16_kernels import (assert_bf16_conv_result, assert_bf16_result, bf16_conv_module, bf16_kernel, bf16_module,
                          leading)
from helpers import run_python
from int8_kernels import kernel_assembly, scheduled
from loop_structure import loop_kinds
from machine import host_target
from tvm import relax, te

from tvm_fusion.frontend.conv_geometry import ConvGeometry
from tvm_fusion.kernels.cpu_features import has_amx_bf16
from tvm_fusion.schedules.cpu import Bf16MatmulAmx, Bf16MatmulAvx512
from tvm_fusion.schedules.cpu.amx_tiles import square_rows, tall_rows
from tvm_fusion.schedules.cpu.bf16_matmul_amx import BF16_TILES
from tvm_fusion.schedules.registry import rules_for_kind
from tvm_fusion.targets import export_options, host_cpu_flags
from tvm_fusion.targets.amx import request_amx_permission

AMX = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
HOST = tvm.target.Target(host_target())
# The host less AVX512_BF16: its tiles take sums of every size. With it, a small static sum (a
# recurrent step's) is left to Bf16MatmulAvx512's registers on one core; the tile code is tested
# at such sizes here.
HOST_TILES_ONLY = tvm.target.Target({**host_target(), "mattr": ["-avx512bf16"]})


def on_tiles(mod: tvm.IRModule, target) -> tvm.IRModule:
    return scheduled(mod, Bf16MatmulAmx(), target, bf16_kernel)


host_amx = pytest.mark.skipif(not {"amx_bf16", "amx_tile"} <= host_cpu_flags() or not has_amx_bf16(HOST)
                              or not request_amx_permission(),
                              reason="the host CPU has no AMX-BF16 (the kernel's generic form is tested "
                                     "in tests/frontend/test_bf16_matmul.py)")


def test_runs_before_the_float_matmul_rules():
    names = [type(rule).__name__ for rule in rules_for_kind("llvm")]
    assert names.index("Bf16MatmulAmx") < min(names.index("MatmulEpilogue"), names.index("Reduction"))


def test_amx_target_uses_bf16_tile_instructions():
    mod, _ = bf16_module(32, 100, 64)
    done = on_tiles(mod, AMX)
    # 2 row tiles of 16 x 1 column tile of 64 (4 C tiles), one AMX call each, across cores
    assert loop_kinds(bf16_kernel(done)[1]).parallel[-1] == 2
    assembly = kernel_assembly(done, AMX)
    for instruction in ("sttilecfg", "ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored"):
        assert instruction in assembly, instruction
    assert "tdpbusd" not in assembly


def test_a_sum_of_whole_tile_pairs_takes_2x2_calls():
    """64 rows x 64 columns x K 128: each call two A tiles by two B tiles (four products, A tile
    5 meeting B tile 7), the tiles configured only when they hold another configuration."""
    mod, _ = bf16_module(64, 128, 64)
    assembly = kernel_assembly(on_tiles(mod, AMX), AMX)
    assert "tdpbf16ps\t%tmm7, %tmm5, %tmm3" in assembly
    assert "sttilecfg" in assembly and "tilerelease" not in assembly


@pytest.mark.parametrize("rows, columns, depth, expected", [
    (64, 64, 128, 32), (40, 32, 64, 20), (80, 64, 576, 20), (160, 32, 32, 32),
    (64, 48, 128, 0),  # an odd number of column blocks
    (64, 64, 100, 0),  # a K tail
    (14, 64, 64, 0), (34, 64, 64, 0)])  # no two row tiles of 8 or more
def test_2x2_calls_need_whole_tiles(rows, columns, depth, expected):
    assert square_rows(BF16_TILES, rows, columns, depth) == expected


@host_amx
def test_kernels_of_other_tile_shapes_alternate_in_one_process():
    """Each call loads its tile configuration when the tiles hold another: two kernels of other
    shapes (a 2 x 2 call, a 1 x 4 call with a K tail) run one after the other, both right."""
    modules = [bf16_module(64, 128, 64, seed=1), bf16_module(7, 100, 20, seed=2)]
    runs = [(relax.VirtualMachine(tvm.compile(on_tiles(mod, HOST_TILES_ONLY), target=HOST_TILES_ONLY), tvm.cpu())["main"], weight,
             np.random.default_rng(4).standard_normal((64 if i == 0 else 7, weight.shape[0])).astype(np.float32))
            for i, (mod, weight) in enumerate(modules)]
    for _ in range(3):
        for main, weight, a in runs:
            assert_bf16_result(main(tvm.runtime.tensor(a)).numpy(), a, weight)


@pytest.mark.parametrize("mcpu", ["znver4", "cooperlake", "skylake-avx512"])
def test_must_not_apply_without_amx_bf16(mcpu):
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    mod, _ = bf16_module(32, 64, 32)
    for gvar, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            assert Bf16MatmulAmx().apply(func, target, False) is None, gvar.name_hint
    assert "tdpbf16ps" not in kernel_assembly(mod, target)


def test_must_not_take_a_float_matmul():
    a = te.placeholder((32, 64), name="A")
    b = te.placeholder((64, 32), name="B")
    k = te.reduce_axis((0, 64), name="k")
    c = te.compute((32, 32), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="bf16_matmul")
    assert Bf16MatmulAmx().apply(te.create_prim_func([a, b, c]), AMX, False) is None


def test_a_symbolic_row_count_is_declined():
    mod, _ = bf16_module(tvm.tirx.Var("m", "int64"), 64, 32)
    assert Bf16MatmulAmx().apply(bf16_kernel(mod)[1], AMX, False) is None


def test_a_prime_row_count_runs_tiles_of_16_and_a_tail():
    mod, _ = bf16_module(197, 64, 64)
    func = bf16_kernel(on_tiles(mod, AMX))[1]
    assert loop_kinds(func).parallel[-3:] == [12, 1, 197]


@host_amx
@pytest.mark.parametrize("m, k, n", [(1, 13, 20), (1, 768, 768), (3, 64, 17), (7, 13, 20), (33, 100, 64),
                                     (17, 100, 48), (197, 256, 72), ((2, 3), 13, 20), ((4, 1), 64, 32),
                                     ((2, 19), 64, 20), (128, 768, 3072)])
def test_scheduled_kernel_matches_the_bf16_reference_on_the_host(m, k, n):
    """M=1 (a one-row tile), odd K (padded to even) and K past 32 (the K tail's tiles), N not a
    multiple of 16, prime M (tiles of 16 and a tail), batched data (its rows merged: 2 x 19 is
    38 rows, tiles of 16 and a tail), a weight past 1 MiB."""
    mod, weight = bf16_module(m, k, n)
    a = np.random.default_rng(1).standard_normal((*leading(m), k)).astype(np.float32)
    vm = relax.VirtualMachine(tvm.compile(on_tiles(mod, HOST_TILES_ONLY), target=HOST_TILES_ONLY), tvm.cpu())
    assert_bf16_result(vm["main"](tvm.runtime.tensor(a)).numpy(), a, weight)


@pytest.mark.parametrize("m, k, n, small", [(1, 128, 256, True), (4, 64, 128, True), (1, 128, 257, False),
                                            (33, 100, 64, False)])
def test_a_small_static_sum_is_left_to_the_registers_where_the_target_has_them(m, k, n, small):
    """A recurrent step's sum (at most MAX_SERIAL_STATIC_WORK multiply-adds) costs more in tile
    setup than in work: on an AMX CPU, which has AVX512_BF16 too, Bf16MatmulAvx512 runs it on
    one core; without AVX512_BF16 the tiles take it."""
    func = bf16_kernel(bf16_module(m, k, n)[0])[1]
    assert (Bf16MatmulAmx().apply(func, AMX, False) is None) == small
    assert Bf16MatmulAmx().apply(func, tvm.target.Target({**AMX.export(), "mattr": ["-avx512bf16"]}), False) is not None
    if small:
        assert Bf16MatmulAvx512().apply(func, AMX, False) is not None


@host_amx
def test_the_activation_is_rounded_to_bf16_in_the_kernel():
    """The kernel's prologue rounds the float32 activation: the result is not the product of
    the float32 activation and the bf16 weight."""
    mod, weight = bf16_module(16, 256, 32)
    a = np.random.default_rng(2).standard_normal((16, 256)).astype(np.float32)
    vm = relax.VirtualMachine(tvm.compile(on_tiles(mod, HOST), target=HOST), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(a)).numpy()
    assert_bf16_result(got, a, weight)
    bf16_weight = weight.astype(ml_dtypes.bfloat16).astype(np.float64)
    unrounded = np.maximum(a.astype(np.float64) @ bf16_weight + 1, 0)
    assert np.abs(got - unrounded).max() > 1e-3


PLAIN_TVM = """
import sys, numpy as np, tvm
from tvm import relax
vm = relax.VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu())
np.save(sys.argv[3], vm["main"](tvm.runtime.tensor(np.load(sys.argv[2]))).numpy())
"""


@host_amx
def test_an_exported_kernel_runs_in_a_fresh_process(tmp_path):
    """The AMX permission that the int8 tiles ask for covers the bf16 ones: the library's
    constructor (export_options' addons) lets a new interpreter run ``tdpbf16ps``."""
    mod, weight = bf16_module(32, 64, 32)
    library = tmp_path / "bf16.so"
    tvm.compile(on_tiles(mod, HOST), target=HOST).export_library(str(library), **export_options("host", host_target()))
    a = np.random.default_rng(3).standard_normal((32, 64)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    ran = run_python(PLAIN_TVM, str(library), str(tmp_path / "a.npy"), str(tmp_path / "y.npy"))
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert_bf16_result(np.load(tmp_path / "y.npy"), a, weight)


CONVS = {  # ConvGeometry: data block, out block, N, C, H, W, Co, OH, OW, kernel, strides, dilation, padding
    "3x3-rows-of-10": ConvGeometry(16, 16, 1, 32, 20, 40, 64, 20, 40, (3, 3), (1, 1), (1, 1), (1, 1)),
    "1x1-batch": ConvGeometry(16, 16, 2, 64, 7, 7, 32, 7, 7, (1, 1), (1, 1), (1, 1), (0, 0)),
    "strided-k-tail": ConvGeometry(16, 16, 1, 16, 17, 33, 48, 9, 17, (3, 3), (2, 2), (1, 1), (1, 1)),
    "nchw-odd-k": ConvGeometry(0, 0, 1, 17, 9, 12, 20, 9, 12, (3, 3), (1, 1), (1, 1), (1, 1)),
    "nchw-strided-flat": ConvGeometry(0, 0, 1, 16, 9, 33, 24, 9, 17, (3, 3), (1, 2), (1, 1), (1, 1)),
    # 2 x 3 x 17 = 102 pixels (no divisor from 8 to 16): 112 patch rows, 10 of them padding
    "batch-padded-rows": ConvGeometry(16, 16, 2, 16, 3, 17, 32, 3, 17, (3, 3), (1, 1), (1, 1), (1, 1)),
    # 3 channels padded to 4 per pixel: each kernel row of a patch one run of 7 x 4 values
    "rgb-7x7-stem": ConvGeometry(0, 16, 1, 3, 32, 32, 32, 16, 16, (7, 7), (2, 2), (1, 1), (3, 3)),
}
# Convs whose tiles read the converted input directly (``conv_geometry.reads_input_directly``):
# channels in whole 32-k tile rows, a 3x3 at stride 1 in 2 x 2 calls and a strided, dilated one of
# a batch with 7-row tiles in 1 x 4 calls; and narrow inputs read by kernel rows padded to whole
# tile rows: 16 channels at a column stride of 3 (48 k in 64), and an NCHW input of 8 channels
# into 8 outputs by 3 x 15 (basic-pitch's shape: 120 k in 128; one column block, 4 x 1 calls of
# 4 tiles of 11 rows).
DIRECT_CONVS = {
    "3x3-direct": ConvGeometry(16, 16, 1, 32, 20, 40, 64, 20, 40, (3, 3), (1, 1), (1, 1), (1, 1), tile_row_depth=32),
    "strided-dilated-batch-direct": ConvGeometry(16, 16, 2, 64, 15, 28, 48, 8, 14, (3, 3), (2, 2), (2, 1), (1, 1),
                                                 tile_row_depth=32),
    "16-channels-strided-runs": ConvGeometry(16, 16, 1, 16, 9, 30, 32, 9, 10, (3, 3), (1, 3), (1, 1), (1, 1),
                                             tile_row_depth=32),
    "nchw-8-channels-runs": ConvGeometry(0, 0, 1, 8, 6, 44, 8, 6, 44, (3, 15), (1, 1), (1, 1), (1, 7),
                                         tile_row_depth=32),
}


@pytest.mark.parametrize("conv", CONVS, ids=list(CONVS))
def test_a_conv_kernel_builds_its_patches_per_tile_of_rows(conv):
    """The patches are built under the tile loop that reads them (where there are row tiles to
    share among cores), on vectors of a blocked input's 16 channels, from an input rounded once
    (a 1x1 conv's patches round each value they read: no pass of its own)."""
    mod, _ = bf16_conv_module(CONVS[conv])
    func = bf16_kernel(on_tiles(mod, AMX))[1]
    script = func.script()
    assert "tdpbf16ps" in script
    rounded_once = CONVS[conv].kernel != (1, 1)
    assert ('T.sblock("bf16_conv_input")' in script) == rounded_once
    assert script.count("T.parallel") >= 1 + rounded_once  # [the rounded input,] the tiles
    if conv == "3x3-rows-of-10":
        assert "T.vectorized(T.int64(16))" in script
        rows_loop = script.index("T.parallel(T.int64(40))")  # 20 output rows x 2 tiles of 20 rows
        assert rows_loop < script.index('T.sblock("bf16_activation")')


@pytest.mark.parametrize("conv", ["strided-k-tail", "nchw-strided-flat"])
def test_a_flat_convs_epilogue_follows_each_tile(conv):
    """17 output columns (prime, past 16): the patch rows are the pixels and a tile's rows
    straddle output rows; the output layout and its epilogue still follow each tile, over the
    epilogue's (n, y, x) as one pixel axis (in NCHW the pixel innermost: whole rows of a plane),
    instead of waiting for the whole sum in memory."""
    mod, _ = bf16_conv_module(CONVS[conv])
    script = bf16_kernel(on_tiles(mod, AMX))[1].script()
    blocks = re.findall(r'T\.sblock\("(\w+)"\)', script)
    assert blocks[blocks.index("bf16_matmul_update_o") + 1:] == ["compute"]  # layout, bias, ReLU in one
    assert "bf16_matmul = T.sblock_alloc_buffer" not in script  # no sum in memory
    stores = re.findall(r"\n *compute\w*\[(.*)\] = ", script)  # the pixel's row and column from one axis
    assert len(stores) == 1 and stores[0].endswith("v1 % T.int64(17)" if conv.startswith("nchw") else "% T.int64(17), v2")


def test_an_rgb_stems_patch_rows_are_vector_runs_of_its_pixel_major_input():
    """The NCHW input converted once into [N, H + 6, W + 6, 4] (its padding zeros), its reads
    clamped inside the input (not dropped under the padding's condition: a vector lane would
    then read outside it); each patch row 7 runs of 28 values, one vector each."""
    mod, _ = bf16_conv_module(CONVS["rgb-7x7-stem"])
    script = bf16_kernel(on_tiles(mod, AMX))[1].script()
    assert "bf16_conv_input = T.sblock_alloc_buffer((T.int64(1), T.int64(37), T.int64(37), T.int64(4))" in script
    conversion = next(line for line in script.splitlines() if "bf16_conv_input[v_n, v_y, v_x, v_c] =" in line)
    assert "T.max(T.min(v_y - T.int64(3), T.int64(31)), T.int64(0))" in conversion
    assert "T.vectorized(T.int64(28))" in script and '"tvm_fusion.patch_loops": [7, 28]' in script


@host_amx
@pytest.mark.parametrize("conv", CONVS, ids=list(CONVS))
def test_scheduled_conv_matches_the_bf16_reference_on_the_host(conv):
    """Rows per output row (tiles of 10, 2 x 2 calls), a batch of 7 x 7 maps, a stride with a
    prime output width (flat rows: the epilogue per tile over one pixel axis) and a K tail, and
    NCHW with K = 153 (its patches built element by element)."""
    geometry = CONVS[conv]
    mod, matrix = bf16_conv_module(geometry)
    g = geometry
    shape = (g.batch, g.channels // g.data_block, g.height, g.width, g.data_block) if g.data_block else (
        g.batch, g.channels, g.height, g.width)
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    vm = relax.VirtualMachine(tvm.compile(on_tiles(mod, HOST), target=HOST), tvm.cpu())
    assert_bf16_conv_result(vm["main"](tvm.runtime.tensor(x)).numpy(), x, matrix, geometry)


@host_amx
def test_a_conv_kernel_with_an_elementwise_prologue_takes_the_tiles():
    """A multiply before the conv in the same kernel (a composite's affine) is inlined into the
    rounded input; the rule finds the patches' block before that (its handle would go stale)."""
    geometry = CONVS["3x3-rows-of-10"]
    mod, matrix = bf16_conv_module(geometry, scale=0.5)
    func = bf16_kernel(mod)[1]
    assert Bf16MatmulAmx().apply(func, HOST, False) is not None
    g = geometry
    x = np.random.default_rng(6).standard_normal((1, g.channels // 16, g.height, g.width, 16)).astype(np.float32)
    vm = relax.VirtualMachine(tvm.compile(on_tiles(mod, HOST), target=HOST), tvm.cpu())
    assert_bf16_conv_result(vm["main"](tvm.runtime.tensor(x)).numpy(), x * 0.5, matrix, geometry)


@pytest.mark.parametrize("conv", DIRECT_CONVS, ids=list(DIRECT_CONVS))
def test_a_direct_convs_tiles_load_its_rounded_input(conv):
    """No patch matrix: the input is rounded once into [N, H', W', C] and every A tile is
    loaded from it, a column stride of C values (2 bytes each) between its rows."""
    geometry = DIRECT_CONVS[conv]
    mod, _ = bf16_conv_module(geometry)
    script = bf16_kernel(on_tiles(mod, AMX))[1].script()
    assert "bf16_activation" not in script and 'T.sblock("bf16_conv_input")' in script
    loads = re.findall(r'tileloadd64", T\.int8\(\d\), T\.address_of\((\w+)\[.*?\]\), T\.int64\((\d+)\)', script)
    a_loads = {(buffer, stride) for buffer, stride in loads if buffer != "b"}
    assert a_loads == {("bf16_conv_input", str(2 * geometry.strides[1] * geometry.channels))}


@host_amx
@pytest.mark.parametrize("conv", DIRECT_CONVS, ids=list(DIRECT_CONVS))
def test_a_direct_conv_matches_the_bf16_reference_on_the_host(conv):
    geometry = DIRECT_CONVS[conv]
    mod, matrix = bf16_conv_module(geometry)
    g = geometry
    shape = (g.batch, g.channels // 16, g.height, g.width, 16) if g.data_block else (g.batch, g.channels, g.height,
                                                                                       g.width)
    x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    vm = relax.VirtualMachine(tvm.compile(on_tiles(mod, HOST), target=HOST), tvm.cpu())
    assert_bf16_conv_result(vm["main"](tvm.runtime.tensor(x)).numpy(), x, matrix, geometry)


def test_a_narrow_convs_one_column_block_takes_4x1_calls():
    """8 output channels (one column block of 16): each B tile loaded serves the products of 4
    A tiles of 11 rows (an output row of 44), the A tiles taking tiles 4 and 5 in turn and the
    B tiles 6 and 7, instead of a B tile loaded again for every A tile."""
    mod, _ = bf16_conv_module(DIRECT_CONVS["nchw-8-channels-runs"])
    done = on_tiles(mod, AMX)
    assembly = kernel_assembly(done, AMX)
    for tiles in ("%tmm6, %tmm4, %tmm0", "%tmm6, %tmm5, %tmm1", "%tmm7, %tmm4, %tmm2", "%tmm7, %tmm5, %tmm3"):
        assert f"tdpbf16ps\t{tiles}" in assembly, tiles


@pytest.mark.parametrize("rows, columns, depth, expected", [
    (264, 16, 960, (4, 44)), (88, 16, 64, (4, 44)), (48, 16, 64, (3, 48)), (24, 16, 32, (2, 24)),
    (64, 16, 64, (4, 64)),
    (264, 32, 960, (1, 0)),  # two column blocks: 2 x 2 or 1 x 4 calls
    (264, 16, 100, (1, 0)),  # a K tail
    (14, 16, 64, (1, 0)), (17, 16, 64, (1, 0))])  # no two row tiles of 8 or more
def test_tall_calls_take_one_column_block_of_whole_tiles(rows, columns, depth, expected):
    assert tall_rows(BF16_TILES, rows, columns, depth) == expected


@host_amx
@pytest.mark.parametrize("m, k, n", [(88, 64, 16), (48, 96, 8), ((2, 24), 32, 12)])
def test_a_tall_call_matches_the_bf16_reference_on_the_host(m, k, n):
    """4 x 1 calls of 11 rows; 3 x 1 of 16 with 8 columns (half the block, zero weights) and
    an odd count of k steps; a batch of 2 x 24 rows in 3 x 1 calls."""
    mod, weight = bf16_module(m, k, n)
    a = np.random.default_rng(8).standard_normal((*leading(m), k)).astype(np.float32)
    vm = relax.VirtualMachine(tvm.compile(on_tiles(mod, HOST_TILES_ONLY), target=HOST_TILES_ONLY), tvm.cpu())
    assert_bf16_result(vm["main"](tvm.runtime.tensor(a)).numpy(), a, weight)


def test_registers_keep_the_patches_of_a_conv_amx_would_read_directly():
    """On vdpbf16ps register tiles (no AMX) the same kernel keeps its patch matrix."""
    mod, _ = bf16_conv_module(DIRECT_CONVS["3x3-direct"])
    zen4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    done = scheduled(mod, Bf16MatmulAvx512(), zen4, bf16_kernel)
    assert 'T.sblock("bf16_activation")' in bf16_kernel(done)[1].script()

"""Int8MatmulVnni: the int8 matmul kernel (frontend/integer_matmul.py) and a quantized conv's
(frontend/int8_conv.py) on ``vpdpbusd`` register tiles, built for named targets (assembly read,
never run), run on the host where it has VNNI (less its AMX features, if any)."""

import numpy as np
import pytest
import tvm
from int8_kernels import (CONVS, DIRECT_CONVS, RGB_STEM, assert_scheduled_conv_is_exact, int8_conv_kernel,
                          int8_conv_module, int8_kernel, int8_module, kernel_assembly, scheduled)
from loop_structure import loop_kinds
from machine import host_target, host_target_without_amx
from tvm import relax, te

from tvm_fusion.frontend.integer_matmul import activation_te, int8_weight, pack_weight, sum_te
from tvm_fusion.kernels.cpu_features import has_vnni
from tvm_fusion.schedules.cpu import Int8MatmulVnni

VNNI = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
NO_VNNI = tvm.target.Target({"kind": "llvm", "mcpu": "znver1", "num-cores": 2})
AVX512_NO_VNNI = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
VNNI_NO_AMX = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
HOST = tvm.target.Target(host_target())
HOST_NO_AMX = tvm.target.Target(host_target_without_amx())


def test_vnni_target_tiles_and_uses_vpdpbusd():
    mod, _ = int8_module(33, 100, 64)
    done = scheduled(mod, Int8MatmulVnni(), VNNI)
    func = int8_kernel(done)[1]
    loops = loop_kinds(func)
    assert loops.parallel == [11 * 1]  # 33 rows in tiles of 3, 64 columns in one tile of 4 blocks
    assert sorted(loops.unrolled) == [3, 4]
    assembly = kernel_assembly(done, VNNI)
    assert "vpdpbusd" in assembly and "%zmm" in assembly


@pytest.mark.parametrize("target", [NO_VNNI, AVX512_NO_VNNI], ids=["znver1", "skylake-avx512"])
def test_must_not_apply_without_vnni(target):
    mod, _ = int8_module(7, 64, 17)
    for gvar, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            assert Int8MatmulVnni().apply(func, target, False) is None, gvar.name_hint
    assert "vpdpbusd" not in kernel_assembly(mod, target)


def test_must_not_take_a_float_matmul():
    a = te.placeholder((8, 32), name="A")
    b = te.placeholder((32, 16), name="B")
    k = te.reduce_axis((0, 32), name="k")
    c = te.compute((8, 16), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="int8_matmul")
    assert Int8MatmulVnni().apply(te.create_prim_func([a, b, c]), VNNI, False) is None


@pytest.mark.skipif(not has_vnni(HOST), reason="the host CPU has no AVX512-VNNI")
@pytest.mark.parametrize("m, k, n", [(1, 13, 3), (7, 64, 17), (33, 100, 64), (128, 256, 1024), (16, 1100, 1030),
                                     ((), 13, 20), ((2, 3), 13, 20)])
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_scheduled_kernel_is_exact_on_the_host(m, k, n, dtype):
    mod, centered = int8_module(m, k, n, dtype)
    info = np.iinfo(dtype)
    a = np.random.default_rng(1).integers(info.min, int(info.max) + 1, (*(m if isinstance(m, tuple) else (m,)), k))
    a = a.astype(dtype)
    vm = relax.VirtualMachine(tvm.compile(scheduled(mod, Int8MatmulVnni(), HOST), target=HOST), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(a)).numpy()
    expected = (a.astype(np.int64) - 3) @ centered
    np.testing.assert_array_equal(got, expected.astype(np.float32))


def test_a_large_weight_is_swept_once_per_column_tile():
    """1100 x 1040 int8 (over 1 MiB): the column tiles outermost, all row tiles under each."""
    mod, _ = int8_module(16, 1100, 1030)
    done = scheduled(mod, Int8MatmulVnni(), VNNI)
    func = int8_kernel(done)[1]
    assert loop_kinds(func).parallel == [65 * 4]  # 65 column blocks of 16 (1 per tile) x 4 row tiles
    # the fused tile index: the row tile varies fastest (index % 4 row tiles), the column tile outside
    assert "_fused % T.int64(4) * T.int64(4)" in func.script()


@pytest.mark.skipif(not has_vnni(HOST), reason="the host CPU has no AVX512-VNNI")
def test_an_activation_prologue_in_the_kernel_runs_as_its_own_pass():
    """int8 data offset to uint8 and padded (13 -> 16) inside the kernel: the prologue is not
    inlined into the tensorized sum (it would break it), and the result is exact."""
    rng = np.random.default_rng(2)
    centered = rng.integers(-128, 128, (13, 32))
    weight, shift = int8_weight(centered)
    assert not shift.any()
    data = te.placeholder((5, 13), "int8", name="data")
    packed = te.placeholder((2, 4, 16, 4), "int8", name="packed")
    total = sum_te(activation_te(data, 128, 16), packed)
    func = te.create_prim_func([data, packed, total])
    sch = Int8MatmulVnni().apply(func, HOST, False)
    assert sch is not None
    built = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=HOST)
    x = rng.integers(-128, 128, (5, 13)).astype("int8")
    out = tvm.runtime.empty((5, 32), "int32", tvm.cpu())
    built["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(pack_weight(weight)), out)
    np.testing.assert_array_equal(out.numpy(), (x.astype(np.int64) + 128) @ centered)


# each conv's row tiles (shared among cores) and its register tile (rows, column blocks)
CONV_TILES = {
    "3x3-rows-of-10": (200, [4, 4]),  # 20 output rows x 10 tiles of 4 rows, 4 blocks of 16 channels
    "1x1-batch": (14, [2, 7]),  # 2 x 7 output rows of 7 pixels: one tile of 7 rows each, 2 blocks
    "strided-prime-width": (51, [3, 3]),  # 9 x 17 pixels as flat rows: 51 tiles of 3 rows, 3 blocks
    "batch-padded-rows": (28, [2, 4]),  # 102 pixels padded to 112 flat rows: 28 tiles of 4 rows, 2 blocks
}


@pytest.mark.parametrize("conv", CONVS, ids=list(CONVS))
def test_a_quantized_conv_kernel_builds_its_patches_per_tile_of_rows(conv):
    """frontend/int8_conv.py's kernel for a CPU with VNNI and no AMX (Zen 4): the input
    converted to bytes once on vectors, then per tile of rows (the loop shared among cores) its
    patch rows, then the ``vpdpbusd`` tiles that read them; no AMX tile instruction. An output
    row of 7 pixels is one tile of 7 rows, not 7 tiles of one. A 1x1 conv's patches read each
    value once: they convert it themselves, and there is no conversion pass."""
    done = scheduled(int8_conv_module(CONVS[conv]), Int8MatmulVnni(), VNNI_NO_AMX, kernel=int8_conv_kernel)
    func = int8_conv_kernel(done)[1]
    script = func.script()
    converted_once = CONVS[conv].kernel != (1, 1)
    assert ('T.sblock("int8_conv_input")' in script) == converted_once
    at = {name: script.index(f'T.sblock("{name}")') for name in ("int8_conv_patches", "int8_matmul_update_o")}
    tiles = script.index("T.parallel", script.index("T.parallel") + 1) if converted_once else script.index("T.parallel")
    assert (script.index('T.sblock("int8_conv_input")') if converted_once else 0) < tiles
    assert tiles < at["int8_conv_patches"] < at["int8_matmul_update_o"]
    # [the conversion,] the patches, the output
    assert script.count("T.vectorized(T.int64(16))") >= 2 + converted_once
    row_tiles, register_tile = CONV_TILES[conv]
    loops = loop_kinds(func)
    assert loops.parallel[int(converted_once)] == row_tiles and sorted(loops.unrolled) == register_tile
    assembly = kernel_assembly(done, VNNI_NO_AMX)
    assert "vpdpbusd" in assembly and "tdpbusd" not in assembly


@pytest.mark.skipif(not has_vnni(HOST), reason="the host CPU has no AVX512-VNNI")
@pytest.mark.parametrize("conv", CONVS, ids=list(CONVS))
def test_a_scheduled_quantized_conv_equals_the_kernel_as_written_on_the_host(conv):
    """Exact on register tiles of 4, 7 and 3 rows (rows per output row of 40 and 7, flat rows
    of 9 x 17), the patch rows built per tile."""
    assert_scheduled_conv_is_exact(CONVS[conv], Int8MatmulVnni(), HOST_NO_AMX)


@pytest.mark.parametrize("conv", DIRECT_CONVS, ids=list(DIRECT_CONVS))
def test_vnni_registers_keep_the_patches_of_a_conv_amx_would_read_directly(conv):
    """Only AMX tile loads read a pixel-major input in place: the register kernel keeps its
    patch matrix, and computes the same conv."""
    done = scheduled(int8_conv_module(DIRECT_CONVS[conv]), Int8MatmulVnni(), VNNI_NO_AMX, kernel=int8_conv_kernel)
    assert 'T.sblock("int8_conv_patches")' in int8_conv_kernel(done)[1].script()


@pytest.mark.skipif(not has_vnni(HOST), reason="the host CPU has no AVX512-VNNI")
@pytest.mark.parametrize("conv", DIRECT_CONVS, ids=list(DIRECT_CONVS))
def test_vnni_computes_a_pixel_major_conv_exactly_on_the_host(conv):
    assert_scheduled_conv_is_exact(DIRECT_CONVS[conv], Int8MatmulVnni(), HOST_NO_AMX)


@pytest.mark.skipif(not has_vnni(HOST), reason="the host CPU has no AVX512-VNNI")
def test_an_rgb_stems_quantized_conv_is_exact_on_registers_on_the_host():
    """Its pixel-major patch runs of 28 bytes read by vpdpbusd register tiles."""
    assert_scheduled_conv_is_exact(RGB_STEM, Int8MatmulVnni(), HOST_NO_AMX)

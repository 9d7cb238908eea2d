"""Int8MatmulAmx: the int8 matmul kernel (frontend/integer_matmul.py) on AMX tiles, built for
named targets (assembly read, never run), run on the host where it has AMX-INT8: the kernel
alone, the whole pipeline against ONNX Runtime bit for bit, and an exported artifact loaded by
plain TVM in a fresh process (the library's constructor asks Linux for the tile state)."""

from __future__ import annotations

import re
import signal

import numpy as np
import onnx
import pytest
import tvm
from helpers import run_python, write_config
from int8_kernels import (CONVS, DIRECT_CONVS, RGB_STEM, assert_scheduled_conv_is_exact, int8_conv_kernel,
                          int8_conv_module, int8_kernel, int8_module, kernel_assembly, scheduled)
from loop_structure import loop_kinds
from machine import host_target
from onnx import helper, numpy_helper
from tvm import relax, te

from tvm_fusion.api import compile_model
from tvm_fusion.kernels.cpu_features import has_amx_int8
from tvm_fusion.schedules.cpu import Int8MatmulAmx, Int8MatmulVnni
from tvm_fusion.schedules.registry import rules_for_kind
from tvm_fusion.targets import export_options, host_cpu_flags
from tvm_fusion.targets.amx import request_amx_permission
from tvm_fusion.verify import reference_outputs

AMX = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
HOST = tvm.target.Target(host_target())
host_amx = pytest.mark.skipif(not {"amx_int8", "amx_tile"} <= host_cpu_flags() or not has_amx_int8(HOST)
                              or not request_amx_permission(),
                              reason="the host CPU has no AMX-INT8 (the VNNI and float paths are tested elsewhere)")


def test_runs_before_the_vnni_rule():
    names = [type(rule).__name__ for rule in rules_for_kind("llvm")]
    assert names.index("Int8MatmulAmx") < names.index("Int8MatmulVnni")


def test_amx_target_uses_tile_instructions():
    mod, _ = int8_module(32, 100, 64)
    done = scheduled(mod, Int8MatmulAmx(), AMX)
    # 2 row tiles of 16 x 1 column tile of 64 (4 C tiles), one AMX call each, across cores
    assert loop_kinds(int8_kernel(done)[1]).parallel == [2]
    assembly = kernel_assembly(done, AMX)
    for instruction in ("sttilecfg", "ldtilecfg", "tileloadd", "tdpbusd", "tilestored"):
        assert instruction in assembly, instruction


@pytest.mark.parametrize("mcpu", ["znver4", "skylake-avx512"])
def test_must_not_apply_without_amx(mcpu):
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    mod, _ = int8_module(32, 64, 32)
    for gvar, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            assert Int8MatmulAmx().apply(func, target, False) is None, gvar.name_hint


def test_must_not_take_a_float_matmul():
    a = te.placeholder((32, 64), name="A")
    b = te.placeholder((64, 32), name="B")
    k = te.reduce_axis((0, 64), name="k")
    c = te.compute((32, 32), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="int8_matmul")
    assert Int8MatmulAmx().apply(te.create_prim_func([a, b, c]), AMX, False) is None


@pytest.mark.parametrize("m", [1, 4], ids=["1", "4"])
def test_leaves_few_rows_to_the_vnni_rule(m):
    """Fewer than MIN_TILE_ROWS rows (M=1, M=4) do not pay on AMX (benchmarks/bench_int8.py):
    the VNNI rule takes them."""
    mod, _ = int8_module(m, 64, 32)
    _, func = int8_kernel(mod)
    assert Int8MatmulAmx().apply(func, AMX, False) is None
    assert Int8MatmulVnni().apply(func, AMX, False) is not None


@pytest.mark.parametrize("m", [(2, 3), (2, 19)], ids=["2x3", "2x19"])
def test_a_batch_of_items_is_one_row_axis_for_the_tiles(m):
    """The import merges static leading axes (frontend/integer_matmul.py): 2 items of 3 or 19
    rows are 6 or 38 rows of one kernel, which the tiles take (38: two tiles of 16 and a tail)."""
    mod, _ = int8_module(m, 64, 32)
    _, func = int8_kernel(mod)
    assert Int8MatmulAmx().apply(func, AMX, False) is not None


def test_a_prime_row_count_runs_tiles_of_16_and_a_tail():
    """197 rows (no divisor from 5 to 16): 12 tiles of 16 rows x 1 of 64 columns, then one tile
    of 5 rows, then the epilogue in one pass across cores."""
    mod, _ = int8_module(197, 64, 64)
    func = int8_kernel(scheduled(mod, Int8MatmulAmx(), AMX))[1]
    assert loop_kinds(func).parallel == [12, 1, 197]
    assembly = kernel_assembly(scheduled(mod, Int8MatmulAmx(), AMX), AMX)
    assert assembly.count("ldtilecfg") >= 2  # one per copy's tile shape


@host_amx
@pytest.mark.parametrize("m, k, n", [(5, 64, 17), (7, 64, 17), (32, 100, 64), (33, 13, 20), (128, 256, 1024),
                                     (16, 1100, 1030), ((2, 16), 13, 20), (48, 4096, 48), (17, 100, 20),
                                     (197, 256, 72), (97, 1100, 1030)])
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_scheduled_kernel_is_exact_on_the_host(m, k, n, dtype):
    """Odd N (padded to 16 columns), K below, at and past 64 (the K tail's tiles), row tiles of
    5, 7, 11 and 16, a batch, a weight over 1 MiB (columns outermost); prime row counts (tiles of
    16 and a tail; 17 and 97: a tail of 1 row, run as 8 + 9)."""
    mod, centered = int8_module(m, k, n, dtype)
    info = np.iinfo(dtype)
    a = np.random.default_rng(1).integers(info.min, int(info.max) + 1, (*(m if isinstance(m, tuple) else (m,)), k))
    a = a.astype(dtype)
    vm = relax.VirtualMachine(tvm.compile(scheduled(mod, Int8MatmulAmx(), HOST), target=HOST), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(a)).numpy()
    expected = (a.astype(np.int64) - 3) @ centered
    np.testing.assert_array_equal(got, expected.astype(np.float32))


def qlinear_matmul(m: int, k: int, n: int, seed: int = 0) -> tuple[onnx.ModelProto, dict]:
    """A QLinearMatMul, uint8 activation, per-channel int8 weight, requantized to uint8."""
    rng = np.random.default_rng(seed)
    b = rng.integers(-128, 128, (k, n), dtype=np.int8)
    inits = [numpy_helper.from_array(np.asarray(v), name) for name, v in [
        ("sa", np.float32(0.0173)), ("za", np.uint8(3)), ("b", b),
        ("sb", rng.uniform(0.002, 0.01, n).astype(np.float32)), ("zb", rng.integers(-5, 5, n).astype(np.int8)),
        ("sy", np.float32(0.0173 * 0.006 * np.sqrt(k) * 300)), ("zy", np.uint8(128))]]
    node = helper.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"], ["y"])
    graph = helper.make_graph([node], "q", [helper.make_tensor_value_info("a", onnx.TensorProto.UINT8, [m, k])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.UINT8, [m, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, {"a": rng.integers(0, 256, (m, k), dtype=np.uint8)}


PLAIN_TVM = """
import sys, numpy as np, tvm
from tvm import relax
vm = relax.VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu())
np.save(sys.argv[3], vm["main"](tvm.runtime.tensor(np.load(sys.argv[2]))).numpy())
"""


@host_amx
def test_artifact_on_amx_equals_onnxruntime_in_a_fresh_process(tmp_path):
    """compile (verified in this process), then model.so loaded by plain TVM in a new
    interpreter that never asked for AMX: the library's constructor does, and its outputs are
    ONNX Runtime's bit for bit."""
    model, feeds = qlinear_matmul(48, 300, 200)
    onnx.save(model, tmp_path / "q.onnx")
    config = write_config(tmp_path / "amx.toml", "default", dims={})
    result = compile_model(tmp_path / "q.onnx", config, ["a:48x300"], output_dir=tmp_path / "build")
    assert "Int8MatmulAmx" in result.metadata["schedule_rules"].values()
    assert {"amx_int8", "amx_tile"} <= set(result.metadata["platform"]["requires_cpu_flags"])
    expected = reference_outputs(model, feeds)["y"]
    assert len(np.unique(expected)) > 50  # a spread: the check means something
    np.save(tmp_path / "a.npy", feeds["a"])
    ran = run_python(PLAIN_TVM, str(result.artifact / "model.so"), str(tmp_path / "a.npy"), str(tmp_path / "y.npy"))
    assert ran.returncode == 0, ran.stderr[-2000:]
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), expected)


@host_amx
def test_only_the_constructor_lets_a_fresh_process_run_the_tiles(tmp_path):
    """The same AMX kernel exported twice: without the constructor, a new interpreter (which
    Linux has not granted the tile state: the grant is cleared on exec) dies of SIGILL at the
    first tile instruction; with it (export_options' addons), it runs."""
    mod, centered = int8_module(32, 64, 32)
    executable = tvm.compile(scheduled(mod, Int8MatmulAmx(), HOST), target=HOST)
    bare, granted = tmp_path / "bare.so", tmp_path / "granted.so"
    executable.export_library(str(bare))
    executable.export_library(str(granted), **export_options("host", host_target()))
    a = np.random.default_rng(3).integers(0, 256, (32, 64)).astype(np.uint8)
    np.save(tmp_path / "a.npy", a)
    died = run_python(PLAIN_TVM, str(bare), str(tmp_path / "a.npy"), str(tmp_path / "bare.npy"))
    assert died.returncode == -signal.SIGILL, died.stderr[-2000:]
    ran = run_python(PLAIN_TVM, str(granted), str(tmp_path / "a.npy"), str(tmp_path / "granted.npy"))
    assert ran.returncode == 0, ran.stderr[-2000:]
    expected = (a.astype(np.int64) - 3) @ centered
    np.testing.assert_array_equal(np.load(tmp_path / "granted.npy"), expected.astype(np.float32))


@pytest.mark.parametrize("conv", CONVS, ids=list(CONVS))
def test_a_quantized_conv_kernel_builds_its_patches_per_tile_of_rows(conv):
    """frontend/int8_conv.py's kernel: the patches under the tile loop that reads them, on
    vectors of a blocked input's 16 channels, from an input converted to bytes once (a 1x1
    conv's patches convert each value they read: no pass of its own)."""
    mod = int8_conv_module(CONVS[conv])
    done = scheduled(mod, Int8MatmulAmx(), AMX, kernel=int8_conv_kernel)
    script = int8_conv_kernel(done)[1].script()
    assert "tdpbusd" in script
    converted_once = CONVS[conv].kernel != (1, 1)
    assert ('T.sblock("int8_conv_input")' in script) == converted_once
    assert script.count("T.parallel") >= 1 + converted_once  # [the converted input,] the tiles
    if conv == "3x3-rows-of-10":
        assert "T.vectorized(T.int64(16))" in script
        # 20 output rows x 4 tiles of 10 rows (K = 288 is no whole number of 64-byte tile rows: 1 x 4 calls)
        rows_loop = script.index("T.parallel(T.int64(80))")
        assert rows_loop < script.index('T.sblock("int8_conv_patches")')
    assert "tdpbusd" in kernel_assembly(done, AMX)


@host_amx
@pytest.mark.parametrize("conv", CONVS, ids=list(CONVS))
def test_a_scheduled_quantized_conv_equals_the_kernel_as_written_on_the_host(conv):
    """Exact: the same int32 sums, converted and requantized alike (rows per output row, a
    batch, flat rows whose tiles straddle output rows, and flat rows padded to whole tiles)."""
    assert_scheduled_conv_is_exact(CONVS[conv], Int8MatmulAmx(), HOST)


@pytest.mark.parametrize("conv", DIRECT_CONVS, ids=list(DIRECT_CONVS))
def test_a_direct_convs_tiles_load_its_converted_input(conv):
    """No patch matrix: every A tile is loaded from the input converted once to bytes, a column
    stride of C bytes between its rows."""
    geometry = DIRECT_CONVS[conv]
    done = scheduled(int8_conv_module(geometry), Int8MatmulAmx(), AMX, kernel=int8_conv_kernel)
    script = int8_conv_kernel(done)[1].script()
    assert "int8_conv_patches" not in script
    loads = re.findall(r'tileloadd64", T\.int8\((\d)\), T\.address_of\((\w+)\[.*?\]\), T\.int64\((\d+)\)', script)
    a_loads = [(buffer, stride) for tile, buffer, stride in loads if buffer != "b"]
    assert a_loads and set(a_loads) == {("int8_conv_input", str(geometry.strides[1] * geometry.channels))}
    assert "tdpbusd" in kernel_assembly(done, AMX)


@host_amx
@pytest.mark.parametrize("conv", DIRECT_CONVS, ids=list(DIRECT_CONVS))
def test_a_direct_conv_equals_the_kernel_as_written_on_the_host(conv):
    assert_scheduled_conv_is_exact(DIRECT_CONVS[conv], Int8MatmulAmx(), HOST)


def test_an_rgb_stems_quantized_conv_takes_the_tiles_on_pixel_major_runs():
    """Its input converted to bytes pixel major (the padding the zero point's byte), each kernel
    row of a patch one run of 28 bytes copied as a vector, the sum on AMX tiles."""
    done = scheduled(int8_conv_module(RGB_STEM), Int8MatmulAmx(), AMX, kernel=int8_conv_kernel)
    script = int8_conv_kernel(done)[1].script()
    assert "int8_conv_input = T.sblock_alloc_buffer((T.int64(1), T.int64(37), T.int64(37), T.int64(4))" in script
    assert "T.vectorized(T.int64(28))" in script and '"tvm_fusion.patch_loops": [7, 28]' in script
    assert "tdpbusd" in kernel_assembly(done, AMX)


@host_amx
def test_an_rgb_stems_quantized_conv_equals_the_kernel_as_written_on_the_host():
    assert_scheduled_conv_is_exact(RGB_STEM, Int8MatmulAmx(), HOST)

"""``profile`` sets an int8 kernel (a uint8 x int8 -> int32 sum: a quantized matmul's or conv's)
against the int8 roof, its integer operations counted: counted as FLOPs only, it showed its
float epilogue's work alone and looked memory-bound, far off a roof it was not set against."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_fusion.commands.profile import kernel_profile, plot, roof_kinds, roof_position
from tvm_fusion.commands.profile.build import ProfiledModule
from tvm_fusion.commands.profile.report import Gap, ProfileReport
from tvm_fusion.commands.profile.timing import Timings
from tvm_fusion.frontend.conv_geometry import ConvGeometry
from tvm_fusion.frontend.int8_conv import emit_int8_conv2d
from tvm_fusion.frontend.integer_matmul import emit_integer_matmul
from tvm_fusion.kernels.costs import kernel_costs
from tvm_fusion.machine_peak import MachinePeak
from tvm_fusion.passes.pipeline import lowering_passes

M, K, N = 64, 256, 64  # K a multiple of 4, N of 16: the kernel is the sum and its conversion alone
PEAK = MachinePeak("llvm-test-2c", 2, gflops=100.0, gbytes_per_s=10.0, l2_gbytes_per_s=50.0, probed_at="-",
                   amx_bf16_gflops=1000.0, amx_int8_gops=5000.0)


def lowered_int8_and_float_matmuls() -> tvm.IRModule:
    """main(a, w) = float32(a @ centered) @ w: the int8 kernel, then a float32 matmul."""
    centered = np.random.default_rng(0).integers(-128, 128, (K, N))
    a = relax.Var("a", relax.TensorType((M, K), "uint8"))
    w = relax.Var("w", relax.TensorType((N, N), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, w]):
        with bb.dataflow():
            total = emit_integer_matmul(bb, a, 0, centered)
            out = bb.emit_output(relax.op.matmul(total, w))
        bb.emit_func_output(out)
    return tvm.transform.Sequential(lowering_passes())(bb.get())


def lowered_int8_conv() -> tvm.IRModule:
    """main(x) = a 1x1 conv of NCHW16c whole numbers through ``int8_conv.py``'s kernel."""
    geometry = ConvGeometry(16, 16, 1, 32, 8, 8, 32, 8, 8, (1, 1), (1, 1), (1, 1), (0, 0))
    weight = np.random.default_rng(0).integers(-128, 128, (geometry.depth, geometry.out_channels)).astype(np.int8)
    x = relax.Var("x", relax.TensorType((1, 2, 8, 8, 16), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(emit_int8_conv2d(bb, x, geometry, weight, 3))
        bb.emit_func_output(out)
    return tvm.transform.Sequential(lowering_passes())(bb.get())


def profile_of(module: tvm.IRModule, name: str, peak: MachinePeak, us: float = 10.0):
    """``name``'s KernelProfile, as ``profile`` makes it, at ``us`` per call alone."""
    profiled = ProfiledModule(None, module, {}, {}, {})
    timings = Timings(1.0, 0.1, {name: us}, {name: us}, {name: 1}, {})
    return kernel_profile(name, module[name], profiled, timings, peak, roof_kinds(module).get(name, "float32"))


def test_the_int8_sums_of_matmuls_and_convs_are_found_and_nothing_else():
    module = lowered_int8_and_float_matmuls()
    (int8,) = [gv.name_hint for gv, _ in module.functions_items() if "int8_matmul" in gv.name_hint]
    assert roof_kinds(module) == {int8: "int8"}  # the float32 matmul beside it is no int8 kernel
    (conv,) = [gv.name_hint for gv, _ in lowered_int8_conv().functions_items() if "int8_conv2d" in gv.name_hint]
    assert roof_kinds(lowered_int8_conv()) == {conv: "int8"}


def test_an_int8_kernel_counts_integer_ops_against_the_amx_int8_roof():
    """2 M N K integer ops (a multiply and an add per product), none of them a FLOP; at 42.7
    ops/byte it is memory-bound under the AMX-INT8 ridge (500), as it would be compute-bound
    under the FMA ridge (10)."""
    module = lowered_int8_and_float_matmuls()
    (name,) = roof_kinds(module)
    assert kernel_costs(module[name])[0] == 0  # what it was counted as before: its float work, none
    kernel = profile_of(module, name, PEAK)
    nbytes = M * K + K * N + M * N * 4  # uint8 activation, packed int8 weight, float32 output
    assert (kernel.flops, kernel.bytes, kernel.roof_kind) == (2 * M * N * K, nbytes, "int8")
    assert (kernel.compute_roof, kernel.compute_roof_gflops) == ("AMX-INT8", 5000.0)
    assert kernel.bound == "AMX-INT8 memory"
    achieved = 2 * M * N * K / 10e-6 / 1e9
    assert kernel.roof_percent == pytest.approx(100 * achieved / (kernel.intensity * PEAK.gbytes_per_s))
    assert 40 < kernel.roof_percent < 60  # not the few % its epilogue's FLOPs alone would show

    (float32,) = [gv.name_hint for gv, _ in module.functions_items() if gv.name_hint == "matmul"]
    assert profile_of(module, float32, PEAK).compute_roof == "FMA"


def test_without_amx_int8_an_int8_kernel_is_set_against_vnni_else_fma():
    """The AVX512-VNNI probe stands in where there are no AMX-INT8 tiles; with neither probed
    (no int8 kernel is built for such a target) the FMA roof, its ops still counted."""
    vnni = dataclasses.replace(PEAK, amx_int8_gops=None, vnni_int8_gops=800.0)
    assert roof_position(vnni, "int8", 5000, 100.0, 400.0, 4.0) == ("AVX512-VNNI", 800.0, "AVX512-VNNI compute", 0.5)
    neither = dataclasses.replace(vnni, vnni_int8_gops=None)
    assert roof_position(neither, "int8", 5000, 50.0, 50.0, 1.0) == ("FMA", 100.0, "compute", 0.5)
    assert neither.compute_roof("bf16") == ("AMX-BF16", 1000.0) and vnni.compute_roof("float32") == ("FMA", 100.0)


def test_a_kind_that_is_not_a_roof_is_refused():
    """A caller still passing the old bf16 flag would otherwise be set against the FMA roof, silently."""
    with pytest.raises(ValueError, match="no compute roof for True"):
        PEAK.compute_roof(True)


def test_the_header_lists_each_probed_dot_product_peak():
    assert PEAK.dot_product_roofs() == ", 1000 GFLOP/s AMX-BF16, 5000 GOP/s AMX-INT8"
    vnni_only = dataclasses.replace(PEAK, amx_bf16_gflops=None, amx_int8_gops=None, vnni_int8_gops=812.4)
    assert vnni_only.dot_product_roofs() == ", 812 GOP/s AVX512-VNNI"
    assert dataclasses.replace(vnni_only, vnni_int8_gops=None).dot_product_roofs() == ""


def test_the_plot_draws_the_int8_roof_in_integer_ops(monkeypatch, tmp_path):
    figures = []
    monkeypatch.setattr(plot, "save_figure", lambda figure, path, *_: figures.append(figure) or path)
    module = lowered_int8_and_float_matmuls()
    (name,) = roof_kinds(module)
    report = ProfileReport("m", 2, PEAK, [profile_of(module, name, PEAK)], Gap(0.1, 0.01, 0.01, 0.05, {}))
    plot.plot_profile(report, tmp_path / "roofline.svg")
    roofline = figures[0].axes[0]
    legend = [text.get_text() for text in roofline.get_legend().get_texts()]
    assert "int8 kernels' roof: 5000 GOP/s AMX-INT8" in legend
    assert "integer ops" in roofline.get_ylabel() and "integer ops" in roofline.get_xlabel()
    assert roofline.get_xlim()[1] > 5000.0 / PEAK.gbytes_per_s  # past the AMX-INT8 ridge

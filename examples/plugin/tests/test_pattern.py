"""The mish pattern: registered through the entry point, fuses both spellings into one
composite, declines a chain whose softplus is used elsewhere, and keeps the numbers."""

import numpy as np
import onnxruntime as ort
from conftest import mish_model, run_optimized

from tvm_fusion import api
from tvm_fusion.patterns import registered_patterns


def test_the_entry_point_registers_mish_after_the_conv_epilogue():
    names = registered_patterns()
    assert names.index("mish") > names.index("conv_epilogue")


def test_both_spellings_fuse_into_one_composite(save):
    for spelling, variant in (("op", "mish.mish"), ("softplus", "mish.mish_stable_softplus")):
        report = api.inspect_model(save(mish_model(spelling))).report
        assert report.fired["mish"] == 1 and report.variants[variant] == 1, (spelling, dict(report.variants))


def test_a_softplus_used_outside_the_chain_is_not_fused(save):
    report = api.inspect_model(save(mish_model("shared"))).report
    assert report.fired["mish"] == 0
    assert any(m.pattern == "mish" and "also used outside" in m.reason for m in report.near_misses)


def test_the_fused_kernel_matches_onnx_runtime(save, wide_input):
    path = save(mish_model("softplus"))
    got, _ = run_optimized(path, wide_input)
    want = ort.InferenceSession(path).run(None, {"x": wide_input})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

"""bench's peers: OpenVINO compiled like-for-like (the bench itself is tested in test_api/test_cli)."""

import numpy as np
from tvm_fusion.commands import peers
from tvm_fusion.verify import reference_outputs


def test_openvino_compiles_f32_latency_unpinned_at_the_given_threads(mlp_path):
    import onnx
    import openvino as ov

    x = np.random.default_rng(0).standard_normal((4, 16)).astype("float32")
    runner = peers.OpenVinoRunner(mlp_path, {"x": x}, threads=1)
    assert runner.compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
    assert str(runner.compiled.get_property("PERFORMANCE_HINT")) == "LATENCY"
    assert runner.compiled.get_property("INFERENCE_NUM_THREADS") == 1
    assert runner.compiled.get_property("ENABLE_CPU_PINNING") is False
    runner.run()
    reference = reference_outputs(onnx.load(mlp_path), {"x": x})
    produced = runner.outputs(reference)
    for name, value in reference.items():
        np.testing.assert_allclose(produced[name], value, rtol=1e-5, atol=1e-5)
    x[:] = 0  # the request reads the caller's array: inputs are set once, not copied per run
    runner.run()
    zeros = reference_outputs(onnx.load(mlp_path), {"x": x})
    assert all(np.allclose(runner.outputs(zeros)[k], v, atol=1e-5) for k, v in zeros.items())


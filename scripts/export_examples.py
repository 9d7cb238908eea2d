#!/usr/bin/env python3
"""Export small randomly initialised transformer and CNN models to ONNX.

Produces real exporter output (``torch.onnx.export``) from standard
Hugging Face architectures and hand-written torchvision-style CNNs so that
tvm_fusion can be exercised on graphs that look like the ones users actually
feed it:

* ``bert_tiny.onnx``  - BERT encoder (erf GELU, eager attention)
* ``gpt2_tiny.onnx``  - GPT-2 decoder (tanh GELU "gelu_new", eager attention)
* ``resnet_tiny.onnx`` - ResNet-style classifier (Conv+BN+ReLU, basic blocks, residual adds)
* ``mobilenetv3_tiny.onnx`` - MobileNetV3-style classifier (depthwise convs, SE blocks,
  HardSwish/HardSigmoid)
* ``dbnet_tiny.onnx`` - DBNet-style OCR text detector (ResNet-ish backbone, FPN neck with
  nearest-upsample top-down adds and a concat of upsampled levels, ConvTranspose head)

Usage (from the repository root)::

    .venv-export/bin/python scripts/export_examples.py [--out examples/models] [--only bert|gpt2|resnet|mobilenet|dbnet]

The export is deterministic: weights come from ``torch.manual_seed(0)``.
Each model is checked with ``onnx.checker`` and compared against torch with
onnxruntime: transformers at (batch=1, sequence=128) and (batch=2, sequence=16),
CNNs at 1x3x224x224, 1x3x48x320 (OCR-style) and 2x3x64x64 (the detector, whose sides must
be multiples of 32, at 1x3x224x224, 1x3x320x320 and 2x3x64x64). The CNNs keep their
BatchNormalization nodes (exported with ``TrainingMode.PRESERVE`` from eval mode,
which skips the exporter's own Conv+BN folding) as many published models do.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers

# transformers >= 4.53 builds attention masks with ops that the TorchScript
# exporter cannot trace (aten::diff for GPT-2 in 5.x, an unordered_map::at
# crash in 4.57), so the export extra pins transformers==4.52.4.
OPSET = 17
VOCAB = 512
MAX_POS = 512  # sequence lengths up to 512: one artifact can serve 1..512 (issue 12)
TOLERANCE = 1e-4
CHECK_SHAPES = [(1, 128), (2, 16)]
EXPORT_SHAPE = (2, 16)


class _LastHidden(torch.nn.Module):
    """Wrap a HF model so forward returns only ``last_hidden_state``."""

    def __init__(self, model: torch.nn.Module, with_mask: bool):
        super().__init__()
        self.model = model
        self.with_mask = with_mask

    def forward(self, input_ids, attention_mask=None):
        if self.with_mask:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        else:
            out = self.model(input_ids=input_ids)
        return out.last_hidden_state


def _seed(seed: int = 0) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _randomize_affine_params(model: torch.nn.Module) -> None:
    """Give biases and LayerNorm scale/shift random values.

    Hugging Face initializes them to exactly 0 and 1, and a graph simplifier then drops the
    zero bias adds and merges identical LayerNorm params: the exported graph would no longer
    exercise bias fusion. Real checkpoints never have such values.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.02)
            elif "ln" in name.lower() or "layernorm" in name.lower():
                param.normal_(1.0, 0.02)


def build_bert() -> _LastHidden:
    _seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=MAX_POS,
        hidden_act="gelu",
        attn_implementation="eager",
    )
    model = transformers.BertModel(config, add_pooling_layer=False)
    _randomize_affine_params(model)
    return _LastHidden(model, with_mask=True).eval()


def build_gpt2() -> _LastHidden:
    _seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=256,
        n_layer=2,
        n_head=4,
        n_positions=MAX_POS,
        use_cache=False,
        attn_implementation="eager",
    )
    model = transformers.GPT2Model(config)
    _randomize_affine_params(model)
    return _LastHidden(model, with_mask=False).eval()


def _randomize_batch_norm(model: torch.nn.Module) -> None:
    """Random running stats and affine params: fresh BN layers are identities (mean 0, var 1,
    scale 1, shift 0), and folding an identity would prove nothing."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_(0.0, 0.1)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.normal_(1.0, 0.1)
                module.bias.normal_(0.0, 0.1)


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1,
             activation: type[torch.nn.Module] | None = torch.nn.ReLU) -> torch.nn.Sequential:
    layers = [torch.nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
              torch.nn.BatchNorm2d(cout)]
    if activation is not None:
        layers.append(activation())
    return torch.nn.Sequential(*layers)


class _BasicBlock(torch.nn.Module):
    """torchvision's ResNet BasicBlock: two 3x3 Conv+BN, a 1x1 Conv+BN shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = torch.nn.Sequential(_conv_bn(cin, cout, 3, stride), _conv_bn(cout, cout, 3, activation=None))
        self.shortcut = (_conv_bn(cin, cout, 1, stride, activation=None)
                         if stride != 1 or cin != cout else torch.nn.Identity())
        self.relu = torch.nn.ReLU()

    def forward(self, x):
        return self.relu(self.body(x) + self.shortcut(x))


class ResNetTiny(torch.nn.Module):
    """A ResNet-18-shaped network at 16-96 channels: stem, max pool, four stages, pool, classifier."""

    def __init__(self, widths=(16, 32, 64, 96), classes: int = 10):
        super().__init__()
        self.stem = _conv_bn(3, widths[0], 3, stride=2)
        self.pool = torch.nn.MaxPool2d(3, 2, 1)
        stages, cin = [], widths[0]
        for index, width in enumerate(widths):
            stride = 1 if index == 0 else 2
            stages += [_BasicBlock(cin, width, stride), _BasicBlock(width, width, 1)]
            cin = width
        self.stages = torch.nn.Sequential(*stages)
        self.head = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                        torch.nn.Linear(cin, classes))

    def forward(self, x):
        return self.head(self.stages(self.pool(self.stem(x))))


class _SqueezeExcitation(torch.nn.Module):
    """torchvision's SE block: pool, 1x1 conv, ReLU, 1x1 conv, HardSigmoid, rescale the input."""

    def __init__(self, channels: int, squeezed: int):
        super().__init__()
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc1 = torch.nn.Conv2d(channels, squeezed, 1)
        self.relu = torch.nn.ReLU()
        self.fc2 = torch.nn.Conv2d(squeezed, channels, 1)
        self.gate = torch.nn.Hardsigmoid()

    def forward(self, x):
        return x * self.gate(self.fc2(self.relu(self.fc1(self.pool(x)))))


class _InvertedResidual(torch.nn.Module):
    """MobileNetV3 block: 1x1 expand, depthwise kxk, optional SE, 1x1 project, residual if shapes match."""

    def __init__(self, cin, kernel, expanded, cout, use_se, activation, stride):
        super().__init__()
        layers = []
        if expanded != cin:
            layers.append(_conv_bn(cin, expanded, 1, activation=activation))
        layers.append(_conv_bn(expanded, expanded, kernel, stride, groups=expanded, activation=activation))
        if use_se:
            layers.append(_SqueezeExcitation(expanded, max(8, (expanded // 4 + 4) // 8 * 8)))
        layers.append(_conv_bn(expanded, cout, 1, activation=None))
        self.block = torch.nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        out = self.block(x)
        return out + x if self.residual else out


# kernel, expanded channels, output channels, SE, activation, stride (MobileNetV3-Small, narrowed)
_MOBILENET_BLOCKS = [
    (3, 16, 16, True, torch.nn.ReLU, 2),
    (3, 64, 24, False, torch.nn.ReLU, 2),
    (3, 88, 24, False, torch.nn.ReLU, 1),
    (5, 96, 40, True, torch.nn.Hardswish, 2),
    (5, 96, 40, True, torch.nn.Hardswish, 1),
    (5, 96, 48, True, torch.nn.Hardswish, 1),
    (5, 96, 64, True, torch.nn.Hardswish, 2),
    (5, 96, 64, True, torch.nn.Hardswish, 1),
]


class MobileNetV3Tiny(torch.nn.Module):
    """A MobileNetV3-Small-shaped network: HardSwish stem, inverted residuals with SE, classifier."""

    def __init__(self, classes: int = 10):
        super().__init__()
        layers, cin = [_conv_bn(3, 16, 3, stride=2, activation=torch.nn.Hardswish)], 16
        for kernel, expanded, cout, use_se, activation, stride in _MOBILENET_BLOCKS:
            layers.append(_InvertedResidual(cin, kernel, expanded, cout, use_se, activation, stride))
            cin = cout
        layers.append(_conv_bn(cin, 96, 1, activation=torch.nn.Hardswish))
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                        torch.nn.Linear(96, 128), torch.nn.Hardswish(),
                                        torch.nn.Linear(128, classes))

    def forward(self, x):
        return self.head(self.features(x))


class _FeaturePyramid(torch.nn.Module):
    """DBNet's FPN neck: 1x1 lateral convs, top-down nearest 2x upsample + add, a 3x3 conv per
    level, every level upsampled to 1/4 and concatenated along channels."""

    def __init__(self, widths, inner: int):
        super().__init__()
        self.lateral = torch.nn.ModuleList(torch.nn.Conv2d(w, inner, 1, bias=False) for w in widths)
        self.smooth = torch.nn.ModuleList(torch.nn.Conv2d(inner, inner // 4, 3, padding=1, bias=False)
                                          for _ in widths)

    def forward(self, features):
        laterals = [conv(f) for conv, f in zip(self.lateral, features)]
        merged = [laterals[-1]]
        for lateral in reversed(laterals[:-1]):
            merged.insert(0, lateral + torch.nn.functional.interpolate(merged[0], scale_factor=2,
                                                                       mode="nearest"))
        levels = [conv(m) for conv, m in zip(self.smooth, merged)]
        levels = [levels[0]] + [torch.nn.functional.interpolate(level, scale_factor=2 ** i, mode="nearest")
                                for i, level in enumerate(levels[1:], start=1)]
        return torch.cat(levels[::-1], dim=1)


class DBNetTiny(torch.nn.Module):
    """A DBNet-shaped text detector: stem, four stride-2 stages (1/4..1/32), FPN neck, and the
    probability head (Conv+BN+ReLU, two 2x ConvTranspose back to full size, Sigmoid)."""

    def __init__(self, widths=(16, 24, 32, 48), inner: int = 32):
        super().__init__()
        self.stem = _conv_bn(3, widths[0], 3, stride=2)
        stages, cin = [], widths[0]
        for width in widths:
            stages.append(_BasicBlock(cin, width, 2))
            cin = width
        self.stages = torch.nn.ModuleList(stages)
        self.neck = _FeaturePyramid(widths, inner)
        quarter = inner // 4
        self.head = torch.nn.Sequential(
            _conv_bn(inner, quarter, 3),
            torch.nn.ConvTranspose2d(quarter, quarter, 2, 2, bias=False), torch.nn.BatchNorm2d(quarter),
            torch.nn.ReLU(),
            torch.nn.ConvTranspose2d(quarter, 1, 2, 2), torch.nn.Sigmoid())

    def forward(self, x):
        features, x = [], self.stem(x)
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        return self.head(self.neck(features))


def build_resnet() -> torch.nn.Module:
    _seed(0)
    model = ResNetTiny()
    _randomize_batch_norm(model)
    return model.eval()


def build_mobilenet() -> torch.nn.Module:
    _seed(0)
    model = MobileNetV3Tiny()
    _randomize_batch_norm(model)
    return model.eval()


def build_dbnet() -> torch.nn.Module:
    _seed(0)
    model = DBNetTiny()
    _randomize_batch_norm(model)
    return model.eval()


MODELS = {
    "bert": ("bert_tiny.onnx", build_bert, ["input_ids", "attention_mask"]),
    "gpt2": ("gpt2_tiny.onnx", build_gpt2, ["input_ids"]),
    "resnet": ("resnet_tiny.onnx", build_resnet, ["input"]),
    "mobilenet": ("mobilenetv3_tiny.onnx", build_mobilenet, ["input"]),
    "dbnet": ("dbnet_tiny.onnx", build_dbnet, ["input"]),
}
CNN_MODELS = {"resnet", "mobilenet", "dbnet"}
DETECTOR_MODELS = {"dbnet"}
CNN_EXPORT_SHAPE = (1, 3, 64, 64)
CNN_CHECK_SHAPES = [(1, 3, 224, 224), (1, 3, 48, 320), (2, 3, 64, 64)]
# A detector's sides must be multiples of its 1/32 stride; 320x320 is a common OCR size.
DETECTOR_CHECK_SHAPES = [(1, 3, 224, 224), (1, 3, 320, 320), (2, 3, 64, 64)]


def _make_image(shape, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + sum(shape))
    return {"input": torch.randn(*shape, generator=g)}


def _io_spec(key: str):
    """Output name, dynamic axes, export feeds and check feeds of one example."""
    if key in DETECTOR_MODELS:
        axes = {"input": {0: "batch", 2: "height", 3: "width"},
                "probability": {0: "batch", 2: "height", 3: "width"}}
        return ("probability", axes, _make_image(CNN_EXPORT_SHAPE),
                [_make_image(s) for s in DETECTOR_CHECK_SHAPES])
    if key in CNN_MODELS:
        axes = {"input": {0: "batch", 2: "height", 3: "width"}, "logits": {0: "batch"}}
        return "logits", axes, _make_image(CNN_EXPORT_SHAPE), [_make_image(s) for s in CNN_CHECK_SHAPES]
    input_names = MODELS[key][2]
    axes = {n: {0: "batch", 1: "sequence"} for n in input_names}
    axes["last_hidden_state"] = {0: "batch", 1: "sequence"}
    return ("last_hidden_state", axes, _make_inputs(input_names, *EXPORT_SHAPE),
            [_make_inputs(input_names, *shape) for shape in CHECK_SHAPES])


def _make_inputs(names, batch, seq, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + batch * 100 + seq)
    feeds = {"input_ids": torch.randint(0, VOCAB, (batch, seq), generator=g, dtype=torch.int64)}
    if "attention_mask" in names:
        mask = torch.ones(batch, seq, dtype=torch.int64)
        if seq > 4:
            # pad the tail of the last sequence so the mask actually matters
            mask[-1, seq - seq // 4:] = 0
        feeds["attention_mask"] = mask
    return feeds


def export_one(key: str, out_dir: str) -> str:
    filename, builder, input_names = MODELS[key]
    module = builder()
    path = os.path.join(out_dir, filename)
    output_name, dynamic_axes, export_feeds, _ = _io_spec(key)
    args = tuple(export_feeds.values())

    fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                args,
                tmp,
                input_names=input_names,
                output_names=[output_name],
                opset_version=OPSET,
                dynamic_axes=dynamic_axes,
                do_constant_folding=True,
                # EVAL would fold BatchNormalization into the convs; keep it for our pass.
                training=torch.onnx.TrainingMode.PRESERVE,
                dynamo=False,
            )
        # Re-save as one self-contained file (weights inline) with a stable
        # producer string so repeated runs give identical bytes.
        model = onnx.load(tmp)
        # The TorchScript exporter loses the static hidden size of GPT-2's
        # output (it names it e.g. "Reshapelast_hidden_state_dim_2"); restore
        # every non-dynamic output dim from the traced torch output (dims past
        # the second that dynamic_axes does not name, so a detector's height and
        # width stay symbolic).  Only the graph output's type annotation changes,
        # never a node.
        with torch.no_grad():
            ref_shape = module(*args).shape
        dims = model.graph.output[0].type.tensor_type.shape.dim
        for index, (d, size) in enumerate(zip(dims, ref_shape)):
            if index < 2 or index in dynamic_axes[output_name]:
                continue
            d.Clear()
            d.dim_value = int(size)
        model.producer_name = "pytorch"
        model.producer_version = torch.__version__
        model.doc_string = (
            f"tvm_fusion example: {key} random init seed 0, "
            + ("hand-written torchvision-style modules" if key in CNN_MODELS
               else f"transformers {transformers.__version__}")
            + f", opset {OPSET}"
        )
        onnx.save(model, tmp, save_as_external_data=False)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _dims(vi):
    return [d.dim_param if d.HasField("dim_param") else d.dim_value
            for d in vi.type.tensor_type.shape.dim]


def verify_one(key: str, path: str) -> float:
    _, builder, _ = MODELS[key]
    output_name, _, _, check_feeds = _io_spec(key)
    onnx.checker.check_model(path, full_check=True)
    model = onnx.load(path)
    print(f"== {os.path.basename(path)}: {os.path.getsize(path)} bytes, "
          f"opset {model.opset_import[0].version}, {len(model.graph.node)} nodes")
    for vi in model.graph.input:
        print(f"   input  {vi.name}: {onnx.TensorProto.DataType.Name(vi.type.tensor_type.elem_type)} {_dims(vi)}")
    for vi in model.graph.output:
        print(f"   output {vi.name}: {onnx.TensorProto.DataType.Name(vi.type.tensor_type.elem_type)} {_dims(vi)}")
    hist = collections.Counter(n.op_type for n in model.graph.node)
    print("   ops:", dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))))

    module = builder()
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    worst = 0.0
    for feeds in check_feeds:
        with torch.no_grad():
            ref = module(*feeds.values()).numpy()
        got = sess.run([output_name], {k: v.numpy() for k, v in feeds.items()})[0]
        if got.shape != ref.shape:
            raise SystemExit(f"{key}: shape mismatch {got.shape} vs {ref.shape}")
        diff = float(np.max(np.abs(got - ref)))
        worst = max(worst, diff)
        at = ", ".join(f"{k}={'x'.join(map(str, v.shape))}" for k, v in feeds.items())
        print(f"   ort vs torch at {at}: shape {tuple(got.shape)}, max abs diff {diff:.3e}")
        if not diff <= TOLERANCE:
            raise SystemExit(f"{key}: ORT/torch mismatch {diff} > {TOLERANCE}")
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="examples/models", help="output folder")
    ap.add_argument("--only", choices=sorted(MODELS), help="export only this model")
    ns = ap.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    os.makedirs(ns.out, exist_ok=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"onnx {onnx.__version__}, onnxruntime {ort.__version__}; exporter: TorchScript (dynamo=False), opset {OPSET}")
    keys = [ns.only] if ns.only else list(MODELS)
    for key in keys:
        path = export_one(key, ns.out)
        verify_one(key, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

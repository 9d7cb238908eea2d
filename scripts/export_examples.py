#!/usr/bin/env python3
"""Export small randomly initialised transformer models to ONNX.

Produces real exporter output (``torch.onnx.export``) from standard
Hugging Face architectures so that tvm_fusion can be exercised on graphs
that look like the ones users actually feed it:

* ``bert_tiny.onnx``  - BERT encoder (erf GELU, eager attention)
* ``gpt2_tiny.onnx``  - GPT-2 decoder (tanh GELU "gelu_new", eager attention)

Usage (from the repository root)::

    .venv-export/bin/python scripts/export_examples.py [--out examples/models] [--only bert|gpt2]

The export is deterministic: weights come from ``torch.manual_seed(0)``.
Each model is checked with ``onnx.checker`` and compared against torch with
onnxruntime at (batch=1, sequence=128) and (batch=2, sequence=16).
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
MAX_POS = 128
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


MODELS = {
    "bert": ("bert_tiny.onnx", build_bert, ["input_ids", "attention_mask"]),
    "gpt2": ("gpt2_tiny.onnx", build_gpt2, ["input_ids"]),
}


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
    args = tuple(_make_inputs(input_names, *EXPORT_SHAPE).values())
    dynamic_axes = {n: {0: "batch", 1: "sequence"} for n in input_names}
    dynamic_axes["last_hidden_state"] = {0: "batch", 1: "sequence"}

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
                output_names=["last_hidden_state"],
                opset_version=OPSET,
                dynamic_axes=dynamic_axes,
                do_constant_folding=True,
                dynamo=False,
            )
        # Re-save as one self-contained file (weights inline) with a stable
        # producer string so repeated runs give identical bytes.
        model = onnx.load(tmp)
        # The TorchScript exporter loses the static hidden size of GPT-2's
        # output (it names it e.g. "Reshapelast_hidden_state_dim_2"); restore
        # every non-dynamic output dim from the traced torch output.  Only the
        # graph output's type annotation changes, never a node.
        with torch.no_grad():
            ref_shape = module(*args).shape
        for d, size in zip(model.graph.output[0].type.tensor_type.shape.dim[2:], ref_shape[2:]):
            d.Clear()
            d.dim_value = int(size)
        model.producer_name = "pytorch"
        model.producer_version = torch.__version__
        model.doc_string = (
            f"tvm_fusion example: {key} random init seed 0, "
            f"transformers {transformers.__version__}, opset {OPSET}"
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
    _, builder, input_names = MODELS[key]
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
    for batch, seq in CHECK_SHAPES:
        feeds = _make_inputs(input_names, batch, seq)
        with torch.no_grad():
            ref = module(*feeds.values()).numpy()
        got = sess.run(["last_hidden_state"], {k: v.numpy() for k, v in feeds.items()})[0]
        if got.shape != ref.shape:
            raise SystemExit(f"{key}: shape mismatch {got.shape} vs {ref.shape}")
        diff = float(np.max(np.abs(got - ref)))
        worst = max(worst, diff)
        print(f"   ort vs torch at batch={batch} sequence={seq}: shape {tuple(got.shape)}, max abs diff {diff:.3e}")
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

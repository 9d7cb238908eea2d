#!/usr/bin/env python3
"""Export the tiny transformer blocks under tests/data/ that the normalization tests run on.

Real ``torch.onnx.export`` output (TorchScript exporter, as scripts/export_examples.py), so
the fusions are tested on the graphs exporters write, at a size that keeps tests fast
(hidden 32, one layer, a few KB of weights each):

* ``bert_block_opset14.onnx``  BERT layer at opset 14: LayerNorm decomposed by the exporter
  (ReduceMean, Sub, Pow, ReduceMean, Add eps, Sqrt, Div, Mul gamma, Add beta)
* ``gpt2_block_opset14.onnx``  GPT-2 layer at opset 14 (pre-norm: the residual sum is reused)
* ``gpt2_block_opset17.onnx``  the same GPT-2 layer at opset 17 (ONNX LayerNormalization op)
* ``llama_block.onnx``         Llama layer (RMSNorm: Pow, ReduceMean, Add, Sqrt, Div, Mul)
* ``dbnet_head_block.onnx``    DBNet's probability head at opset 17 (Conv 3x3 + BN + ReLU ->
  ConvTranspose 2x2/2 + BN + ReLU -> ConvTranspose 2x2/2 + Sigmoid), static 1x16x8x8 input;
  the exporter folds the Conv's BN itself and leaves the ConvTranspose's

Usage (from the repository root; needs the ``export`` extra, see the README)::

    .venv-export/bin/python scripts/export_test_blocks.py [--out tests/data]

Weights come from ``torch.manual_seed(0)``; each file is checked with ``onnx.checker`` and
compared with torch through onnxruntime, and written atomically.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers

VOCAB = 64
HIDDEN = 32
MAX_POS = 32
EXPORT_SHAPE = (1, 8)
TOLERANCE = 1e-4


class LastHidden(torch.nn.Module):
    """Return only ``last_hidden_state`` so the ONNX graph has one output."""

    def __init__(self, model: torch.nn.Module, with_mask: bool):
        super().__init__()
        self.model = model
        self.with_mask = with_mask

    def forward(self, input_ids, attention_mask=None):
        kwargs = {"attention_mask": attention_mask} if self.with_mask else {}
        return self.model(input_ids=input_ids, **kwargs).last_hidden_state


def randomize_affine_params(model: torch.nn.Module) -> None:
    """Biases and norm weights away from 0 and 1, so that no simplifier drops them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.02)
            elif "norm" in name.lower() or "ln" in name.lower():
                param.normal_(1.0, 0.02)


def bert() -> LastHidden:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=2 * HIDDEN,
                                     max_position_embeddings=MAX_POS, attn_implementation="eager")
    return LastHidden(transformers.BertModel(config, add_pooling_layer=False), with_mask=True)


def gpt2() -> LastHidden:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=2,
                                     n_positions=MAX_POS, use_cache=False, attn_implementation="eager")
    return LastHidden(transformers.GPT2Model(config), with_mask=False)


def llama() -> LastHidden:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2,
                                      intermediate_size=2 * HIDDEN, max_position_embeddings=MAX_POS,
                                      use_cache=False, attn_implementation="eager")
    return LastHidden(transformers.LlamaModel(config), with_mask=False)


class DbnetHead(torch.nn.Sequential):
    """DBNet's binarize head (inner channels 16): upsamples a 1/4 map to a full-size probability."""

    def __init__(self, channels: int = 16):
        quarter = channels // 2
        super().__init__(
            torch.nn.Conv2d(channels, quarter, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(quarter), torch.nn.ReLU(),
            torch.nn.ConvTranspose2d(quarter, quarter, 2, stride=2),
            torch.nn.BatchNorm2d(quarter), torch.nn.ReLU(),
            torch.nn.ConvTranspose2d(quarter, 1, 2, stride=2), torch.nn.Sigmoid())


def randomize_batch_norm_stats(model: torch.nn.Module) -> None:
    """Running statistics away from (0, 1), so that folding them is not a no-op."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_(0.0, 0.2)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)


BLOCKS = {
    "bert_block_opset14": (bert, 14),
    "gpt2_block_opset14": (gpt2, 14),
    "gpt2_block_opset17": (gpt2, 17),
    "llama_block": (llama, 14),
}
# Image blocks: one static NCHW input, exported as is (no dynamic axes).
IMAGE_BLOCKS = {
    "dbnet_head_block": (DbnetHead, 17, (1, 16, 8, 8)),
}


def export(name: str, out_dir: str) -> None:
    build, opset = BLOCKS[name]
    torch.manual_seed(0)
    model = build()
    randomize_affine_params(model)
    model.eval()
    ids = torch.randint(0, VOCAB, EXPORT_SHAPE)
    args, names = (ids,), ["input_ids"]
    if model.with_mask:
        args, names = (ids, torch.ones_like(ids)), ["input_ids", "attention_mask"]
    dynamic = {n: {0: "batch", 1: "sequence"} for n in names}
    dynamic["last_hidden_state"] = {0: "batch", 1: "sequence"}
    write_checked(model, args, names, "last_hidden_state", dynamic, opset,
                  os.path.join(out_dir, f"{name}.onnx"))


def export_image_block(name: str, out_dir: str) -> None:
    build, opset, shape = IMAGE_BLOCKS[name]
    torch.manual_seed(0)
    model = build()
    randomize_batch_norm_stats(model)
    model.eval()
    write_checked(model, (torch.randn(shape),), ["input"], "output", None, opset,
                  os.path.join(out_dir, f"{name}.onnx"))


def write_checked(model, args, names, output, dynamic, opset: int, final: str) -> None:
    """Export, check with onnx.checker and against torch through onnxruntime, then move into place."""
    out_dir = os.path.dirname(final)
    fd, staging = tempfile.mkstemp(suffix=".onnx", dir=out_dir)
    os.close(fd)
    try:
        torch.onnx.export(model, args, staging, input_names=names, output_names=[output],
                          dynamic_axes=dynamic, opset_version=opset, dynamo=False, do_constant_folding=True)
        onnx.checker.check_model(onnx.load(staging))
        session = ort.InferenceSession(staging, providers=["CPUExecutionProvider"])
        with torch.no_grad():
            expected = model(*args).numpy()
        (got,) = session.run(None, {n: a.numpy() for n, a in zip(names, args)})
        error = float(np.abs(got - expected).max())
        if error > TOLERANCE:
            raise SystemExit(f"{final}: onnxruntime differs from torch by {error}")
        os.chmod(staging, 0o644)  # mkstemp creates it private
        os.replace(staging, final)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    ops = collections.Counter(node.op_type for node in onnx.load(final).graph.node)
    print(f"{final}: opset {opset}, {os.path.getsize(final)} bytes, max |ort - torch| {error:.1e}")
    print("  " + ", ".join(f"{op} {count}" for op, count in sorted(ops.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/data")
    parser.add_argument("--only", choices=sorted({**BLOCKS, **IMAGE_BLOCKS}), action="append")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in args.only or [*BLOCKS, *IMAGE_BLOCKS]:
        if name in IMAGE_BLOCKS:
            export_image_block(name, args.out)
        else:
            export(name, args.out)


if __name__ == "__main__":
    main()

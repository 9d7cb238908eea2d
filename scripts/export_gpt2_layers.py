#!/usr/bin/env python3
"""Export GPT-2 at its real width with a few layers, randomly initialised, with torch's dynamo
exporter: the weights (214 MB at 2 layers, mostly the 50257-token embedding) go to an external
data file beside the model, as that exporter writes large models. It is the compile-memory
benchmark's model (``benchmarks/bench_compile_memory.py``): too large to ship, made on demand.

Usage (the export environment of examples/models/README.md)::

    .venv-export/bin/python scripts/export_gpt2_layers.py [--layers 2] [--out /tmp/gpt2_2layer.onnx]
"""

from __future__ import annotations

import argparse

import torch
import transformers


class LastHidden(torch.nn.Module):
    """The decoder's last hidden state: one output, no cache."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).last_hidden_state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default="/tmp/gpt2_2layer.onnx")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, use_cache=False, attn_implementation="eager")
    model = LastHidden(transformers.GPT2Model(config).eval())
    ids = torch.randint(0, config.vocab_size, (1, 16))
    torch.onnx.export(model, (ids,), args.out, input_names=["input_ids"], output_names=["hidden"],
                      opset_version=18, dynamo=True)
    print(f"wrote {args.out} (compile it with --input-shape input_ids:1x16)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

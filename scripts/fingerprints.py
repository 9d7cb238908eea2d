#!/usr/bin/env python3
"""Behaviour fingerprints: per bundled example and cached zoo model, the structural hashes of
the fused graph and of the scheduled module, the fusions fired (by pattern and variant) and
the schedule rule of each kernel. A refactor that should change nothing must leave them equal.

Usage (from the repository root)::

    .venv/bin/python scripts/fingerprints.py build/fingerprints.json [--only NAME ...]
    .venv/bin/python scripts/fingerprints.py build/after.json --compare build/before.json

Hand schedules only (no tuning records), so the result does not depend on the tuning store.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TVM_FUSION_TUNING_LOGS", str(ROOT / "build" / "no-tuning-logs"))

import tvm_ffi  # noqa: E402

from tvm_fusion.commands import zoo  # noqa: E402
from tvm_fusion.report import write_json  # noqa: E402
from tvm_fusion.session import ModelSession  # noqa: E402

# The CNN examples have free spatial dims: fingerprint them at one small size.
EXAMPLE_SHAPES = {name: ["input:1x3x96x96"] for name in ("dbnet_tiny", "mobilenetv3_tiny", "resnet_tiny")}


def models():
    """(name, path, config, input shapes) of the examples and of the zoo models in the cache."""
    for path in sorted((ROOT / "examples" / "models").glob("*.onnx")):
        yield path.stem, path, None, EXAMPLE_SHAPES.get(path.stem)
    for name, model in zoo.load_manifest().items():
        if zoo.model_path(name).exists():
            yield name, zoo.model_path(name), model.config(), list(model.input_shapes)


def fingerprint(path, config, shapes) -> dict:
    session = ModelSession(path, shapes)
    prepared = session.prepared(config)
    fused = session.fused(prepared)
    scheduled = session.scheduled(prepared.config, tuning_log=False)
    return {"fused_hash": str(tvm_ffi.structural_hash(fused.module)),
            "scheduled_hash": str(tvm_ffi.structural_hash(scheduled.module)),
            "fired": dict(scheduled.report.fired), "variants": dict(scheduled.report.variants),
            "rules": dict(sorted(scheduled.schedule_rules.items()))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument("--compare", help="an earlier fingerprints file: exit 1 when any model differs")
    args = parser.parse_args()
    results = {}
    for name, path, config, shapes in models():
        if args.only and name not in args.only:
            continue
        results[name] = fingerprint(path, config, shapes)
        print(name, results[name]["fused_hash"], results[name]["scheduled_hash"], flush=True)
        write_json(args.out, results)
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    differ = 0
    for name, now in results.items():
        then = before.get(name)
        keys = [key for key in now if then is None or then.get(key) != now[key]]
        print(f"{name}: {'same' if not keys else 'DIFFERS in ' + ', '.join(keys)}")
        differ += bool(keys)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

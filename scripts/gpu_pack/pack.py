"""Write a GPU-check pack: one folder that runs on a machine with no TVM (`scripts/gpu_check.sh --pack`).

    .venv/bin/python scripts/gpu_pack/pack.py --out DIR [--config cuda-sm90] [--model M.onnx:SHAPES]...

The folder holds, per model, the artifact built for the config (model.so, metadata.json), its
inputs (raw arrays), ONNX Runtime's float32 outputs for them (.npy) and the weights of its torch
module (.npz); the TVM runtime libraries from the installed wheels (libtvm_runtime, tvm-ffi, and
for CUDA libtvm_runtime_cuda and the CUDA runtime it links); bin/runner, the C++ runner built
here against them (and its source with tvm-ffi's headers, so run.sh can rebuild it); run.sh,
run.py, torch_models.py and manifest.json. It is written beside DIR and renamed into place only
when it is complete and within --max-mib; a pack over the limit is refused (exit status 3).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import tvm
import tvm_ffi.libinfo

from tvm_fusion import api
from tvm_fusion.frontend.onnx import TensorSpec, random_inputs
from tvm_fusion.verify import reference_outputs

sys.path.insert(0, str(Path(__file__).resolve().parent))
import weights  # noqa: E402  (beside this file, not a package)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MIB = 1 << 20
TRANSFORMER = "input_ids:1x128,attention_mask:1x128"
CNN = "input:1x3x224x224"
# The bundled transformers and two CNNs, at the sizes the configs default to.
DEFAULT_MODELS = [f"examples/models/bert_tiny.onnx:{TRANSFORMER}", "examples/models/gpt2_tiny.onnx:input_ids:1x128",
                  f"examples/models/resnet_tiny.onnx:{CNN}", f"examples/models/mobilenetv3_tiny.onnx:{CNN}"]
TORCH_MODULES = {"bert_tiny", "gpt2_tiny", "resnet_tiny", "mobilenetv3_tiny"}  # torch_models.MODULES
RUN_FILES = ("run.sh", "run.py", "torch_models.py")
DEVICE_RUN_MIB = 64  # a device run sends the checkout and the carried paths, at most this much


class PackError(Exception):
    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def parse_model(text: str) -> tuple[Path, list[str]]:
    """``path.onnx[:NAME:DIMxDIM,NAME:DIMxDIM]`` -> (path, --input-shape values)."""
    path, _, shapes = text.partition(".onnx")
    shapes = shapes.lstrip(":")
    return Path(path + ".onnx"), [s for s in shapes.split(",") if s]


def runtime_libraries(cuda: bool) -> list[Path]:
    """The wheel's runtime libraries the runner needs; for CUDA also the CUDA runtime that
    libtvm_runtime_cuda.so links (the GPU machine's driver provides libcuda.so.1)."""
    tvm_lib = Path(tvm.__file__).resolve().parent / "lib"
    found = [tvm_lib / "libtvm_runtime.so", Path(tvm_ffi.libinfo.find_libtvm_ffi()).resolve()]
    if cuda:
        found.append(tvm_lib / "libtvm_runtime_cuda.so")
        found.append(_linked_library(found[-1], "libcudart.so"))
    return found


def _linked_library(library: Path, prefix: str) -> Path:
    done = subprocess.run(["ldd", str(library)], capture_output=True, text=True, check=True)
    for line in done.stdout.splitlines():
        name, _, where = line.strip().partition(" => ")
        if name.startswith(prefix) and where and not where.startswith("not found"):
            return Path(where.split(" (")[0]).resolve()
    raise PackError(f"{library.name} links {prefix}*, which is not installed here: install the CUDA "
                    "runtime (the CUDA toolkit, or pip's nvidia-cuda-runtime) and pack again")


def build_runner(stage: Path) -> None:
    """bin/runner against lib/ (rpath $ORIGIN/../lib), and its source for a rebuild on the GPU machine."""
    (stage / "bin").mkdir()
    (stage / "src").mkdir()
    shutil.copy2(HERE / "runner.cc", stage / "src" / "runner.cc")
    shutil.copytree(tvm_ffi.libinfo.find_include_path(), stage / "src" / "include")
    command = ["g++", "-O2", "-std=c++17", "-I", str(stage / "src" / "include"), str(HERE / "runner.cc"),
               "-o", str(stage / "bin" / "runner"), "-L", str(stage / "lib"), "-Wl,--no-as-needed",
               "-ltvm_runtime", "-ltvm_ffi", "-Wl,--as-needed", "-ldl", "-Wl,-rpath,$ORIGIN/../lib"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise PackError(f"building the runner failed:\n{done.stderr[-3000:]}")


def pack_model(model_path: Path, shapes: list[str], config, stage: Path, build_dir: Path, torch_dtype: str,
               say) -> dict:
    name = model_path.stem
    say(f"{name}: compiling for {config.name}")
    input_shapes: api.ShapeArg = list(shapes) or None
    (result,) = api.compile_targets(model_path, [config], input_shapes, build_dir, verify=False,
                                    progress=lambda m: None, fusion_gate=False)
    if result.error is not None or result.artifact is None:
        raise PackError(f"{name}: {result.error.message if result.error else 'no artifact'}")
    folder = stage / "models" / name
    folder.mkdir(parents=True)
    for file in ("model.so", "metadata.json"):
        shutil.copy2(Path(result.artifact) / file, folder / file)
    meta = result.metadata
    model = onnx.load(str(model_path))
    specs = [TensorSpec(s["name"], tuple(s["shape"]), s["dtype"]) for s in meta["inputs"]]
    inputs = random_inputs(model, specs, seed=config.seed)
    entry: dict = {"name": name, "artifact": f"models/{name}/model.so", "rtol": config.rtol, "atol": config.atol,
                   "inputs": [], "outputs": [], "kernels": meta.get("kernels"), "device_code": meta.get("device_code")}
    for spec in meta["inputs"]:
        file = f"models/{name}/input.{spec['name']}.bin"
        np.ascontiguousarray(inputs[spec["name"]]).tofile(stage / file)
        entry["inputs"].append({"name": spec["name"], "dtype": spec["dtype"], "shape": spec["shape"], "file": file})
    say(f"{name}: ONNX Runtime reference")
    references = reference_outputs(model, inputs)
    for spec in meta["outputs"]:
        file = f"models/{name}/reference.{spec['name']}.npy"
        np.save(stage / file, np.asarray(references[spec["name"]], dtype=spec["dtype"]), allow_pickle=False)
        entry["outputs"].append({"name": spec["name"], "dtype": spec["dtype"], "shape": spec["shape"],
                                 "reference": file})
    if name in TORCH_MODULES:
        file = f"models/{name}/torch_weights.npz"
        stored = {key: value.astype(torch_dtype) for key, value in weights.torch_weights(model).items()}
        np.savez(stage / file, **stored)  # type: ignore[arg-type]
        entry["torch"] = {"module": name, "weights": file, "weights_dtype": torch_dtype}
    return entry


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def size_report(stage: Path) -> str:
    parts = sorted(((folder_size(p) if p.is_dir() else p.stat().st_size), p.relative_to(stage))
                   for p in [*stage.iterdir(), *(stage / "models").iterdir()] if p.name != "models")
    return "\n".join(f"  {size / MIB:7.2f} MiB  {path}" for size, path in reversed(parts))


def write_pack(out: Path, config_name: str, models: list[str], max_mib: float, warmup: int, repeat: int,
               torch_dtype: str = "float16", say=print) -> Path:
    config = api.resolve_config(config_name)
    cuda = config.target.get("kind") == "cuda"
    out = out.resolve()
    if out.exists() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise PackError(f"{out} exists and is not a pack: refusing to replace it", 2)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as staging:
        stage = Path(staging) / "pack"
        (stage / "lib").mkdir(parents=True)
        (stage / "models").mkdir()
        for library in runtime_libraries(cuda):
            shutil.copy2(library, stage / "lib" / library.name)
        say("building the runner")
        build_runner(stage)
        for file in RUN_FILES:
            shutil.copy2(HERE / file, stage / file)
        entries = [pack_model(*parse_model(text), config, stage, Path(staging) / "build", torch_dtype, say)
                   for text in models]
        manifest = {"pack": {"config": config.name, "target": config.target, "device": "cuda" if cuda else "cpu",
                             "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                             "tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__, "commit": _commit(),
                             "libraries": sorted(p.name for p in (stage / "lib").iterdir())},
                    "settings": {"warmup": warmup, "repeat": repeat}, "models": entries}
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        size = folder_size(stage)
        report = size_report(stage)
        if size > max_mib * MIB:
            raise PackError(f"the pack would be {size / MIB:.1f} MiB, over the {max_mib:g} MiB limit; nothing "
                            f"was written. Its parts:\n{report}\nPack fewer models (--model) or raise --max-mib.", 3)
        if out.exists():
            shutil.rmtree(out)
        stage.rename(out)
    say(f"pack: {out} ({size / MIB:.1f} MiB of {max_mib:g} MiB)\n{report}")
    tree = working_tree_bytes()
    if tree is not None:
        total = (tree + size) / MIB
        say(f"a device run carrying it sends {total:.1f} MiB (this checkout {tree / MIB:.1f} MiB + the pack) "
            f"of the {DEVICE_RUN_MIB} MiB it may" + ("" if total <= DEVICE_RUN_MIB else
                                                      ": TOO MUCH, pack fewer models"))
    return out


def working_tree_bytes() -> int | None:
    """What a device run sends besides the carried pack: tracked and untracked-not-ignored files."""
    done = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          capture_output=True)
    if done.returncode != 0:
        return None
    files = {ROOT / name.decode() for name in done.stdout.split(b"\0") if name}
    return sum(path.stat().st_size for path in files if path.is_file())


def _commit() -> str | None:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the pack's folder")
    parser.add_argument("--config", default="cuda-sm90", help="pipeline config (default: cuda-sm90, H100/H200)")
    parser.add_argument("--model", action="append", help="MODEL.onnx[:NAME:DIMxDIM,...] (repeatable; default: "
                        "bert_tiny, gpt2_tiny, resnet_tiny, mobilenetv3_tiny)")
    parser.add_argument("--max-mib", type=float, default=60, help="refuse a larger pack (default 60)")
    parser.add_argument("--warmup", type=int, default=20, help="runs before timing (default 20)")
    parser.add_argument("--repeat", type=int, default=100, help="timed runs; the median is reported (default 100)")
    parser.add_argument("--torch-weights", choices=["float16", "float32"], default="float16",
                        help="how the torch modules' weights are stored (default float16: half the size; the "
                        "modules compute in float32 either way)")
    args = parser.parse_args(argv)
    try:
        write_pack(args.out, args.config, args.model or [str(ROOT / m) for m in DEFAULT_MODELS], args.max_mib,
                   args.warmup, args.repeat, args.torch_weights)
    except PackError as err:
        print(f"gpu_check --pack: {err}", file=sys.stderr)
        return err.status
    except api.TvmFusionError as err:
        print(f"gpu_check --pack: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Running an aarch64 artifact on an x86 machine: qemu-user and the aarch64 TVM runtime."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import tvm_ffi.libinfo

from ..errors import ArtifactError, ToolchainError
from .toolchain import AARCH64_GXX, QEMU_AARCH64, SETUP_SCRIPT

VM_RUNNER_SOURCE = Path(__file__).with_name("vm_runner.cc")


def aarch64_runtime_dir() -> Path:
    """Where scripts/setup_targets.sh puts libtvm_runtime.so/libtvm_ffi.so from the aarch64 wheels."""
    return Path(os.environ.get("TVM_FUSION_AARCH64_RUNTIME", Path(sys.prefix) / "targets" / "aarch64" / "lib"))


def aarch64_runner() -> Path:
    """vm_runner.cc cross-compiled for aarch64 against the aarch64 runtime (cached by source hash)."""
    runtime = aarch64_runtime_dir()
    source = VM_RUNNER_SOURCE.read_bytes()
    tag = hashlib.sha256(source + (runtime / "libtvm_runtime.so").read_bytes()[:4096]).hexdigest()[:16]
    binary = runtime.parent / f"vm_runner-{tag}"
    if binary.is_file():
        return binary
    compiler = AARCH64_GXX.require("aarch64")
    staging = binary.with_name(f".{binary.name}.tmp-{os.getpid()}")
    build = subprocess.run(
        [compiler, "-std=c++17", "-O2", f"-I{tvm_ffi.libinfo.find_include_path()}",
         f"-I{tvm_ffi.libinfo.find_dlpack_include_path()}", str(VM_RUNNER_SOURCE), "-o", str(staging),
         "-Wl,--no-as-needed", f"-L{runtime}", "-ltvm_runtime", "-ltvm_ffi"],
        capture_output=True, text=True, timeout=600)
    if build.returncode != 0:
        staging.unlink(missing_ok=True)
        raise ToolchainError(f"cannot build the aarch64 runner: {build.stderr.strip()[-2000:]}",
                             f"re-run {SETUP_SCRIPT} aarch64")
    os.replace(staging, binary)
    return binary


def run_emulated(library: Path, metadata: dict, inputs: Mapping[str, np.ndarray],
                 timeout: float = 600) -> dict[str, np.ndarray]:
    """Run an aarch64 library under qemu-user with the aarch64 TVM runtime; outputs by name.

    Inputs go in the order ``metadata["inputs"]`` lists them; output names come from
    ``metadata["outputs"]``.
    """
    runner = aarch64_runner()
    qemu = QEMU_AARCH64.require("aarch64")
    env = {"QEMU_LD_PREFIX": "/usr/aarch64-linux-gnu", "LD_LIBRARY_PATH": str(aarch64_runtime_dir())}
    return run_with_runner([qemu, str(runner)], library, metadata, inputs, env, "under qemu-aarch64", timeout)


def run_with_runner(command: list[str], library: Path, metadata: dict, inputs: Mapping[str, np.ndarray],
                    env: Mapping[str, str] | None = None, where: str = "in vm_runner",
                    timeout: float = 600) -> dict[str, np.ndarray]:
    """Run ``library`` with a built vm_runner (``command``: the runner, after an emulator if one is
    needed): the inputs written as raw files in metadata order, the outputs read back by name."""
    with tempfile.TemporaryDirectory(prefix="tvm_fusion_runner_") as folder:
        arguments = []
        for index, spec in enumerate(metadata["inputs"]):
            value = np.require(inputs[spec["name"]], dtype=spec["dtype"], requirements="C")
            path = Path(folder) / f"input{index}.bin"
            value.tofile(path)
            arguments.append(f"{spec['dtype']}:{'x'.join(map(str, value.shape))}:{path}")
        env = {**os.environ, **(env or {}), "TVM_NUM_THREADS": str(metadata.get("threads", 1))}
        try:
            run = subprocess.run([*command, str(Path(library).resolve()), folder, *arguments],
                                 capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise ArtifactError(f"{library} {where} did not finish in {timeout:.0f} s",
                                "try a smaller input shape") from err
        if run.returncode != 0:
            errors = [line for line in run.stderr.splitlines() if "Scope Loaded" not in line]
            raise ArtifactError(f"{library} failed {where} (exit {run.returncode}): "
                                + "\n".join(errors[-20:]), "check the artifact and the TVM runtime it runs with")
        outputs = {}
        for line in run.stdout.splitlines():
            _, index, dtype, shape = (line.split() + [""])[:4]
            dims = [int(d) for d in shape.split("x") if d]
            name = metadata["outputs"][int(index)]["name"]
            outputs[name] = np.fromfile(Path(folder) / f"output{index}.bin", dtype=dtype).reshape(dims)
    return outputs

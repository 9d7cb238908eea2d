"""Artifacts back in: load a built directory, check it, run it with checked inputs.

TVM is imported inside the functions that use it: the CLI imports ``runtime.latency`` at
start-up (through ``cli.output``), which runs this ``__init__``, and ``tvm-fusion --help``
should not wait seconds for TVM.
"""

from __future__ import annotations

import json
import os
import queue
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import ml_dtypes  # also registers "bfloat16" as a numpy dtype name
import numpy as np

from ..errors import ArtifactError
from ..files import sha256_of
from ..frontend.dims import DimRange
from ..native_log import captured_native_stderr, summarize

LIBRARY_NAME = "model.so"
METADATA_NAME = "metadata.json"


def set_threads(count: int) -> None:
    """TVM's pool defaults to half the hardware threads here; it reads this before its first run."""
    os.environ["TVM_NUM_THREADS"] = str(count)


class CompiledModel:
    """A Relax VM over a built module, taking and returning numpy arrays by name."""

    def __init__(self, module, metadata: dict):
        import tvm  # deferred: keeps TVM out of --help (module docstring)

        self.metadata = metadata
        self.inputs = metadata["inputs"]
        # The ranges it was compiled for, by dim name.
        self.dims = {name: DimRange(name, r["min"], r["max"], r.get("step", 1))
                     for name, r in metadata.get("dims", {}).items()}
        self.outputs = metadata["outputs"]
        set_threads(metadata.get("threads", 1))
        # Kernels of a CUDA artifact run on the GPU; the VM adds the CPU for shape code itself.
        self._on_host = metadata.get("target", {}).get("kind") != "cuda"
        self._device = tvm.cpu() if self._on_host else tvm.cuda(0)
        self._machines = _MachinePool(module, self._device)

    def by_name(self, inputs) -> Mapping[str, np.ndarray]:
        """A dict as it is; a list or tuple in the order of the inputs (pinned ones left out); one
        array for a one-input model."""
        if isinstance(inputs, Mapping):
            return inputs
        free = [spec["name"] for spec in self.inputs if "value" not in spec]
        arrays = ([inputs] if isinstance(inputs, np.ndarray) else
                  list(inputs) if isinstance(inputs, (list, tuple)) else None)
        if arrays is None or len(arrays) != len(free):
            given = f"{len(arrays)} array(s)" if arrays is not None else type(inputs).__name__
            raise ArtifactError(f"inputs: got {given}, the model takes {len(free)}: {', '.join(free)}",
                                "pass a dict {name: array}, a list in that order, or one array for a "
                                "one-input model")
        return dict(zip(free, arrays))

    def prepare(self, inputs) -> list:
        """Check names, shapes and dtypes against the metadata; return device tensors in order.
        ``inputs``: a dict by name, a list in input order, or one array (``by_name``)."""
        import tvm  # deferred: keeps TVM out of --help (module docstring)

        inputs = self.by_name(inputs)
        expected = [spec["name"] for spec in self.inputs]
        unknown = sorted(set(inputs) - set(expected))
        # A pinned input may be left out: it can only hold its value.
        missing = [spec["name"] for spec in self.inputs if spec["name"] not in inputs and "value" not in spec]
        if unknown or missing:
            raise ArtifactError(
                "inputs do not match the model: "
                + "; ".join(part for part in (f"unknown {unknown}" if unknown else "",
                                              f"missing {missing}" if missing else "") if part),
                "the model takes: " + ", ".join(f"{s['name']} {s['dtype']}{s['shape']}" for s in self.inputs))
        tensors = []
        sizes: dict[str, tuple[int, str]] = {}  # dim name -> (size, the input that gave it)
        for spec in self.inputs:
            if spec["name"] not in inputs:  # pinned (checked above)
                inputs = {**inputs, spec["name"]: np.full(spec["shape"], spec["value"], spec["dtype"])}
            value = _as_bfloat16_if_saved(np.asarray(inputs[spec["name"]]), spec["dtype"])
            self._check_shape(spec, list(value.shape), sizes)
            if str(value.dtype) != spec["dtype"]:
                raise ArtifactError(f"input {spec['name']!r} has dtype {value.dtype}, expected {spec['dtype']}",
                                    f"convert it with .astype('{spec['dtype']}')"
                                    + (" after `import ml_dtypes`" if spec["dtype"] == "bfloat16" else ""))
            if "index_range" in spec:
                _check_index_range(spec, value)
            if "value" in spec and not np.all(value == spec["value"]):
                raise ArtifactError(
                    f"input {spec['name']!r} is {value.ravel()[0] if value.size else value}, but the model was "
                    f"compiled for {spec['name']}={spec['value']} only (--input-value)",
                    f"pass {spec['value']} (or leave {spec['name']} out), or recompile with "
                    f"--input-value {spec['name']}=VALUE for the value you use")
            if self._on_host and value.dtype.kind in "biuf":  # bool, integers, floats: DLPack's types
                tensors.append(_host_tensor(value))
            else:  # np.ascontiguousarray would make a scalar input (shape ()) 1-D
                tensors.append(tvm.runtime.tensor(np.require(value, requirements="C"), self._device))
        return tensors

    def dim_sizes(self, given: Mapping[str, np.ndarray], flags: list[str]) -> dict[str, int]:
        """The size of each ranged dim for generated inputs: ``NAME=SIZE`` flags first, then the
        size an input in ``given`` has; a dim neither names is an error."""
        sizes: dict[str, int] = {}
        for flag in flags:
            name, _, size = flag.partition("=")
            if name not in self.dims or not size.isdigit():
                known = ", ".join(f"{d}={r}" for d, r in self.dims.items()) or "none"
                raise ArtifactError(f"--dim {flag!r} does not name a ranged dim of the model as NAME=SIZE",
                                    f"the model's ranged dims: {known}")
            sizes[name] = int(size)
        for spec in self.inputs:
            if spec["name"] in given:
                for dim, size in zip(spec["shape"], np.shape(given[spec["name"]])):
                    if isinstance(dim, str):
                        sizes.setdefault(dim, int(size))
        for name, dim in self.dims.items():
            if name not in sizes:
                raise ArtifactError(f"dim {name!r} takes any size in {dim}, and neither "
                                    "--dim nor a given input says which to generate",
                                    f"pass --dim {name}=SIZE (or --input for an input that has it)")
        return sizes

    def filled_inputs(self, given: Mapping[str, np.ndarray], fill: str = "random",
                      dim_flags: Sequence[str] = (), seed: int = 0) -> dict[str, np.ndarray]:
        """``given`` completed with generated inputs: ``fill="random"`` (floats standard normal,
        integers 0 or 1, valid as ids, masks and flags) or ``"zeros"``; a ranged dim takes its
        size from ``dim_flags`` (``NAME=SIZE``) or from a given input. Pinned inputs fill themselves."""
        rng = np.random.default_rng(seed)
        sizes = self.dim_sizes(given, list(dim_flags))
        filled = dict(given)
        for spec in self.inputs:
            if spec["name"] in filled or "value" in spec:
                continue
            shape = [sizes[d] if isinstance(d, str) else d for d in spec["shape"]]
            if fill == "zeros":
                filled[spec["name"]] = np.zeros(shape, spec["dtype"])
            elif spec["dtype"].startswith(("float", "bfloat")):
                filled[spec["name"]] = rng.standard_normal(shape).astype(spec["dtype"])
            else:
                filled[spec["name"]] = rng.integers(0, 2, shape).astype(spec["dtype"])
        return filled

    def _check_shape(self, spec: dict, shape: list[int], sizes: dict) -> None:
        """Static dims must match; a named dim must be inside its range and the same size in
        every input that has it (the model says they are one size)."""
        name, built = spec["name"], spec["shape"]
        described = "x".join(str(d) if isinstance(d, int) else str(self.dims[d]) for d in built)
        if len(shape) != len(built) or any(isinstance(d, int) and d != size for d, size in zip(built, shape)):
            raise ArtifactError(
                f"input {name!r} has shape {shape}, the model was built for {described}",
                f"recompile with --input-shape {name}:{'x'.join(map(str, shape))} (or a range such as "
                f"1..512 for a dim that varies) or pass the built shape")
        for axis, (dim, size) in enumerate(zip(built, shape)):
            if isinstance(dim, int):
                continue
            compiled = self.dims[dim]
            step = compiled.step
            if not compiled.low <= size <= compiled.high:
                raise ArtifactError(
                    f"input {name!r} dim {axis} ({dim!r}) is {size}, outside the range {compiled} "
                    "the model was compiled for",
                    f"pass a size in {compiled}, or recompile with a range that holds {size}")
            if size % step:
                raise ArtifactError(
                    f"input {name!r} dim {axis} ({dim!r}) is {size}, not a multiple of {step} in {compiled}",
                    f"pad or resize it to a multiple of {step} (e.g. {size // step * step + step})")
            earlier = sizes.setdefault(dim, (size, name))
            if earlier[0] != size:
                raise ArtifactError(
                    f"input {name!r} dim {axis} ({dim!r}) is {size}, but input {earlier[1]!r} has "
                    f"{dim!r} = {earlier[0]}", f"the model takes one {dim!r}: give both inputs the same size")

    def run_prepared(self, tensors: list):
        """Safe from any number of threads at once: each call in flight has a VM of its own."""
        return self._machines.call(tensors)

    def run(self, inputs) -> dict[str, np.ndarray]:
        """Outputs by name; ``inputs`` as ``prepare`` takes them. Safe from many threads at once."""
        result = self.run_prepared(self.prepare(inputs))
        values = [result] if hasattr(result, "numpy") else list(result)
        return {spec["name"]: value.numpy() for spec, value in zip(self.outputs, values)}


class _MachinePool:
    """Idle Relax VMs over one loaded module, one taken per call in flight.

    A VM keeps its registers and frames in itself, so two threads in one VM corrupt each other
    (a segfault, or "Mismatched type on argument"). A VM costs well under a millisecond and no
    copy of the weights (its constants are the module's), so a call that finds none idle makes
    one, and the pool grows to the most calls ever in flight at once. A call that raises keeps
    its VM out of the pool (its frames may be half unwound), so a failed or killed caller never
    hands a broken VM on and nothing waits for one.
    """

    def __init__(self, module, device):
        self._module, self._device = module, device
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._idle.put(self._new_main())  # a module the VM cannot load fails here, at load time

    def _new_main(self):
        from tvm import relax  # deferred: keeps TVM out of --help (module docstring)

        return relax.VirtualMachine(self._module, self._device)["main"]

    def call(self, tensors: list):
        try:
            main = self._idle.get_nowait()
        except queue.Empty:
            main = self._new_main()
        result = main(*tensors)
        self._idle.put(main)
        return result


# The alignment TVM's kernels take their buffers at (an input off it crashes the call).
_ALIGNMENT = 64


def _host_tensor(value: np.ndarray):
    """``value`` copied into a fresh buffer aligned for TVM and handed over by DLPack: a third of
    ``tvm.runtime.tensor``'s cost per input (4 against 12 us for a small one), which a model of
    a tenth of a millisecond feels. The buffer is the call's own: the caller's array is never
    shared with the kernels."""
    import tvm_ffi  # deferred with TVM (module docstring)

    buffer = np.empty(value.nbytes + _ALIGNMENT, np.uint8)
    offset = -buffer.ctypes.data % _ALIGNMENT
    aligned = buffer[offset:offset + value.nbytes].view(value.dtype).reshape(value.shape)
    np.copyto(aligned, value)
    return tvm_ffi.from_dlpack(aligned)


def _check_index_range(spec: dict, value: np.ndarray) -> None:
    """Token ids outside the embedding table: TVM would read out of bounds (garbage or a crash)."""
    low, high = spec["index_range"]
    if value.size == 0 or (low <= int(value.min()) and int(value.max()) <= high):
        return
    where = tuple(int(i) for i in np.argwhere((value < low) | (value > high))[0])
    raise ArtifactError(
        f"input {spec['name']!r} holds {value[where]} at {list(where)}, outside its valid range "
        f"[{low}, {high}]: it indexes the {high + 1}-row table {spec.get('index_table', '')!r}",
        f"pass ids within [{low}, {high}] (e.g. the tokenizer the model was exported with)")


def _as_bfloat16_if_saved(value: np.ndarray, dtype: str) -> np.ndarray:
    """np.save writes bfloat16 as raw 2-byte records (np.load gives '|V2'): read them back as bfloat16."""
    if dtype == "bfloat16" and value.dtype.kind == "V" and value.dtype.itemsize == 2 and not value.dtype.names:
        return value.view(ml_dtypes.bfloat16)
    return value


def load(directory: str | os.PathLike) -> CompiledModel:
    """Load ``build/<model>.<target>/``: check the library's sha256 against the metadata first."""
    import tvm  # deferred: keeps TVM out of --help (module docstring)

    directory = Path(directory)
    metadata_path = directory / METADATA_NAME
    if not metadata_path.is_file():
        raise ArtifactError(f"{directory} is not a tvm_fusion artifact: {METADATA_NAME} is missing",
                            "pass the directory that `tvm-fusion compile` wrote (build/<model>.<target>/)")
    try:
        metadata = _checked_metadata(metadata_path.read_text())
    except ValueError as err:  # also JSONDecodeError and UnicodeDecodeError
        raise ArtifactError(f"{metadata_path} is damaged: {err}", "rebuild the artifact") from err
    library = directory / metadata["library"]
    expected_sha = metadata["library_sha256"]
    if not library.is_file():
        raise ArtifactError(f"{library} is missing", "rebuild the artifact")
    actual_sha = sha256_of(library)
    if actual_sha != expected_sha:
        raise ArtifactError(f"{library} does not match its metadata (sha256 {actual_sha[:12]}..., "
                            f"expected {expected_sha[:12]}...): it was modified or damaged",
                            "rebuild the artifact")
    check_runs_here(directory, metadata)
    native: list[str] = []
    try:
        with captured_native_stderr(native):
            module = tvm.runtime.load_module(str(library))
    except Exception as err:
        raise ArtifactError(f"cannot load {library} on this machine: {str(err).splitlines()[-1]}",
                            "run it on the machine class it was built for") from err
    for message in summarize(native):
        print(f"tvm: {message}", file=sys.stderr)
    return CompiledModel(module, metadata)


def check_runs_here(directory: Path, metadata: dict) -> None:
    """An ArtifactError saying why, instead of a failed dlopen or an illegal-instruction crash."""
    from ..targets import execution_here  # deferred: targets imports TVM (module docstring)

    execution = execution_here(metadata.get("target", {"kind": "llvm"}))
    if execution.how == "native":
        return
    target = metadata.get("config", "another target")
    hint = (f"run it on a machine of its class ({target}); here, tvm_fusion.targets.run_emulated "
            "runs it under qemu-aarch64" if execution.how == "qemu" else
            f"run it on a machine of its class ({target}), or compile for this one "
            "(--config x86_64-host)")
    raise ArtifactError(f"{directory} cannot run on this machine: {execution.reason}", hint)


def _checked_metadata(text: str) -> dict:
    """Parse metadata.json; a ValueError names the field that is missing or malformed."""
    metadata = json.loads(text)
    if not isinstance(metadata, dict):
        raise ValueError("it is not a JSON object")
    for key, kind in (("library", str), ("library_sha256", str), ("inputs", list), ("outputs", list)):
        if not isinstance(metadata.get(key), kind):
            raise ValueError(f"field {key!r} is missing or not a {kind.__name__}")
    dims = metadata.get("dims", {})
    if not isinstance(dims, dict) or not all(
            isinstance(r, dict) and _int_list([r.get("min"), r.get("max"), r.get("step", 1)])
            and 1 <= r["min"] <= r["max"] and r.get("step", 1) >= 1 for r in dims.values()):
        raise ValueError("field 'dims' is not an object of {\"min\": LOW, \"max\": HIGH} ranges")
    for section, fields in (("inputs", ("name", "shape", "dtype")), ("outputs", ("name",))):
        for spec in metadata[section]:
            if not isinstance(spec, dict) or any(field not in spec for field in fields):
                raise ValueError(f"an entry of {section!r} lacks one of {', '.join(fields)}")
    for spec in metadata["inputs"]:
        name = spec["name"]
        if not isinstance(name, str) or not isinstance(spec["dtype"], str):
            raise ValueError(f"input {name!r}: 'name' and 'dtype' must be strings")
        if not isinstance(spec["shape"], list) or not all(
                (_int_list([dim]) and dim >= 0) or (isinstance(dim, str) and dim in dims) for dim in spec["shape"]):
            raise ValueError(f"input {name!r}: 'shape' is {spec['shape']!r}, not a list of non-negative integers "
                             "and names of entries of 'dims'")
        if "index_range" in spec and not (_int_list(spec["index_range"]) and len(spec["index_range"]) == 2):
            raise ValueError(f"input {name!r}: 'index_range' is {spec['index_range']!r}, not [low, high]")
        if "value" in spec and (isinstance(spec["value"], bool) or not isinstance(spec["value"], (int, float))):
            raise ValueError(f"input {name!r}: 'value' is {spec['value']!r}, not a number")
    if not isinstance(metadata.get("target", {}), dict):
        raise ValueError("field 'target' is not an object")
    return metadata


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)

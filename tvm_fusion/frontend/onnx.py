"""ONNX in: load and check, bind dynamic dims, simplify, import into Relax.

Real exporter graphs compute reshape targets with Shape -> Gather -> Concat subgraphs that
TVM 0.27's importer cannot turn into shape expressions. Once every input dim is bound, those
subgraphs are constant, so we let onnxslim fold them at the ONNX level before import. The
original model is kept untouched as the reference for verification.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

import ml_dtypes  # noqa: F401 - registers "bfloat16" as a numpy dtype name
import numpy as np
import onnx

from ..errors import ModelError, ShapeError
from .dims import DimRange, Range, is_dynamic, parse_dim
from .op_support import unsupported_ops, unsupported_ops_message

ONNX_DTYPES = {
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "float64", onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT16: "int16",
    onnx.TensorProto.INT8: "int8", onnx.TensorProto.UINT64: "uint64",
    onnx.TensorProto.UINT32: "uint32", onnx.TensorProto.UINT16: "uint16",
    onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.BFLOAT16: "bfloat16",
}
FLOAT_DTYPES = ("float16", "float32", "float64", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A model input: each dim a size, or a ``DimRange`` the artifact accepts any size of."""

    name: str
    shape: tuple[int | DimRange, ...]
    dtype: str

    @property
    def dynamic(self) -> bool:
        return is_dynamic(self.shape)

    def to_json(self) -> dict:
        shape = [dim.name if isinstance(dim, DimRange) else dim for dim in self.shape]
        return {"name": self.name, "shape": shape, "dtype": self.dtype}


def load_onnx(path: str | Path) -> onnx.ModelProto:
    """Load and check a model file; anything that is not a valid ONNX model is a ModelError."""
    path = Path(path)
    if not path.is_file():
        problem = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ModelError(f"model file {path} {problem}", "check the path")
    try:
        model = onnx.load(str(path))
    except Exception as err:  # protobuf raises DecodeError, truncated files raise others
        raise ModelError(f"{path} is not an ONNX model: {err}",
                         "pass a .onnx file written by an ONNX exporter") from err
    if not model.graph.node:
        raise ModelError(f"{path} is not an ONNX model: it has no graph nodes",
                         "pass a .onnx file written by an ONNX exporter")
    _check_opset(model, path)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        first_line = str(err).strip().splitlines()[0]
        raise ModelError(f"{path} is not a valid ONNX model: {first_line}",
                         "re-export the model; onnx.checker.check_model must pass") from err
    return model


def _check_opset(model: onnx.ModelProto, path: Path) -> None:
    """A default-domain opset newer than the installed onnx knows: its ops' meaning is unknown
    here (the checker lets it through, and the importer would guess)."""
    known = onnx.defs.onnx_opset_version()
    declared = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if declared > known:
        raise ModelError(f"{path} declares ONNX opset {declared}, newer than the installed onnx "
                         f"{onnx.__version__} knows (up to opset {known})",
                         f"export the model at opset {known} or lower, or upgrade onnx")


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The real inputs: graph inputs that are not initializers (old exporters list both)."""
    initializers = {init.name for init in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in initializers]


Dim = int | Range  # a size, or a (low, high, step) range from ``--input-shape`` or the config


def parse_shape_flag(flag: str) -> tuple[str, tuple[Dim, ...]]:
    """Parse ``name:1x3x224x224`` (``,`` also accepted between dims); a dim may be a range
    ``LOW..HIGH`` (``input_ids:1x1..512``) or ``LOW..HIGH/STEP`` (``32..640/32``), compiled
    symbolically."""
    dim = r"\d+(?:\.\.\d+(?:/\d+)?)?"
    match = re.fullmatch(rf"(.+):({dim}(?:[x,]{dim})*)", flag.strip())
    if not match:
        raise ShapeError(f"cannot parse --input-shape {flag!r}",
                         "write it as NAME:DIMxDIM..., e.g. input_ids:1x128, or with a range input_ids:1x1..512")
    dims = tuple(parse_dim(d, f"--input-shape {flag!r}") for d in re.split(r"[x,]", match.group(2)))
    if 0 in dims:
        raise ShapeError(f"--input-shape {flag!r} has a zero-sized dim", "every dim must be at least 1")
    return match.group(1), dims


def _as_dim(given: Dim, name: str) -> int | DimRange:
    """A flag's or config's dim as a spec dim; a range of one size is that size."""
    if isinstance(given, tuple):
        low, high, step = given
        return low if low == high else DimRange(name, low, high, step)
    return given


def bind_input_shapes(model: onnx.ModelProto, shapes: dict[str, tuple[Dim, ...]] | None = None,
                      dim_defaults: dict[str, Dim] | None = None) -> list[TensorSpec]:
    """Give every input a shape: explicit shapes first, then config defaults by dim name. A dim
    given as a range stays symbolic (named by ``dynamic_dim_name``); every other dim is static."""
    shapes = dict(shapes or {})
    dim_defaults = dim_defaults or {}
    inputs = graph_inputs(model)
    names = [value.name for value in inputs]
    for name in shapes:
        if name not in names:
            raise ShapeError(f"--input-shape names {name!r}, which is not an input of the model",
                             f"the model's inputs are: {', '.join(names)}")
    dim_defaults = {**dim_defaults, **_dims_named_by_flags(inputs, shapes)}
    specs = []
    for value in inputs:
        tensor_type = _input_tensor_type(value)
        dtype = ONNX_DTYPES.get(tensor_type.elem_type)
        if dtype is None:
            raise ModelError(f"input {value.name!r} has unsupported element type "
                             f"{onnx.TensorProto.DataType.Name(tensor_type.elem_type)}",
                             f"supported: {', '.join(sorted(set(ONNX_DTYPES.values())))}")
        dims = tensor_type.shape.dim
        if not tensor_type.HasField("shape"):  # rank unknown: only an explicit shape can bind it
            if value.name not in shapes:
                raise ShapeError(f"input {value.name!r} has no shape in the model (its rank is unknown)",
                                 f"pass --input-shape {value.name}:DIMxDIM... with all of its dims")
            specs.append(TensorSpec(value.name, tuple(_as_dim(size, f"{value.name}_dim{axis}")
                                                      for axis, size in enumerate(shapes[value.name])), dtype))
            continue
        if value.name in shapes:
            given = shapes[value.name]
            if len(given) != len(dims):
                raise ShapeError(f"input {value.name!r} has rank {len(dims)} but --input-shape gives "
                                 f"{len(given)} dims {given}", f"give {len(dims)} dims")
            for axis, (dim, size) in enumerate(zip(dims, given)):
                if _fixed(dim) and isinstance(size, tuple) and size[:2] != (dim.dim_value, dim.dim_value):
                    raise ShapeError(f"input {value.name!r} dim {axis} is fixed to {dim.dim_value} in the "
                                     f"model, but --input-shape gives it the range {_dim_text(size)}",
                                     f"use {dim.dim_value} for that dim; only dynamic dims take a range")
                if _fixed(dim) and isinstance(size, int) and dim.dim_value != size:
                    raise ShapeError(f"input {value.name!r} dim {axis} is fixed to {dim.dim_value} "
                                     f"in the model, but --input-shape gives {size}",
                                     f"use {dim.dim_value} for that dim")
            specs.append(TensorSpec(value.name, tuple(_as_dim(size, dynamic_dim_name(value.name, axis, dim))
                                                      for axis, (dim, size) in enumerate(zip(dims, given))), dtype))
            continue
        shape = []
        for axis, dim in enumerate(dims):
            name = dynamic_dim_name(value.name, axis, dim)
            if _fixed(dim):
                shape.append(dim.dim_value)
            elif name in dim_defaults:
                shape.append(_as_dim(dim_defaults[name], name))
            else:
                example = "x".join(str(d.dim_value) if _fixed(d) else "N" for d in dims)
                raise ShapeError(
                    f"input {value.name!r} dim {axis} ({name!r}) is dynamic and unbound",
                    f"pass --input-shape {value.name}:{example} (N = the size you deploy with, or a "
                    f"range LOW..HIGH), or set {name} = N under [inputs] in the config (or \"LOW..HIGH\")")
        specs.append(TensorSpec(value.name, tuple(shape), dtype))
    return specs


def _dims_named_by_flags(inputs: list[onnx.ValueInfoProto], shapes: dict[str, tuple[Dim, ...]]) -> dict[str, Dim]:
    """Named dims an explicit shape fixes: ``--input-shape src:1x16`` binds ``src_len`` = 16 for
    every input that shares the name (``src_mask``), as the model says they are one size."""
    named: dict[str, tuple[int, str]] = {}
    for value in inputs:
        given = shapes.get(value.name)
        tensor_type = value.type.tensor_type
        if given is None or not tensor_type.HasField("shape") or len(given) != len(tensor_type.shape.dim):
            continue
        for dim, size in zip(tensor_type.shape.dim, given):
            if not _named(dim):
                continue
            earlier = named.setdefault(dim.dim_param, (size, value.name))
            if earlier[0] != size:
                raise ShapeError(f"dim {dim.dim_param!r} is {_dim_text(earlier[0])} in --input-shape {earlier[1]} "
                                 f"but {_dim_text(size)} in --input-shape {value.name}",
                                 "the model says these are one size: give both the same")
    return {name: size for name, (size, _) in named.items()}


def _dim_text(dim: Dim) -> str:
    return str(DimRange("", *dim)) if isinstance(dim, tuple) else str(dim)


def _fixed(dim: onnx.TensorShapeProto.Dimension) -> bool:
    """A dim the model fixes. paddle2onnx writes dynamic dims as ``dim_value: -1`` (ONNX Runtime
    and OpenVINO read a negative dim as unknown), so only a non-negative value is fixed."""
    return dim.HasField("dim_value") and dim.dim_value >= 0


def _named(dim: onnx.TensorShapeProto.Dimension) -> bool:
    """A ``dim_param`` that names a size; paddle2onnx writes ``?`` for every unknown dim alike."""
    return any(ch.isalnum() for ch in dim.dim_param)


def dynamic_dim_name(input_name: str, axis: int, dim: onnx.TensorShapeProto.Dimension) -> str:
    """The name a dynamic dim is bound by under ``[inputs]``: its ``dim_param``, or for an unnamed
    dim (no ``dim_param``, ``?``, or a negative ``dim_value``) ``<input>_dim<axis>``."""
    return dim.dim_param if _named(dim) else f"{input_name}_dim{axis}"


def _input_tensor_type(value: onnx.ValueInfoProto) -> onnx.TypeProto.Tensor:
    """The tensor type of a graph input; an optional tensor counts as its tensor.

    Like TVM's importer, we compile an optional input as always present: the caller passes a
    tensor. Sequences, maps and optional sequences have no Relax tensor form, so they are refused.
    """
    kind = value.type.WhichOneof("value")
    inner = value.type.optional_type.elem_type.WhichOneof("value") if kind == "optional_type" else None
    if kind == "tensor_type":
        return value.type.tensor_type
    if inner == "tensor_type":
        return value.type.optional_type.elem_type.tensor_type
    described = " ".join(k.removesuffix("_type").replace("_", " ") for k in (kind, inner) if k)
    raise ModelError(f"input {value.name!r} has type {described or 'none'}, not a tensor type",
                     "tvm_fusion compiles models whose inputs are tensors (or optional tensors); "
                     "re-export the model with tensor inputs")


def output_specs(model: onnx.ModelProto) -> list[str]:
    return [value.name for value in model.graph.output]


def simplify(model: onnx.ModelProto, inputs: list[TensorSpec]) -> onnx.ModelProto:
    """Fold shape subgraphs with onnxslim at the bound shapes; our fusions stay ours.

    With a symbolic dim, only the shape values that are the same at the low, typical and high
    sizes are frozen; the rest stay in the graph for the importer to compute as shape expressions.
    onnxslim refuses some valid graphs (optional-typed values, for one); those go to TVM's
    importer as they are, with the bound shapes, rather than being rejected here.
    """
    import onnxslim
    from onnxslim.core.pattern.registry import DEFAULT_FUSION_PATTERNS

    from .dims import concrete_shape, ranges_of, size_points
    from .dropout_guard import hide_dropouts, restore_dropouts
    from .shape_values import freeze_shape_tensors

    points = size_points(ranges_of(inputs))
    probes = [inputs_at(inputs, sizes) for sizes in points]
    # Shape computations as ONNX Runtime evaluates them (onnxslim's own folding can be wrong).
    model = freeze_shape_tensors(model, [random_inputs(model, specs, seed=0) for specs in probes])
    try:
        if any(spec.dynamic for spec in inputs):
            model, input_shapes = with_declared_shapes(model, inputs), None
        else:
            input_shapes = [f"{spec.name}:{','.join(map(str, concrete_shape(spec.shape, {})))}" for spec in inputs]
        simplified = restore_dropouts(onnxslim.slim(
            hide_dropouts(model),  # onnxslim would delete every Dropout, training mode too
            input_shapes=input_shapes,
            # onnxslim's own fusions (MatMul+Add -> Gemm, Conv+BN, ...) would pre-empt ours.
            skip_fusion_patterns=[p for p in DEFAULT_FUSION_PATTERNS if p.startswith("Fusion")],
        ))
    except Exception:  # noqa: BLE001 - any onnxslim failure: let the importer try the original
        return model
    return _with_inputs_of(simplified, model)


def inputs_at(inputs: list[TensorSpec], sizes: dict[str, int]) -> list[TensorSpec]:
    """The static specs of one run: every symbolic dim at its size in ``sizes``."""
    from .dims import concrete_shape

    return [TensorSpec(spec.name, concrete_shape(spec.shape, sizes), spec.dtype) for spec in inputs]


def with_declared_shapes(model: onnx.ModelProto, inputs: list[TensorSpec]) -> onnx.ModelProto:
    """A copy whose graph inputs declare the bound shapes: static dims as values, each range as
    a ``dim_param`` of its name (so shape inference ties the dims that are one size)."""
    declared = onnx.ModelProto()
    declared.CopyFrom(model)
    specs = {spec.name: spec for spec in inputs}
    for value in declared.graph.input:
        spec = specs.get(value.name)
        if spec is None:
            continue
        shape = _input_tensor_type(value).shape
        del shape.dim[:]
        for dim in spec.shape:
            entry = shape.dim.add()
            if isinstance(dim, DimRange):
                entry.dim_param = dim.name
            else:
                entry.dim_value = dim
    return declared


def _with_inputs_of(simplified: onnx.ModelProto, model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxslim drops graph inputs no node reads (LAC's ``length``); the compiled model keeps the
    model's signature, so callers pass the inputs the ONNX model declares, in its order."""
    kept = {value.name: value for value in simplified.graph.input}
    if len(kept) == len(graph_inputs(model)):
        return simplified
    initializers = {init.name for init in simplified.graph.initializer}
    inputs = [kept.get(value.name, value) for value in graph_inputs(model)]
    inputs += [value for name, value in kept.items() if name in initializers]
    del simplified.graph.input[:]
    simplified.graph.input.extend(inputs)
    return simplified


def import_model(model: onnx.ModelProto, inputs: list[TensorSpec]):
    """Import a simplified model into a Relax IRModule with the bound input shapes.

    Each range becomes one symbolic ``int64`` var shared by every input that has it; ``main``
    records the ranges as ``tir_var_lower_bound``/``tir_var_upper_bound``, so memory is planned
    for the largest size and the schedules know how far a dim goes.
    """
    from .converters import from_onnx  # TVM's importer + our converters (Dropout, EyeLike, LSTM, ...)
    from .dims import ranges_of

    missing = unsupported_ops(model)
    if missing:
        raise ModelError(*unsupported_ops_message(missing))
    ranges = ranges_of(inputs)
    try:
        module = from_onnx(model, shape_dict=relax_shape_dict(inputs), dtype_dict={s.name: s.dtype for s in inputs})
    except ModelError:
        raise  # our converters name the node already
    except Exception as err:
        message = str(err).strip().splitlines()
        fix = ("report the model; check that the input shapes are right" if not ranges else
               "if the model takes only multiples of a stride (detectors: 32), give the range that step "
               "(e.g. 32..640/32); otherwise report the model, and compile it at fixed sizes meanwhile")
        what = " with symbolic " + ", ".join(ranges) if ranges else ""
        raise ModelError(f"TVM's ONNX importer failed{what}: "
                         f"{message[-1] if message else type(err).__name__}", fix) from err
    return with_range_bounds(module, inputs)


def relax_shape_dict(inputs: list[TensorSpec]) -> dict[str, list]:
    """The importer's ``shape_dict``: sizes, and one ``int64`` var per range name, shared by
    every input that has it (so Relax knows ``input_ids`` and ``attention_mask`` agree)."""
    from tvm import tirx

    from .dims import ranges_of

    ranges = ranges_of(inputs)
    variables = {name: tirx.Var(r.var_name, "int64") * r.step if r.step > 1 else tirx.Var(r.var_name, "int64")
                 for name, r in ranges.items()}
    return {s.name: [variables[d.name] if isinstance(d, DimRange) else d for d in s.shape] for s in inputs}


def with_range_bounds(module, inputs: list[TensorSpec]):
    """``main`` annotated with the ranges (memory is planned for the high end); a stepped
    range's var defined by a leading shape parameter (``stepped_dims.py``)."""
    from .dims import ranges_of
    from .stepped_dims import add_steps_param

    ranges = ranges_of(inputs)
    if not ranges:
        return module
    module = add_steps_param(module, ranges)
    main = module["main"].with_attr("tir_var_lower_bound", {r.var_name: r.low // r.step for r in ranges.values()})
    module["main"] = main.with_attr("tir_var_upper_bound", {r.var_name: r.high // r.step for r in ranges.values()})
    return module


def random_inputs(model: onnx.ModelProto, inputs: list[TensorSpec], seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs that are valid for the model: indices stay inside the table they index."""
    rng = np.random.default_rng(seed)
    index_limits = {name: rows for name, (_table, rows) in index_tables(model).items()}
    values = {}
    for spec in inputs:
        if spec.dtype in FLOAT_DTYPES:
            values[spec.name] = rng.standard_normal(spec.shape).astype(spec.dtype)
        elif spec.dtype == "bool":
            values[spec.name] = rng.integers(0, 2, spec.shape).astype(bool)
        else:
            high = index_limits.get(spec.name, 2)
            values[spec.name] = rng.integers(0, high, spec.shape).astype(spec.dtype)
    return values


VIEW_OPS = ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast", "Identity")


def index_tables(model: onnx.ModelProto) -> dict[str, tuple[str, int]]:
    """Input name -> (initializer, rows) of the smallest table it indexes (token ids, positions),
    seen through views. TVM gathers without a bounds check: the runtime checks these instead."""
    rows = {init.name: init.dims[0] for init in model.graph.initializer if init.dims}
    consumers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].append(node)
    limits = {}
    for value in graph_inputs(model):
        frontier, seen = [value.name], set()
        while frontier:
            tensor = frontier.pop()
            seen.add(tensor)
            for node in consumers[tensor]:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if (node.op_type == "Gather" and len(node.input) == 2 and node.input[1] == tensor
                        and node.input[0] in rows and axis == 0):
                    table = (node.input[0], rows[node.input[0]])
                    limits[value.name] = min(limits.get(value.name, table), table, key=lambda t: t[1])
                elif node.op_type in VIEW_OPS and node.input[0] == tensor:
                    frontier.extend(out for out in node.output if out not in seen)
    return limits

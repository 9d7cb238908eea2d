"""Shape binding: every model input gets a ``TensorSpec``, each dim a size or a range.

Sizes come from ``--input-shape`` flags first, then from the config's ``[inputs]`` defaults by
dim name; a dim still unbound is a ShapeError that says what to pass. A one-element input may
instead be pinned to a value (``--input-value sr=16000``): the model is compiled for that value
(an If on it keeps one branch) and the artifact refuses another. Loading, simplifying and
importing the model are ``onnx.py``'s; this module only decides what each input is.
"""

from __future__ import annotations

import dataclasses
import re

import onnx

from ..errors import ModelError, ShapeError
from .dims import DimRange, Range, concrete_shape, is_dynamic, parse_dim

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
    """A model input: each dim a size, or a ``DimRange`` the artifact accepts any size of; a
    pinned input (``value`` not None) holds that one value at every run."""

    name: str
    shape: tuple[int | DimRange, ...]
    dtype: str
    value: int | float | None = None

    @property
    def dynamic(self) -> bool:
        return is_dynamic(self.shape)

    def to_json(self) -> dict:
        shape = [dim.name if isinstance(dim, DimRange) else dim for dim in self.shape]
        pinned = {} if self.value is None else {"value": self.value}
        return {"name": self.name, "shape": shape, "dtype": self.dtype, **pinned}


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


def parse_value_flag(flag: str) -> tuple[str, int | float] | None:
    """``name=16000`` (a number): the value a one-element input is pinned to; None for a flag
    that is not one (a shape flag)."""
    match = re.fullmatch(r"(.+)=\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)", flag.strip())
    if not match:
        return None
    number = match.group(2)
    return match.group(1), int(number) if re.fullmatch(r"[-+]?\d+", number) else float(number)


def _as_dim(given: Dim, name: str) -> int | DimRange:
    """A flag's or config's dim as a spec dim; a range of one size is that size."""
    if isinstance(given, tuple):
        low, high, step = given
        return low if low == high else DimRange(name, low, high, step)
    return given


def bind_input_shapes(model: onnx.ModelProto, shapes: dict[str, tuple[Dim, ...] | int | float] | None = None,
                      dim_defaults: dict[str, Dim] | None = None) -> list[TensorSpec]:
    """Give every input a shape: explicit shapes first, then config defaults by dim name. A dim
    given as a range stays symbolic (named by ``dynamic_dim_name``); every other dim is static.
    A number in ``shapes`` pins a one-element input to that value."""
    shapes = dict(shapes or {})
    values = {name: shapes.pop(name) for name in list(shapes) if isinstance(shapes[name], (int, float))}
    dim_defaults = dim_defaults or {}
    inputs = graph_inputs(model)
    names = [value.name for value in inputs]
    for name in [*shapes, *values]:
        if name not in names:
            flag = "--input-value" if name in values else "--input-shape"
            raise ShapeError(f"{flag} names {name!r}, which is not an input of the model",
                             f"the model's inputs are: {', '.join(names)}")
    dim_defaults = {**dim_defaults, **_dims_named_by_flags(inputs, shapes)}
    specs = []
    for value in inputs:
        tensor_type = input_tensor_type(value)
        dtype = ONNX_DTYPES.get(tensor_type.elem_type)
        if dtype is None:
            raise ModelError(f"input {value.name!r} has unsupported element type "
                             f"{onnx.TensorProto.DataType.Name(tensor_type.elem_type)}",
                             f"supported: {', '.join(sorted(set(ONNX_DTYPES.values())))}")
        dims = tensor_type.shape.dim
        if value.name in values:
            specs.append(_pinned(value.name, dims, dtype, values[value.name]))
            continue
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


def _pinned(name: str, dims, dtype: str, value: int | float) -> TensorSpec:
    """A one-element input pinned to ``value``: every dim 1 (a dynamic dim too), the value
    representable in the input's type."""
    if any(_fixed(dim) and dim.dim_value != 1 for dim in dims):
        shape = "x".join(str(d.dim_value) if _fixed(d) else "?" for d in dims)
        raise ShapeError(f"--input-value pins input {name!r}, but it has shape {shape}: only a one-element "
                         "input (a scalar such as a sample rate) can be pinned to a value",
                         f"drop --input-value {name}=..., or give its shape with --input-shape")
    integral = dtype not in FLOAT_DTYPES
    if integral and (value != int(value) or (dtype == "bool" and value not in (0, 1))):
        raise ShapeError(f"--input-value {name}={value} is not a {dtype} value",
                         f"pin {name} to {'0 or 1' if dtype == 'bool' else 'an integer'}")
    return TensorSpec(name, (1,) * len(dims), dtype, int(value) if integral else float(value))


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


def input_tensor_type(value: onnx.ValueInfoProto) -> onnx.TypeProto.Tensor:
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


def inputs_at(inputs: list[TensorSpec], sizes: dict[str, int]) -> list[TensorSpec]:
    """The static specs of one run: every symbolic dim at its size in ``sizes``."""
    return [dataclasses.replace(spec, shape=concrete_shape(spec.shape, sizes)) for spec in inputs]

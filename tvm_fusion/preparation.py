"""Preparation: load an ONNX model, bind its input shapes, simplify it and import it into Relax,
bindings named after the ONNX nodes (``provenance``), so that every command reports what it
did in the model's own terms. ``session.ModelSession`` calls this once per model and shape set.

Also the checks every command makes on the shapes before heavy work (memory, one size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import onnx
import psutil
import tvm
from tvm import relax

from .config import PipelineConfig, load_config
from .errors import ShapeError
from .frontend import onnx as onnx_frontend
from .frontend.dims import DimRange, evaluate_dim, ranges_of, var_sizes
from .frontend.if_hoisting import condition_model, take_branch
from .provenance import import_with_node_names

Progress = Callable[[str], None]
# {name: dims or a pinned value} (a dim: a size, or a (low, high, step) range), NAME:DIMxDIM and
# NAME=VALUE flags, or one such flag.
ShapeArg = dict[str, tuple | list | str | int | float] | list[str | tuple[str, tuple | list | str]] | str | None


def quiet(_message: str) -> None:
    """The default ``progress``: says nothing."""


@dataclasses.dataclass
class PreparedModel:
    """An ONNX model with bound input shapes, imported into Relax (before any of our passes)."""

    config: PipelineConfig
    name: str
    onnx_model: onnx.ModelProto
    inputs: list[onnx_frontend.TensorSpec]
    output_names: list[str]
    relax_module: object  # bindings named after the nodes of ``simplified`` (provenance)
    path: Path  # the model file, resolved
    # What was imported, onnxslim's output; its large weights elided (``frontend/initializers.py``):
    # ``simplified_with_weights`` is the whole model.
    simplified: onnx.ModelProto

    def simplified_with_weights(self) -> onnx.ModelProto:
        return onnx_frontend.restore_weights(self.simplified, self.onnx_model)


def resolve_config(config: str | Path | PipelineConfig | None) -> PipelineConfig:
    return config if isinstance(config, PipelineConfig) else load_config(config)


def parse_input_shapes(shapes: ShapeArg) -> dict[str, tuple | int | float]:
    """What a CLI user or a Python caller passes, as ``{name: dims or value}``:

    * ``NAME:DIMxDIM`` / ``NAME=VALUE`` flags, a list of them, or one;
    * a dict ``{name: shape}`` whose shape is a tuple or list of dims, a string ``"1x3x224x224"``,
      or a number (a pinned one-element input);
    * a list of ``(name, shape)`` pairs, with the same shapes.

    A dim may be a range: ``LOW..HIGH[/STEP]`` in a string, a ``(low, high, step)`` tuple in a list.
    """
    if not shapes:
        return {}
    if isinstance(shapes, str):
        shapes = [shapes]
    items: list = list(shapes.items()) if isinstance(shapes, dict) else list(shapes)
    parsed: dict[str, tuple | int | float] = {}
    for item in items:
        if isinstance(item, str):
            name, given = onnx_frontend.parse_value_flag(item) or onnx_frontend.parse_shape_flag(item)
        elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
            name, given = item[0], _python_shape(*item)
        else:
            raise ShapeError(f"input_shapes entry {item!r} is neither a 'NAME:DIMxDIM' string nor a "
                             "(name, shape) pair", "pass e.g. {'input': (1, 3, 224, 224)}, "
                             "['input:1x3x224x224'] or [('input', (1, 3, 224, 224))]")
        if parsed.get(name, given) != given:
            said = " and ".join(_flag_text(name, g) for g in (parsed[name], given))
            raise ShapeError(f"input {name!r} is given twice, differently: {said}",
                             f"pass --input-shape or --input-value once for {name}")
        parsed[name] = given
    return parsed


def _python_shape(name: str, shape) -> tuple | int | float:
    """A shape given from Python: dims, a ``"1x3x224x224"`` string, or a number (pinned value)."""
    if isinstance(shape, str):
        return onnx_frontend.parse_shape_flag(f"{name}:{shape}")[1]
    if isinstance(shape, (int, float)) and not isinstance(shape, bool):
        return shape
    dims = tuple(tuple(d) if isinstance(d, list) else d for d in shape) if isinstance(shape, (tuple, list)) else None
    if dims is None or not all((isinstance(d, int) and not isinstance(d, bool) and d >= 1)
                               or (isinstance(d, tuple) and len(d) == 3 and all(isinstance(v, int) for v in d))
                               for d in dims):
        raise ShapeError(f"input_shapes[{name!r}] is {shape!r}, not a shape",
                         "give positive integer dims, e.g. (1, 3, 224, 224), a string '1x3x224x224', "
                         "or a range dim as (low, high, step)")
    return dims


def _flag_text(name: str, given) -> str:
    return f"--input-value {name}={given}" if isinstance(given, (int, float)) else f"--input-shape {name}:{_dims_flag(given)}"


def _dims_flag(dims) -> str:
    return "x".join(str(DimRange("", *d)) if isinstance(d, tuple) else str(d) for d in dims)


def shapes_text(inputs: list[onnx_frontend.TensorSpec]) -> str:
    """``input_ids:1x1..512, attention_mask:1x1..512, sr=16000`` for messages."""
    return ", ".join(f"{s.name}={s.value}" if s.value is not None else f"{s.name}:{'x'.join(map(str, s.shape))}"
                     for s in inputs)


def check_memory(inputs: list[onnx_frontend.TensorSpec], module=None) -> None:
    """A ShapeError before any heavy work when the bound shapes cannot fit in memory.

    What a compile or bench holds at least: the inputs, plus the largest tensor the model
    computes (from the imported module's types, once there is one), at the high end of every
    range. Without this check a mistyped dim builds the model and then dies allocating its
    test inputs.
    """
    high = {name: r.high for name, r in ranges_of(inputs).items()}
    input_bytes = sum(_tensor_bytes(s.shape, s.dtype) for s in onnx_frontend.inputs_at(inputs, high))
    high_vars = var_sizes(ranges_of(inputs), high)
    largest, described = max(_computed_tensors(module, high_vars), default=(0, "")) if module is not None else (0, "")
    available = psutil.virtual_memory().available
    if input_bytes + largest > available:
        shapes = shapes_text(inputs)
        need = f"{_human_bytes(input_bytes)} for its inputs" + (
            f" plus {_human_bytes(largest)} for its largest intermediate ({described})" if largest else "")
        raise ShapeError(f"at {shapes} the model needs {need}, but only {_human_bytes(available)} of memory "
                         "is available", "pass smaller --input-shape dims (the sizes you deploy with), or "
                         "lower the config's [inputs] defaults")


def _tensor_bytes(shape, dtype: str) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * ((tvm.runtime.DataType(dtype).bits + 7) // 8)


def _computed_tensors(module, high: dict[str, int]):
    """(bytes, 'dtype[shape]') of every tensor bound in ``main``, symbolic dims at ``high``."""
    def sizes(ty):
        if isinstance(ty, relax.TupleType):
            for field in ty.fields:
                yield from sizes(field)
        elif isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
            try:
                shape = [evaluate_dim(dim, high) for dim in ty.shape.values]
            except (TypeError, KeyError):  # a dim no input range bounds (a data-dependent size)
                return
            yield _tensor_bytes(shape, str(ty.dtype)), f"{ty.dtype}{shape}"

    for block in getattr(module["main"].body, "blocks", []):
        for binding in block.bindings:
            yield from sizes(binding.var.ty)


def _human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError("unreachable")


def prepare(model_path: str | Path, config=None, input_shapes: ShapeArg = None,
            progress: Progress = quiet) -> PreparedModel:
    """Load, bind shapes, simplify (onnxslim) and import into Relax."""
    cfg = resolve_config(config)
    model = onnx_frontend.load_onnx(model_path)
    specs = onnx_frontend.bind_input_shapes(model, parse_input_shapes(input_shapes), cfg.dim_defaults)
    check_memory(specs)
    progress("simplifying shape subgraphs at " + shapes_text(specs))
    simplified = onnx_frontend.simplify(model, specs)
    progress(f"importing {len(simplified.graph.node)} ONNX nodes into Relax")
    with cfg.tvm_target():  # the target decides the integer matmul's kernel (frontend/integer_matmul.py)
        module = onnx_frontend.import_model(simplified, specs, importer=import_with_node_names)
    check_memory(specs, module)
    return PreparedModel(cfg, Path(model_path).stem, model, specs, onnx_frontend.output_specs(model), module,
                         Path(model_path).resolve(), onnx_frontend.elide_weights(simplified, model))


def prepare_at(prepared: PreparedModel, config, sizes: dict[str, int], progress: Progress = quiet) -> PreparedModel:
    """``prepared``'s model imported static at one exact size of its ranges (a shape bucket)."""
    shapes: dict = {spec.name: spec.shape if spec.value is None else spec.value
                    for spec in onnx_frontend.inputs_at(prepared.inputs, sizes)}
    return prepare(prepared.path, config, shapes, progress)


def prepare_branch(prepared: PreparedModel, config, condition: str, taken: bool | None) -> PreparedModel:
    """``prepared``'s model as it computes when the If deciding ``condition`` takes the branch
    ``taken`` (``dispatch/branches.py``), or with None only ``condition`` itself, a bool scalar."""
    whole = prepared.simplified_with_weights()
    variant = condition_model(whole, condition) if taken is None else take_branch(whole, condition, taken)
    with config.tvm_target():
        module = onnx_frontend.import_model(variant, prepared.inputs, importer=import_with_node_names)
    outputs = [condition] if taken is None else prepared.output_names
    return PreparedModel(config, prepared.name, prepared.onnx_model, prepared.inputs, outputs, module,
                         prepared.path, onnx_frontend.elide_weights(variant, prepared.onnx_model))


def at_one_size(prepared: PreparedModel, command: str) -> None:
    """Commands that time or tune kernels run at fixed sizes: a ShapeError for a range."""
    ranges = ranges_of(prepared.inputs)
    if ranges:
        listed = ", ".join(f"{name} {r}" for name, r in ranges.items())
        raise ShapeError(f"{command} runs the model at one size, but the input shapes give ranges ({listed})",
                         f"pass fixed sizes to {command} (e.g. the typical size "
                         f"{', '.join(f'{n}={r.typical}' for n, r in ranges.items())})")

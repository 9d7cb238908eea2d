"""ONNX in: load and check, bind dynamic dims, simplify, import into Relax.

Real exporter graphs compute reshape targets with Shape -> Gather -> Concat subgraphs that
TVM 0.27's importer cannot turn into shape expressions. Once every input dim is bound, those
subgraphs are constant, so we let onnxslim fold them at the ONNX level before import. The
original model is kept untouched as the reference for verification.

The rest of tvm_fusion reaches the frontend through this module (``onnx_frontend.X``): shape
binding lives in ``input_binding.py`` and seeded inputs in ``sample_inputs.py``, and their
public names are importable from here too (``__all__``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from tvm import tirx

from ..errors import ModelError
from .converters import from_onnx  # TVM's importer + our converters (Dropout, EyeLike, LSTM, ...)
from .dims import DimRange, concrete_shape, ranges_of, size_points
from .dropout_guard import hide_dropouts, restore_dropouts
from .if_hoisting import deciding_inputs, hoist_ifs, same_shapes, select_known_branches
from .initializers import elide_large_weights, large_initializers_as_inputs, restore_initializers, restore_weights
from .input_binding import (FLOAT_DTYPES, ONNX_DTYPES, TensorSpec, bind_input_shapes, dynamic_dim_name,
                            graph_inputs, input_tensor_type, inputs_at, parse_shape_flag, parse_value_flag)
from .loop_unrolling import unroll_loops
from .op_support import unsupported_ops, unsupported_ops_message
from .qdq_fusion import fuse_qdq_groups
from .sample_inputs import index_tables, random_inputs
from .shape_values import folding_operands, freeze_shape_tensors
from .stepped_dims import add_steps_param

__all__ = [
    "FLOAT_DTYPES", "ONNX_DTYPES", "TensorSpec", "bind_input_shapes", "dynamic_dim_name", "elide_weights", "graph_inputs",
    "import_model", "index_tables", "inputs_at", "load_onnx", "output_specs", "parse_shape_flag", "parse_value_flag",
    "random_inputs", "relax_shape_dict", "restore_weights", "simplify", "with_declared_shapes", "with_range_bounds",
]


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
        with _deprecated_ops_hidden(model):
            onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        first_line = str(err).strip().splitlines()[0]
        raise ModelError(f"{path} is not a valid ONNX model: {first_line}",
                         "re-export the model; onnx.checker.check_model must pass") from err
    return model


# Ops the checker refuses at some opsets as deprecated, that ONNX Runtime and TVM's importer
# still run there as the spec defined them: GroupNormalization 18-20 (scale and bias per group,
# replaced at 21 by per channel). Exporters wrote them, so models with them are real.
_RUN_THOUGH_DEPRECATED = {"GroupNormalization": range(18, 21)}
_UNCHECKED_DOMAIN = "tvm_fusion.unchecked"


@contextlib.contextmanager
def _deprecated_ops_hidden(model: onnx.ModelProto):
    """The model, for the checker, with each ``_RUN_THOUGH_DEPRECATED`` node at such an opset in
    a domain it does not check (changed in place, put back after: no copy of the weights)."""
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    hidden = [node for node in model.graph.node if node.domain in ("", "ai.onnx")
              and opset in _RUN_THOUGH_DEPRECATED.get(node.op_type, ())]
    domains = [node.domain if node.HasField("domain") else None for node in hidden]
    for node in hidden:
        node.domain = _UNCHECKED_DOMAIN
    if hidden:
        model.opset_import.append(onnx.helper.make_opsetid(_UNCHECKED_DOMAIN, 1))
    try:
        yield model
    finally:
        for node, domain in zip(hidden, domains):
            if domain is None:
                node.ClearField("domain")
            else:
                node.domain = domain
        if hidden:
            del model.opset_import[len(model.opset_import) - 1]


def _check_opset(model: onnx.ModelProto, path: Path) -> None:
    """A default-domain opset newer than the installed onnx knows: its ops' meaning is unknown
    here (the checker lets it through, and the importer would guess)."""
    known = onnx.defs.onnx_opset_version()
    declared = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if declared > known:
        raise ModelError(f"{path} declares ONNX opset {declared}, newer than the installed onnx "
                         f"{onnx.__version__} knows (up to opset {known})",
                         f"export the model at opset {known} or lower, or upgrade onnx")


def output_specs(model: onnx.ModelProto) -> list[str]:
    return [value.name for value in model.graph.output]


def simplify(model: onnx.ModelProto, inputs: list[TensorSpec]) -> onnx.ModelProto:
    """``_slim`` of the model with its top-level Ifs inlined (``if_hoisting.py``), where the
    branches then provably select values of one shape; else of the model as it is. QDQ groups
    become the QOperator ops ONNX Runtime runs (``qdq_fusion.py``), so that what is imported,
    and what provenance names nodes after, is that graph."""
    model = with_pinned_values(model, inputs)
    hoisted = hoist_ifs(model)
    if hoisted is not None:
        simplified = _slim(hoisted, inputs)
        if same_shapes(simplified):
            return fuse_qdq_groups(simplified)
    return fuse_qdq_groups(_slim(model, inputs))


def elide_weights(simplified: onnx.ModelProto, model: onnx.ModelProto) -> onnx.ModelProto:
    """``simplified`` without the data of the weights it shares with ``model``, for holding on to
    after import (``PreparedModel.simplified``)."""
    return elide_large_weights(simplified, model, _FOLDED_BYTES)


def with_pinned_values(model: onnx.ModelProto, inputs: list[TensorSpec]) -> onnx.ModelProto:
    """A copy whose nodes (in subgraphs too) read each pinned input's value from an initializer,
    so that what depends on it folds; the input itself stays in the signature, unread."""
    renamed = {spec.name: f"{spec.name}/pinned" for spec in inputs if spec.value is not None}
    if not renamed:
        return model
    pinned = onnx.ModelProto()
    pinned.CopyFrom(model)
    declared = {value.name: value for value in graph_inputs(model)}
    for spec in inputs:
        if spec.value is not None:
            rank = len(input_tensor_type(declared[spec.name]).shape.dim)
            pinned.graph.initializer.append(numpy_helper.from_array(
                np.full((1,) * rank, spec.value, spec.dtype), renamed[spec.name]))

    def rename(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            node.input[:] = [renamed.get(name, name) for name in node.input]
            for attribute in node.attribute:
                for subgraph in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs:
                    rename(subgraph)

    rename(pinned.graph)
    return pinned


# onnxslim folds a computed constant (a shape value, a mask) up to this size. Larger ones are
# weights rewritten at load (int8 or fp16 weights cast and scaled to float32): onnxslim folds
# them through ONNX Runtime and carries the float32 result through every copy of its loop, the
# compile's memory peak; the canonicalize phase folds them in Relax instead, at a fraction.
_FOLDED_BYTES = 64 << 10


def _slim(model: onnx.ModelProto, inputs: list[TensorSpec]) -> onnx.ModelProto:
    """Fold shape subgraphs with onnxslim at the bound shapes; our fusions stay ours.

    With a symbolic dim, only the shape values that are the same at the low, typical and high
    sizes are frozen; the rest stay in the graph for the importer to compute as shape expressions.
    onnxslim refuses some valid graphs (optional-typed values, for one); those go to TVM's
    importer as they are, with the bound shapes, rather than being rejected here.
    """
    # deferred: onnxslim takes ~0.3 s to import, which every `import tvm_fusion` (and so
    # `tvm-fusion --help`) would pay; only simplifying a model needs it.
    import onnxslim
    from onnxslim.core.pattern.registry import DEFAULT_FUSION_PATTERNS  # deferred: the same

    points = size_points(ranges_of(inputs))
    probes = [inputs_at(inputs, sizes) for sizes in points]
    # Shape computations as ONNX Runtime evaluates them (onnxslim's own folding can be wrong).
    feeds = [random_inputs(model, specs, seed=0) for specs in probes]
    model = freeze_shape_tensors(select_known_branches(model, feeds), feeds)
    try:
        if any(spec.dynamic for spec in inputs):
            model, input_shapes = with_declared_shapes(model, inputs), None
        else:
            # onnxslim cannot parse an empty shape: a scalar input keeps its declared one.
            input_shapes = [f"{spec.name}:{','.join(map(str, concrete_shape(spec.shape, {})))}"
                            for spec in inputs if spec.shape]
        # The weights it would not fold go in as inputs: its copies of them were the peak.
        stripped, weights = large_initializers_as_inputs(model, _FOLDED_BYTES, folding_operands(model))
        simplified = restore_initializers(restore_dropouts(onnxslim.slim(
            hide_dropouts(stripped),  # onnxslim would delete every Dropout, training mode too
            input_shapes=input_shapes,
            # onnxslim's own fusions (MatMul+Add -> Gemm, Conv+BN, ...) would pre-empt ours.
            skip_fusion_patterns=[p for p in DEFAULT_FUSION_PATTERNS if p.startswith("Fusion")],
            size_threshold=_FOLDED_BYTES,
        )), model, weights)
        del stripped
    except Exception:  # noqa: BLE001 - any onnxslim failure: let the importer try the original
        return unroll_loops(model, feeds)
    # Loops are unrolled after onnxslim, which takes minutes over the thousands of nodes of an
    # unrolled decoder; the unrolled steps have their index values computed already.
    return unroll_loops(_with_inputs_of(simplified, model), feeds)


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
        shape = input_tensor_type(value).shape
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


def import_model(model: onnx.ModelProto, inputs: list[TensorSpec], importer=None):
    """Import a simplified model into a Relax IRModule with the bound input shapes.

    ``importer(model, shape_dict, dtype_dict)`` is the import itself (default: TVM's importer
    with our converters); ``provenance.import_with_node_names`` is the one that names bindings
    after ONNX nodes. Unsupported ops, importer errors and range bounds are handled here for both.

    Each range becomes one symbolic ``int64`` var shared by every input that has it; ``main``
    records the ranges as ``tir_var_lower_bound``/``tir_var_upper_bound``, so memory is planned
    for the largest size and the schedules know how far a dim goes.
    """
    model = fuse_qdq_groups(model)  # ONNX Runtime's integer ops in place of its QDQ groups
    missing = unsupported_ops(model)
    if missing:
        raise ModelError(*unsupported_ops_message(missing))
    ranges = ranges_of(inputs)
    try:
        module = (importer or from_onnx)(model, relax_shape_dict(inputs), {s.name: s.dtype for s in inputs})
    except ModelError:
        raise  # our converters name the node already
    except Exception as err:
        message = str(err).strip().splitlines()
        fix = ("report the model; check that the input shapes are right" if not ranges else
               "if the model takes only multiples of a stride (detectors: 32), give the range that step "
               "(e.g. 32..640/32); otherwise report the model, and compile it at fixed sizes meanwhile")
        branching = deciding_inputs(model)
        if branching:  # an If on an input whose branches TVM could not import side by side
            fix = (f"the model branches on the value of {', '.join(branching)}: compile it for the value you "
                   f"use, e.g. {' '.join(f'--input-value {name}=VALUE' for name in branching)} (one branch "
                   f"is then compiled); otherwise {fix}")
        what = " with symbolic " + ", ".join(ranges) if ranges else ""
        raise ModelError(f"TVM's ONNX importer failed{what}: "
                         f"{message[-1] if message else type(err).__name__}", fix) from err
    return with_range_bounds(module, inputs)


def relax_shape_dict(inputs: list[TensorSpec]) -> dict[str, list]:
    """The importer's ``shape_dict``: sizes, and one ``int64`` var per range name, shared by
    every input that has it (so Relax knows ``input_ids`` and ``attention_mask`` agree)."""
    ranges = ranges_of(inputs)
    variables = {name: tirx.Var(r.var_name, "int64") * r.step if r.step > 1 else tirx.Var(r.var_name, "int64")
                 for name, r in ranges.items()}
    return {s.name: [variables[d.name] if isinstance(d, DimRange) else d for d in s.shape] for s in inputs}


def with_range_bounds(module, inputs: list[TensorSpec]):
    """``main`` annotated with the ranges (memory is planned for the high end); a stepped
    range's var defined by a leading shape parameter (``stepped_dims.py``)."""
    ranges = ranges_of(inputs)
    if not ranges:
        return module
    module = add_steps_param(module, ranges)
    main = module["main"].with_attr("tir_var_lower_bound", {r.var_name: r.low // r.step for r in ranges.values()})
    module["main"] = main.with_attr("tir_var_upper_bound", {r.var_name: r.high // r.step for r in ranges.values()})
    return module

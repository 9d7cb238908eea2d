"""Shape buckets: static kernels for a few exact sizes inside a dynamic artifact.

A symbolic kernel pays for not knowing its extents (whole tiles plus a shifted or padded tail,
no constant folding of shape arithmetic; docs/dynamic-shapes.md has the measured cost). A bucket
is one point of the ranges (``sequence=128``; ``height=224,width=224``) compiled as a static
model of its own, the way TensorRT's optimization profiles and MLC-LLM's specialized functions
serve their common sizes. ``main`` then dispatches on the exact size:

    main(input_ids: R.Tensor((1, sequence)))
        if sequence == 128: main_at_sequence128(match_cast(input_ids, (1, 128)))
        else:               main_dynamic(input_ids)

Every other size runs the symbolic module, so the artifact still serves the whole range, and a
plain TVM runtime still calls ``main``. Each bucket's functions and kernels take the suffix
``_at_<dims>``: two static builds name their kernels alike.

TVM is imported inside the functions that build Relax: the CLI imports this module at start-up
(``bucket_text``, through ``cli.output``), and ``tvm-fusion --help`` should not wait seconds for it.
"""

from __future__ import annotations

import re

from ..errors import ShapeError
from ..frontend.dims import DimRange
from .renaming import add_renamed

DYNAMIC_MAIN = "main_dynamic"
_BUCKET = re.compile(r"\s*([A-Za-z_][\w.:-]*)\s*=\s*(\d+)\s*")


def parse_bucket(text: str, where: str) -> tuple[tuple[str, int], ...]:
    """``"height=224,width=224"`` -> (("height", 224), ("width", 224)); a ShapeError naming
    ``where`` when it is not NAME=SIZE[,NAME=SIZE...]."""
    point: dict[str, int] = {}
    for item in text.split(","):
        match = _BUCKET.fullmatch(item)
        if not match:
            raise ShapeError(f"{where} has bucket {text!r}, which is not NAME=SIZE[,NAME=SIZE...]",
                             "name each ranged dim with its size, e.g. sequence=128 or height=224,width=224")
        name, size = match.group(1), int(match.group(2))
        if name in point:
            raise ShapeError(f"{where} has bucket {text!r}, which gives dim {name!r} twice", "give each dim once")
        point[name] = size
    return tuple(point.items())


def bucket_text(point) -> str:
    """A bucket as ``--bucket`` writes it: ``height=224,width=224`` (from a dict or its items)."""
    items = point.items() if isinstance(point, dict) else point
    return ",".join(f"{name}={size}" for name, size in items)


def bucket_points(buckets, ranges: dict[str, DimRange]) -> list[dict[str, int]]:
    """The buckets (as parsed) checked against the model's ranges: each gives every ranged dim a
    size inside its range, on its step, and no two are the same point."""
    points: list[dict[str, int]] = []
    for bucket in buckets:
        point = dict(bucket)
        text = bucket_text(bucket)
        if not ranges:
            raise ShapeError(f"bucket {text} is given, but no input dim is a range",
                             "a bucket specializes a dynamic artifact: give a dim a range (e.g. 1x1..512) "
                             "or drop the bucket")
        for name, size in point.items():
            if name not in ranges:
                raise ShapeError(f"bucket {text} names dim {name!r}, which is not a range",
                                 f"the ranged dims are: {', '.join(f'{n} {r}' for n, r in ranges.items())}")
            dim = ranges[name]
            if not dim.low <= size <= dim.high or size % dim.step:
                where = f"inside {dim}" + (f" and a multiple of {dim.step}" if dim.step > 1 else "")
                raise ShapeError(f"bucket {text}: {name}={size} is outside the range {name} {dim}",
                                 f"give a size {where}")
        missing = [name for name in ranges if name not in point]
        if missing:
            raise ShapeError(f"bucket {text} gives no size for {', '.join(repr(n) for n in missing)}",
                             "a bucket is one exact size of every ranged dim: add "
                             + ",".join(f"{n}=SIZE" for n in missing))
        if point in points:
            raise ShapeError(f"bucket {text} is given twice", "list each bucket once")
        points.append(point)
    return points


def bucket_suffix(point: dict[str, int]) -> str:
    """``{"height": 224, "width": 224}`` -> ``_at_height224_width224`` (names stay identifiers)."""
    return "_at_" + "_".join(re.sub(r"\W", "_", f"{name}{size}") for name, size in point.items())


def with_buckets(dynamic, specialized: list[tuple[dict[str, int], object]], ranges: dict[str, DimRange]):
    """One module: ``dynamic``'s functions (its ``main`` renamed ``main_dynamic``), each static
    module of ``specialized`` under its bucket's suffix, and a ``main`` that sends an input of a
    bucket's exact size to that bucket."""
    import tvm  # deferred: keeps TVM out of --help (module docstring)
    from tvm import relax, tirx  # deferred: keeps TVM out of --help (module docstring)

    inner = dynamic["main"]
    dims = {var.name: var for param in inner.params for var in _shape_vars(param.ty) if var.name in ranges}
    params = [relax.Var(p.name, p.ty) for p in inner.params]
    returned = inner.ret_ty
    # A symbolic var may be defined by the parameters of one function only: the dynamic main
    # gets fresh ones, the dispatching main keeps these.
    fresh = inner.bind_symbolic_vars({var: tirx.Var(var.name, "int64")
                                      for param in inner.params for var in _shape_vars(param.ty)})
    dynamic = tvm.IRModule({**{gv: f for gv, f in dynamic.functions_items() if gv.name_hint != "main"},
                            dynamic.get_global_var("main"): fresh}, attrs=dynamic.attrs)

    builder = relax.BlockBuilder()
    dynamic_main = add_renamed(builder, dynamic, lambda name: DYNAMIC_MAIN if name == "main" else name)
    bucket_mains = [(point, add_renamed(builder, module, lambda name, s=bucket_suffix(point): name + s))
                    for point, module in specialized]

    def dispatch(remaining):
        """``if point: bucket main else: <the rest>``, the dynamic main last."""
        if not remaining:
            result = relax.Var("result", returned)
            return relax.SeqExpr([relax.BindingBlock([relax.VarBinding(result, relax.Call(dynamic_main, params))])],
                                 result)
        (point, gvar), rest = remaining[0], remaining[1:]
        static_main = builder.get()[gvar]
        bindings, args = [], []
        for param, static_param in zip(params, static_main.params):
            exact = relax.Var(param.name, static_param.ty)
            bindings.append(relax.MatchCast(exact, param, static_param.ty))
            args.append(exact)
        result = relax.Var("result", static_main.ret_ty)
        bindings.append(relax.VarBinding(result, relax.Call(gvar, args)))
        condition = tirx.all(*[dims[name] == size for name, size in point.items()])
        taken = relax.SeqExpr([relax.BindingBlock(bindings)], result)
        return relax.If(relax.prim_value(condition), taken, dispatch(rest))

    attrs = {key: inner.attrs[key] for key in ("num_input",) if inner.attrs and key in inner.attrs}
    with builder.function("main", params, attrs=attrs or None):
        chosen = builder.emit(dispatch(bucket_mains))
        builder.emit_func_output(builder.match_cast(chosen, returned))
    merged = builder.get()
    return tvm.IRModule(dict(merged.functions_items()), attrs=dynamic.attrs)


def _shape_vars(ty) -> list:
    """The symbolic vars standing alone as dims of a parameter's tensor type (those it defines)."""
    from tvm import tirx  # deferred: keeps TVM out of --help (module docstring)

    shape = getattr(ty, "shape", None)
    return [dim for dim in getattr(shape, "values", None) or [] if isinstance(dim, tirx.Var)]

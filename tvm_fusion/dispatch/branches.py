"""One build per branch of an If that the input values decide, and a ``main`` that runs one.

``frontend/if_hoisting.py`` inlines an If's branches into the graph, each output a ``Where`` on
the condition, so that the patterns fuse and schedule the branches like any other nodes. But
then both branches run on every call, and the one not taken is thrown away: silero VAD's
torch.export model computes its 16 kHz and its 8 kHz networks on every call, twice the work
ONNX Runtime and OpenVINO (which run the If) do.

Where an If is still undecided once the shapes are bound (its condition reads an input's value,
``sr``), and the branches hold most of the weights, each branch becomes a static model of its
own (the If replaced by that branch, ``preparation.prepare_branch``), built through every phase,
and so does the condition alone. ``main`` then runs the condition and calls one branch's model:

    main(input, sr, state)
        if main_condition(input, sr, state): main_then(input, sr, state)
        else:                                main_else(input, sr, state)

Each build's functions and kernels take its suffix (``_then``, ``_else``, ``_condition``), as a
shape bucket's take theirs. What the branches share outside the If is built (and its weights
stored) once per branch: with more than ``MAX_SHARED_WEIGHTS`` of the weights outside the
branches, the If stays inlined. Models with ranged dims or shape buckets, and models with more
than one undecided If, keep both branches inlined too.

TVM is imported inside the function that builds Relax, as ``buckets.py`` does.
"""

from __future__ import annotations

from ..frontend.dims import ranges_of
from ..frontend.if_hoisting import shared_weight_share, undecided_conditions
from .renaming import add_renamed

# The largest share of the weights outside the branches (read by both) for which a build per
# branch is made: above it, the copy costs more artifact and compile time than the branch saves.
MAX_SHARED_WEIGHTS = 0.5

SUFFIXES = {True: "_then", False: "_else", None: "_condition"}


def branch_condition(prepared) -> str | None:
    """The condition of the one If in ``prepared``'s model (a ``PreparedModel``) that the input
    values decide, when a build per branch pays; None to keep both branches inlined."""
    if ranges_of(prepared.inputs):
        return None
    conditions = undecided_conditions(prepared.simplified)
    if len(conditions) != 1 or shared_weight_share(prepared.simplified, conditions[0]) > MAX_SHARED_WEIGHTS:
        return None
    return conditions[0]


def with_branches(condition, taken, not_taken):
    """One module: the functions of ``condition`` (whose ``main`` returns the If's condition, a
    bool scalar), of ``taken`` (the model when it is true) and of ``not_taken``, each under its
    suffix, and a ``main`` that calls one of the last two on what the first returns."""
    import tvm  # deferred: keeps TVM out of --help (module docstring)
    from tvm import relax  # deferred: keeps TVM out of --help (module docstring)

    builder = relax.BlockBuilder()
    condition_main = add_renamed(builder, condition, lambda name: name + SUFFIXES[None])
    branch_mains = {flag: add_renamed(builder, module, lambda name, flag=flag: name + SUFFIXES[flag])
                    for flag, module in ((True, taken), (False, not_taken))}
    inner = taken["main"]
    params = [relax.Var(p.name, p.ty) for p in inner.params]

    def call(flag):
        result = relax.Var("result", inner.ret_ty)
        return relax.SeqExpr([relax.BindingBlock([relax.VarBinding(result, relax.Call(branch_mains[flag], params))])],
                             result)

    attrs = {key: inner.attrs[key] for key in ("num_input",) if inner.attrs and key in inner.attrs}
    with builder.function("main", params, attrs=attrs or None):
        flag = builder.emit(relax.Call(condition_main, params))
        chosen = builder.emit(relax.If(flag, call(True), call(False)))
        builder.emit_func_output(chosen)
    merged = builder.get()
    return tvm.IRModule(dict(merged.functions_items()), attrs=taken.attrs)

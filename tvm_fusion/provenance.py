"""Which ONNX node each Relax binding computes, so that ``inspect`` can name what a fusion absorbed.

TVM's ONNX importer keeps no node names (no spans; bindings are ``lv0, lv1, ...``). Importing
through a subclass of its importer that notes the expression each node converts to lets us
rename every binding ``onnx<i>`` / ``onnx<i>_<k>`` after the node it belongs to (``k`` numbers
the extra bindings a converter emits, e.g. Gemm's matmul before its bias add). The pattern
passes keep variable names, so the names in a PatternReport's instances lead back to nodes.
"""

from __future__ import annotations

import re

import onnx
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .frontend.converters import Importer
from .passes.rebinding import rebind

_NAME = re.compile(r"^onnx(\d+)(?:_\d+)?$")


def import_with_node_names(model: onnx.ModelProto, shapes: dict[str, list[int]],
                           dtypes: dict[str, str]) -> tvm.IRModule:
    """``model`` imported as ``frontend.onnx.import_model`` does (the same importer, with our
    converters, so inspect sees what compile builds), bindings named after nodes."""
    class RecordingImporter(Importer):
        """Notes each converted node by its first output: node names may be empty or repeated
        (exporters and hand edits leave them so), output names are unique."""

        converted: list[tuple[str, relax.Expr]] = []
        current = ""

        def _parse_value_proto(self, value_proto):
            if isinstance(value_proto, onnx.NodeProto):  # called once per node, just before its conversion
                self.current = _first_output(value_proto)
            return super()._parse_value_proto(value_proto)

        def _convert_operator(self, op_name, inputs, attrs, opset):
            expr = super()._convert_operator(op_name, inputs, attrs, opset)
            self.converted.append((self.current, expr))
            return expr

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    importer = RecordingImporter(shapes, dtypes)
    importer.converted = []
    module = importer.from_onnx(model.graph, opset)
    index = {_first_output(node): i for i, node in enumerate(model.graph.node)}
    names = _binding_names(module["main"], [(index.get(n, -1), e) for n, e in importer.converted])
    module["main"] = _Rename(names, module).visit_expr(module["main"])
    return module


def node_index(var_name: str, model: onnx.ModelProto) -> int | None:
    """The index in ``model.graph.node`` of the node a binding named by
    ``import_with_node_names`` belongs to, or None for another name."""
    match = _NAME.match(var_name or "")
    if not match or int(match.group(1)) >= len(model.graph.node):
        return None
    return int(match.group(1))


def _first_output(node: onnx.NodeProto) -> str:
    return next((name for name in node.output if name), "")


def _binding_names(func: relax.Function, converted: list[tuple[int, relax.Expr]]) -> dict:
    """Var -> new name: a node's own expression first, then what its converter emitted for it."""
    var2val = relax.analysis.get_var2val(func)
    bound = {value: var for var, value in var2val.items()}
    names: dict = {}
    for node, expr in converted:
        var = bound.get(expr)
        if var is not None and node >= 0 and var not in names:
            names[var] = f"onnx{node}"
    for node, expr in converted:
        if node < 0:
            continue
        claimed, pending = 0, [expr]
        while pending:  # a worklist, not recursion: an unrolled LSTM's chain is thousands deep
            visited: list = []
            relax.analysis.post_order_visit(pending.pop(), visited.append)
            for e in visited:
                # A binding's variable, or a value bound later as is (a tuple field, an output).
                var = e if isinstance(e, relax.Var) and e in var2val else bound.get(e)
                if var is not None and var not in names:
                    claimed += 1
                    names[var] = f"onnx{node}_{claimed}"
                    pending.append(var2val[var])  # what it was computed from
    return names


@mutator
class _Rename(PyExprMutator):
    """Rebinds each variable under its new name; types and values are unchanged."""

    def __init__(self, names: dict, mod: tvm.IRModule):
        super().__init__(mod)
        self.names = names

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        old = binding.var
        # An alias (the graph output ``gv = lv``) takes its value's name: passes fold it away.
        alias = binding.value if isinstance(binding.value, relax.Var) else None
        name = self.names.get(old) or (self.names.get(alias) if alias is not None else None) or old.name
        self.set_var_remap(old, rebind(self.builder_, old, value, name))


def node_label(model: onnx.ModelProto, index: int) -> str:
    """A node as reports name it: its name, or ``#index`` for an unnamed one."""
    return model.graph.node[index].name or f"#{index}"


def onnx_node_indices(names: list[str], report, model: onnx.ModelProto) -> list[int]:
    """The ONNX nodes (indices, in order) behind binding names of the node-named import, through
    the rewrites (a rewritten op stands for the chain it replaced)."""
    rewrites = {i.output: i.absorbed for i in report.instances if i.variant == i.pattern}
    found: set[int] = set()
    pending, seen = list(names), set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        pending += rewrites.get(name, [])
        index = node_index(name, model)
        if index is not None:
            found.add(index)
    return sorted(found)


def onnx_nodes_of(names: list[str], report, model: onnx.ModelProto) -> list[str]:
    """``onnx_node_indices`` as the nodes' labels."""
    return [node_label(model, i) for i in onnx_node_indices(names, report, model)]


def kernel_onnx_indices(kernel_bindings: dict[str, list[str]], report,
                        model: onnx.ModelProto) -> dict[str, list[int]]:
    """Kernel -> the ONNX nodes (indices) it covers, from the binding names each kernel computes
    (``session.Lowered.kernel_bindings``) and the fusions that absorbed them."""
    fusions = [set(i.absorbed) for i in report.instances if i.variant != i.pattern]
    covers = {}
    for kernel, names in kernel_bindings.items():
        # FuseOpsByPattern renames the tail a composite absorbed (to gv, lv49, ...); its
        # instance has the node names. Only node names identify the instance.
        own = {name for name in names if node_index(name, model) is not None}
        names = names + [name for absorbed in fusions if absorbed & own for name in absorbed]
        covers[kernel] = onnx_node_indices(names, report, model)
    return covers


def kernel_onnx_nodes(kernel_bindings: dict[str, list[str]], report, model: onnx.ModelProto) -> dict[str, list[str]]:
    """``kernel_onnx_indices`` as the nodes' labels."""
    return {kernel: [node_label(model, i) for i in indices]
            for kernel, indices in kernel_onnx_indices(kernel_bindings, report, model).items()}

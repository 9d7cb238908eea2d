"""ONNX Loops whose step count the bound shapes fix, unrolled into the main graph.

TVM's importer has no Loop. A decoder exported from Paddle (SLANet's table decoder: 501
greedy steps of an attention GRU) is a Loop whose condition reads only its step counter and
constants, so once the input shapes are bound the number of steps is known. Each step becomes
a copy of the body's data nodes. What the body computes from the counter, shapes and
constants alone (the condition, the row a step writes, its Range/Tile index tensors) is taken
from ONNX Runtime running the body step by step on sample inputs, and written in as
constants: the unrolled graph has static shapes, which our patterns see. State the body
passes on unchanged is read in place, and a computation every step would repeat on it (a
projection of the encoder's output) runs once, before the first step. The unrolling runs
after onnxslim, which would take minutes over the thousands of nodes it writes.

A Loop whose step count depends on data (an early stop at an end token) cannot be unrolled:
it is refused with that reason, naming the node.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from ..errors import ModelError
from .shape_values import NOT_DETERMINISTIC, SHAPE_ONLY, evaluate, shape_dependent

MAX_STEPS = 4096


def unroll_loops(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> onnx.ModelProto:
    """``model`` with each top-level Loop unrolled; unchanged when it has none.

    ``feeds`` are sample inputs at each probed size: the steps must come out the same at all of
    them (a model compiled for a range of sizes whose step count follows the size is refused)."""
    if not any(_is_loop(node) for node in model.graph.node):
        return model
    nodes, constants = [], []
    for index, node in enumerate(model.graph.node):
        if not _is_loop(node):
            nodes.append(node)
            continue
        # Each Loop's inputs are computed by ONNX Runtime on the original model, which runs Loops.
        copies, initializers = _Unrolling(model, node, node.name or f"Loop_{index}", feeds).run()
        nodes += copies
        constants += initializers
    unrolled = onnx.ModelProto()
    unrolled.CopyFrom(model)
    del unrolled.graph.node[:]
    unrolled.graph.node.extend(nodes)
    unrolled.graph.initializer.extend(constants)
    return unrolled


def _is_loop(node: onnx.NodeProto) -> bool:
    return node.op_type == "Loop" and node.domain in ("", "ai.onnx")


class _Unrolling:
    """One Loop node: which body values are state-independent, the step-by-step run, the copies."""

    def __init__(self, model: onnx.ModelProto, loop: onnx.NodeProto, name: str, feeds: list):
        self.model, self.loop, self.name, self.feeds = model, loop, name, feeds
        self.body = next(a.g for a in loop.attribute if a.name == "body")
        self.carried = len(loop.input) - 2
        self.scans = len(self.body.output) - 1 - self.carried
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for node in self.body.node for a in node.attribute):
            self._refuse("its body holds an If or a Loop of its own", "")
        self.producers = {out: node for node in self.body.node for out in node.output if out}
        self.local = {value.name for value in self.body.input} | set(self.producers)
        self.own_initializers = {init.name: numpy_helper.to_array(init) for init in self.body.initializer}
        # Names the body reads from the outer graph: ONNX Runtime's run of the body takes them as inputs.
        self.outer_reads = sorted({name for node in self.body.node for name in node.input if name}
                                  - self.local - set(self.own_initializers))
        self.outer_constants = {init.name: numpy_helper.to_array(init) for init in self.model.graph.initializer}
        self.constants = self.outer_constants | self.own_initializers
        self.constants.update({node.output[0]: numpy_helper.to_array(node.attribute[0].t) for node in self.body.node
                               if node.op_type == "Constant" and node.attribute[0].name == "value"})
        # Carried values the body passes on unchanged (weights, encoder output): read in place.
        self.invariant = {self.body.input[2 + k].name: self.loop.input[2 + k] for k in range(self.carried)
                          if self._source(self.body.output[1 + k].name) == self.body.input[2 + k].name}
        self.static = self._state_independent()

    def _refuse(self, why: str, fix: str) -> None:
        raise ModelError(f"Loop {self.name} cannot be unrolled: {why} (TVM has no Loop import; "
                         "tvm_fusion unrolls Loops whose step count the input shapes fix)",
                         fix or "export the model with its step count fixed, or run it in ONNX Runtime")

    def _state_independent(self) -> set[str]:
        """Body values computed from the step counter, shapes, constants and state-independent
        carried values alone (carried values whose initial value and update are such)."""
        outer_static, _ = shape_dependent(self.model)
        outer_static |= {"", *self.outer_constants}
        inputs = [value.name for value in self.body.input]
        candidates = {k for k in range(self.carried) if self.loop.input[2 + k] in outer_static}
        cond_static = self.loop.input[1] in outer_static
        while True:
            seeds = {inputs[0]} | {inputs[2 + k] for k in candidates} | ({inputs[1]} if cond_static else set())
            static = self._closure(seeds)
            kept = {k for k in candidates if self.body.output[1 + k].name in static}
            cond_kept = cond_static and self.body.output[0].name in static
            if kept == candidates and cond_kept == cond_static:
                return static
            candidates, cond_static = kept, cond_kept

    def _closure(self, seeds: set[str]) -> set[str]:
        static = set(seeds) | set(self.own_initializers)
        for node in self.body.node:  # topologically sorted
            if node.op_type in NOT_DETERMINISTIC:
                continue
            reads = [name for name in node.input if name]
            if node.op_type in SHAPE_ONLY or node.op_type == "Constant" or all(
                    name in static or (name not in self.local and name in self.outer_constants) for name in reads):
                static.update(out for out in node.output if out)
        return static

    def _frontier(self) -> list[str]:
        """State-independent values that a data node, a carried output or a scan output reads."""
        names = []
        outputs = [self._source(value.name) for value in self.body.output]
        for name in [n for node in self._needed(outputs) for n in node.input] + outputs:
            if (name and name in self.static and name not in self.invariant and name not in self.own_initializers
                    and name not in names):
                names.append(name)
        return names

    def run(self) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
        if self.loop.input[0] == "" and self.loop.input[1] == "":
            self._refuse("it has neither a trip count nor a condition", "")
        if self.body.output[0].name not in self.static and self.loop.input[1] != "":
            self._refuse("its condition depends on data values (an early stop), so its step count is not "
                         "known when it is compiled", "")
        frontier = self._frontier()
        runs = [self._simulate(feed, frontier) for feed in self.feeds]
        steps = [len(run) for run in runs]
        if len(set(steps)) > 1:
            self._refuse(f"its step count follows the input size ({', '.join(map(str, steps))} steps at the "
                         "probed sizes)", "compile at fixed input sizes")
        per_step = runs[0]
        for other in runs[1:]:
            if not all(_same(a[n], b[n]) for a, b in zip(per_step, other) for n in frontier):
                self._refuse("its index values follow the input size", "compile at fixed input sizes")
        return self._copies(per_step, frontier)

    def _simulate(self, feed: dict, frontier: list[str]) -> list[dict]:
        """The body run by ONNX Runtime step by step on ``feed``: each step's frontier values."""
        known = self.outer_constants | feed
        wanted = [name for name in dict.fromkeys([*self.loop.input, *self.outer_reads]) if name and name not in known]
        values = evaluate(self.model, wanted, [feed]) if wanted else [[]]
        if values is None:
            self._refuse("ONNX Runtime could not compute its inputs at the bound shapes", "")
        known.update(zip(wanted, values[0]))
        trip = int(np.asarray(known[self.loop.input[0]]).reshape(-1)[0]) if self.loop.input[0] else None
        cond = bool(np.asarray(known[self.loop.input[1]]).reshape(-1)[0]) if self.loop.input[1] else True
        state = [known[name] for name in self.loop.input[2:]]
        session, names = self._body_session(known, frontier, state)
        per_step, step = [], 0
        while cond and (trip is None or step < trip):
            if step == MAX_STEPS:
                self._refuse(f"it runs more than {MAX_STEPS} steps", "")
            feed_body = {self.body.input[0].name: np.asarray(step, np.int64),
                         self.body.input[1].name: np.asarray(cond),
                         **{value.name: v for value, v in zip(self.body.input[2:], state)},
                         **{name: known[name] for name in self.outer_reads}}
            out = dict(zip(names, session.run(names, feed_body)))
            previous = per_step[-1] if per_step else {}
            per_step.append({name: previous[name] if name in previous and _same(previous[name], out[name])
                             else out[name] for name in frontier})
            if self.loop.input[1]:
                cond = bool(np.asarray(out[self.body.output[0].name]).reshape(-1)[0])
            state = [out[value.name] for value in self.body.output[1:1 + self.carried]]
            step += 1
        if not per_step and self.scans:
            self._refuse("it runs no step, and its scan outputs would be empty", "")
        return per_step

    def _body_session(self, known: dict, frontier: list[str], state: list):
        """An ONNX Runtime session of the body as a model of its own (outer values as inputs)."""
        graph = onnx.GraphProto()
        graph.CopyFrom(self.body)
        del graph.input[:]
        examples = {self.body.input[0].name: np.asarray(0, np.int64), self.body.input[1].name: np.asarray(True),
                    **{value.name: v for value, v in zip(self.body.input[2:], state)},
                    **{name: known[name] for name in self.outer_reads}}
        for name, example in examples.items():
            example = np.asarray(example)
            graph.input.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(example.dtype), list(example.shape)))
        body_model = helper.make_model(graph, opset_imports=list(self.model.opset_import),
                                       ir_version=self.model.ir_version)
        try:
            inferred = onnx.shape_inference.infer_shapes(body_model)
        except Exception:  # noqa: BLE001 - inference may reject it; ORT needs only the types below
            inferred = body_model
        types = {v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.value_info, *inferred.graph.output,
                                                               *inferred.graph.input)}
        outputs = [value.name for value in self.body.output]
        extra = [name for name in frontier if name not in outputs]
        if not all(types.get(name) for name in extra):
            self._refuse("the element types of its index values are unknown", "")
        body_model.graph.output.extend(helper.make_tensor_value_info(name, types[name], None) for name in extra)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        try:
            session = ort.InferenceSession(body_model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
        except Exception as err:  # noqa: BLE001 - name the Loop, whatever ORT says
            self._refuse(f"ONNX Runtime cannot run its body alone ({str(err).splitlines()[0]})", "")
        return session, outputs + extra

    def _copies(self, per_step: list[dict], frontier: list[str]):
        """The unrolled nodes, and the constants they read (one initializer per distinct value).

        Data nodes whose inputs are the same at every step (a projection of the encoder output
        by a weight) are computed once, before the first step."""
        constants: dict[str, onnx.TensorProto] = {}
        named: dict[int, tuple] = {}  # id of a step's value -> (it, its initializer): steps share unchanged values

        def constant(value) -> str:
            if id(value) in named:
                return named[id(value)][1]
            array = np.asarray(value)
            key = hashlib.sha1(f"{array.dtype}{array.shape}".encode() + array.tobytes()).hexdigest()[:16]
            name = f"{self.name}/const_{key}"
            named[id(value)] = (value, name)
            if name not in constants:
                constants[name] = numpy_helper.from_array(array, name)
            return name

        body_inputs = [value.name for value in self.body.input]
        outputs = [self._source(value.name) for value in self.body.output]
        data_nodes = self._needed(outputs)
        fixed = {name for name in frontier if all(values[name] is per_step[0][name] for values in per_step)}
        names = dict(self.invariant) | {name: constant(per_step[0][name]) for name in fixed}
        names.update({name: constant(value) for name, value in self.own_initializers.items()})
        nodes, stepped = [], []
        for node in data_nodes:
            if all(not name or name in names or name not in self.local for name in node.input):
                nodes.append(self._copy(node, f"{self.name}/invariant/", names))
            else:
                stepped.append(node)
        state = list(self.loop.input[2:])  # the current name of each carried value that is data
        scan_parts = [[] for _ in range(self.scans)]
        for step, values in enumerate(per_step):
            step_names = names | {name: constant(values[name]) for name in frontier if name not in fixed}
            step_names.update({body_inputs[2 + k]: state[k] for k in range(self.carried)
                               if body_inputs[2 + k] not in self.static and body_inputs[2 + k] not in self.invariant})
            nodes += [self._copy(node, f"{self.name}/step{step}/", step_names) for node in stepped]
            results = [step_names.get(name, name) for name in outputs]
            state = results[1:1 + self.carried]
            for j in range(self.scans):
                scan_parts[j].append(results[1 + self.carried + j])
        for k, out in enumerate(self.loop.output[:self.carried]):
            if out:
                nodes.append(helper.make_node("Identity", [state[k]], [out], name=f"{self.name}/{out}"))
        axis = constant(np.zeros(1, np.int64))
        for j, out in enumerate(self.loop.output[self.carried:]):
            if not out:
                continue
            rows = []
            for step, part in enumerate(scan_parts[j]):
                rows.append(f"{self.name}/step{step}/{out}/row")
                nodes.append(helper.make_node("Unsqueeze", [part, axis], [rows[-1]], name=rows[-1]))
            nodes.append(helper.make_node("Concat", rows, [out], name=f"{self.name}/{out}", axis=0))
        return nodes, list(constants.values())

    @staticmethod
    def _copy(node: onnx.NodeProto, prefix: str, names: dict[str, str]) -> onnx.NodeProto:
        """``node`` with its outputs prefixed (recorded in ``names``) and its inputs renamed."""
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = prefix + (node.name or node.output[0])
        copy.input[:] = [names.get(name, name) for name in node.input]
        for out in node.output:
            if out:
                names[out] = prefix + out
        copy.output[:] = [names.get(name, name) for name in node.output]
        return copy

    def _needed(self, outputs: list[str]) -> list[onnx.NodeProto]:
        """The data nodes (not state-independent) that the carried and scan outputs read, in order."""
        needed, work = set(), [name for name in outputs if name not in self.static]
        while work:
            node = self.producers.get(work.pop())
            if node is None or id(node) in needed:
                continue
            needed.add(id(node))
            work += [name for name in node.input if name and name not in self.static]
        return [node for node in self.body.node if id(node) in needed]

    def _source(self, name: str) -> str:
        """The value ``name`` equals, seen through Identity, an Unsqueeze undone by a Squeeze, and
        adding zero or multiplying by one (paddle2onnx's ``assign`` writes all of them)."""
        producers = self.producers
        while name in producers:
            node = producers[name]
            if node.op_type == "Identity":
                name = node.input[0]
            elif node.op_type == "Squeeze":
                inner = producers.get(self._source(node.input[0]))
                if inner is None or inner.op_type != "Unsqueeze" or self._axes(inner) != self._axes(node) or (
                        self._axes(node) is None):
                    return name
                name = inner.input[0]
            elif node.op_type in ("Add", "Sub", "Mul", "Div"):
                neutral = 0 if node.op_type in ("Add", "Sub") else 1
                operand = self._neutral_operand(node, neutral)
                if operand is None:
                    return name
                name = operand
            else:
                return name
        return name

    def _neutral_operand(self, node: onnx.NodeProto, neutral: int) -> str | None:
        """The operand of ``node`` that it returns unchanged: the other operand is a one-element
        constant ``neutral`` that cannot broadcast it (a scalar, or a vector beside an Unsqueeze's
        output, which has a dim)."""
        sides = [(0, 1), (1, 0)] if node.op_type in ("Add", "Mul") else [(0, 1)]
        for keep, other in sides:
            value = self.constants.get(node.input[other])
            if value is None or value.size != 1 or value.reshape(-1)[0] != neutral:
                continue
            widening = value.ndim > 1 or (value.ndim == 1 and getattr(self.producers.get(node.input[keep]), "op_type",
                                                                       None) != "Unsqueeze")
            if not widening:
                return node.input[keep]
        return None

    def _axes(self, node: onnx.NodeProto) -> tuple | None:
        """An Unsqueeze's or Squeeze's axes, from its attribute (opset < 13) or constant input."""
        for attribute in node.attribute:
            if attribute.name == "axes":
                return tuple(attribute.ints)
        value = self.constants.get(node.input[1]) if len(node.input) > 1 else None
        return None if value is None else tuple(int(v) for v in value.reshape(-1))


def _same(a, b) -> bool:
    return np.shape(a) == np.shape(b) and np.array_equal(a, b)


"""ONNX LSTM and GRU as Relax (TVM's importer has no converter for either; CRNN OCR models use them).

The recurrence is unrolled over the (static) sequence length. The input projection of every
time step is one matmul up front (``X·Wᵀ + biases`` for all steps at once), so each step only
multiplies the hidden state by ``Rᵀ`` and applies the gate math, which TVM's FuseOps and our
``gemm_epilogue`` turn into a few kernels per step. Directions are forward, reverse and
bidirectional; layouts 0 (time-major) and 1 (batch-major); biases, initial states and LSTM
peepholes are optional; ``clip`` bounds the gate pre-activations as ONNX Runtime does.
ONNX Runtime's DynamicQuantizeLSTM (``quantize_dynamic``'s LSTM: int8 weights, each product's
left operand quantized to uint8 at run time) is the LSTM with those products computed as
ONNX Runtime computes them (``quantized.py``).
``sequence_lens`` is taken only when it is absent or a constant equal to the sequence length
for every batch entry; ``input_forget`` is refused. Both name the node when they refuse.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op as R

from ..errors import ModelError
from .quantized import DynamicQuantization, centered_constant, constant_array

# ONNX's default activations: LSTM (f, g, h), GRU (f, g); repeated per direction.
_DEFAULTS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "DynamicQuantizeLSTM": ("Sigmoid", "Tanh", "Tanh"),
             "GRU": ("Sigmoid", "Tanh")}


def _activation(name: str, alpha: float | None, beta: float | None, dtype: str) -> Callable[[relax.Expr], relax.Expr]:
    if name == "Sigmoid":
        return R.sigmoid
    if name == "Tanh":
        return R.tanh
    if name == "Relu":
        return R.nn.relu
    if name == "HardSigmoid":  # ONNX defaults alpha 0.2, beta 0.5
        a, b = (0.2 if alpha is None else alpha), (0.5 if beta is None else beta)
        return lambda x: R.clip(R.add(R.multiply(x, relax.const(a, dtype)), relax.const(b, dtype)), 0.0, 1.0)
    raise KeyError(name)


class _FloatProducts:
    """``x · W[d]ᵀ`` and ``h · R[d]ᵀ`` with ONNX's float weights ([dirs, gates*hidden, K])."""

    def __init__(self, rnn: "_Recurrence", weights: relax.Expr, recurrent: relax.Expr):
        self.rnn, self.weights, self.recurrent_weights = rnn, weights, recurrent

    def _product(self, weights: relax.Expr, direction: int) -> Callable[[relax.Expr], relax.Expr]:
        transposed = self.rnn.bb.emit(R.permute_dims(self.rnn.direction_slice(weights, direction), [1, 0]))
        return lambda left: R.matmul(left, transposed)

    def input(self, direction: int) -> Callable[[relax.Expr], relax.Expr]:
        return self._product(self.weights, direction)

    def recurrent(self, direction: int) -> Callable[[relax.Expr], relax.Expr]:
        return self._product(self.recurrent_weights, direction)


class _QuantizedProducts:
    """DynamicQuantizeLSTM's products: int8 weights stored transposed ([dirs, K, gates*hidden])
    with a scale and zero point per direction or per gate column. Each product quantizes its
    left operand (all of it: every step's input at once, or one step's hidden state), as
    ONNX Runtime's quantized LSTM does, and scales the whole-number product by both scales."""

    def __init__(self, rnn: "_Recurrence", inputs: list, constant):
        node = f"{rnn.kind} node {rnn.name!r}"

        def weight(what: str, indices: tuple[int, int, int]) -> tuple[list, list]:
            values, scale, zero_point = (constant_array(inputs[i], constant, node, f"{what} {part}")
                                         for i, part in zip(indices, ("weights", "scale", "zero point")))
            centered = [centered_constant(values[d], zero_point[d], channel_axis=1) for d in range(len(values))]
            return centered, [np.asarray(scale[d], np.float32) for d in range(len(values))]

        self.rnn = rnn
        self.input_weights = weight("input", (1, 8, 9))  # W, W_scale, W_zero_point
        self.recurrent_weights = weight("recurrent", (2, 10, 11))  # R, R_scale, R_zero_point

    def _product(self, weights: tuple, direction: int) -> Callable[[relax.Expr], relax.Expr]:
        bb = self.rnn.bb
        centered, scale = relax.const(weights[0][direction]), relax.const(weights[1][direction])

        def product(left: relax.Expr) -> relax.Expr:
            quantized = DynamicQuantization(bb, bb.normalize(left))
            return R.multiply(R.matmul(quantized.centered(bb), centered), R.multiply(quantized.scale, scale))

        return product

    def input(self, direction: int) -> Callable[[relax.Expr], relax.Expr]:
        return self._product(self.input_weights, direction)

    def recurrent(self, direction: int) -> Callable[[relax.Expr], relax.Expr]:
        return self._product(self.recurrent_weights, direction)


class _Recurrence:
    """What LSTM and GRU share: attributes, inputs in time-major form, per-direction weights."""

    def __init__(self, bb: relax.BlockBuilder, kind: str, inputs: list, attrs: dict, constant,
                 quantized: bool = False):
        self.bb, self.kind = bb, kind
        self.name = attrs["tvm_custom"]["name"] or "(unnamed)"
        direction = attrs.get("direction", b"forward")
        self.direction = direction.decode() if isinstance(direction, bytes) else str(direction)
        if self.direction not in ("forward", "reverse", "bidirectional"):
            self.refuse(f"direction {self.direction!r}", "use forward, reverse or bidirectional")
        self.directions = 2 if self.direction == "bidirectional" else 1
        self.layout = int(attrs.get("layout", 0))
        self.clip = attrs.get("clip")
        if int(attrs.get("input_forget", 0)):
            self.refuse("input_forget = 1 (coupled input and forget gates)",
                        "re-export without input_forget; ONNX Runtime does not run it either")
        x = inputs[0]
        if self.layout == 1:  # [batch, seq, input] -> [seq, batch, input]
            x = bb.emit(R.permute_dims(x, [1, 0, 2]))
        self.x = x
        self.steps, self.batch = int(x.ty.shape[0]), int(x.ty.shape[1])
        self.dtype = str(x.ty.dtype)
        self.activations = self._activations(attrs)
        self.weights, self.recurrent = inputs[1], inputs[2]
        self.hidden = int(attrs.get("hidden_size", int(self.recurrent.ty.shape[1 if quantized else -1])))
        self.products = (_QuantizedProducts(self, inputs, constant) if quantized
                         else _FloatProducts(self, self.weights, self.recurrent))
        self.bias = self._optional(inputs, 3)
        self._check_sequence_lens(self._optional(inputs, 4), constant)
        self.initial_h = self._state(self._optional(inputs, 5))

    def refuse(self, what: str, fix: str):
        raise ModelError(f"{self.kind} node {self.name!r}: {what} is not supported", fix)

    def _activations(self, attrs: dict) -> list:
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in attrs.get("activations", ())]
        count = len(_DEFAULTS[self.kind])
        names = names or list(_DEFAULTS[self.kind]) * self.directions
        alphas = list(attrs.get("activation_alpha", ()))
        betas = list(attrs.get("activation_beta", ()))
        functions = []
        for index, name in enumerate(names):
            try:
                functions.append(_activation(name, alphas[index] if index < len(alphas) else None,
                                             betas[index] if index < len(betas) else None, self.dtype))
            except KeyError:
                self.refuse(f"activation {name!r}", "use Sigmoid, Tanh, Relu or HardSigmoid")
        return [functions[d * count:(d + 1) * count] for d in range(self.directions)]

    @staticmethod
    def _optional(inputs: list, index: int):
        return inputs[index] if len(inputs) > index and inputs[index] is not None else None

    def _check_sequence_lens(self, lens, constant) -> None:
        if lens is None:
            return
        value = constant(lens)
        if not isinstance(value, tvm.ir.GenericConst) or not np.all(value.value.numpy() == self.steps):
            self.refuse("sequence_lens other than the full sequence length for every batch entry",
                        "drop the sequence_lens input (pad the batch), or make it a constant equal "
                        f"to the sequence length {self.steps}")

    def _state(self, state):
        """An initial state in [directions, batch, hidden] (layout 1 stores [batch, directions, hidden])."""
        if state is None:
            return None
        return self.bb.emit(R.permute_dims(state, [1, 0, 2])) if self.layout == 1 else state

    def direction_slice(self, tensor, direction: int):
        """``tensor[direction]`` of a per-direction weight, bias or state."""
        return self.bb.emit(R.squeeze(R.strided_slice(tensor, [0], [direction], [direction + 1]), [0]))

    def gate_input(self, gates: int, direction: int, recurrent_bias_gates: int):
        """``X·Wᵀ + Wb (+ Rb for the first ``recurrent_bias_gates`` gates)`` for all steps: [seq, batch, gates*hidden];
        [batch, gates*hidden] for one step (a streaming model's frame), which needs no slicing per step."""
        bb, h = self.bb, self.hidden
        x = self.x if self.steps > 1 else bb.emit(R.squeeze(self.x, [0]))
        projected = bb.emit(self.products.input(direction)(x))
        if self.bias is None:
            return projected
        bias = self.direction_slice(self.bias, direction)
        input_bias = R.strided_slice(bias, [0], [0], [gates * h])
        total = bb.emit(R.add(projected, input_bias))
        if recurrent_bias_gates:
            recurrent_bias = R.strided_slice(bias, [0], [gates * h], [(gates + recurrent_bias_gates) * h])
            if recurrent_bias_gates < gates:
                recurrent_bias = R.concat([recurrent_bias, R.zeros(((gates - recurrent_bias_gates) * h,), self.dtype)])
            total = bb.emit(R.add(total, recurrent_bias))
        return total

    def recurrent_bias(self, gates: int, direction: int, gate: int):
        """One gate's recurrent bias ``Rb`` (a [hidden] vector), or None without biases."""
        if self.bias is None:
            return None
        h = self.hidden
        start = (gates + gate) * h
        return self.bb.emit(R.strided_slice(self.direction_slice(self.bias, direction), [0], [start], [start + h]))

    def pre_activation(self, value):
        return R.clip(value, -float(self.clip), float(self.clip)) if self.clip is not None else value

    def zeros_state(self):
        return self.bb.emit(R.zeros((self.batch, self.hidden), self.dtype))

    def time_order(self, direction: int) -> list[int]:
        reverse = self.direction == "reverse" or direction == 1
        return list(range(self.steps))[::-1] if reverse else list(range(self.steps))

    def step_input(self, projected, step: int):
        if self.steps == 1:
            return projected  # gate_input squeezed the one step already
        return self.bb.emit(R.squeeze(R.strided_slice(projected, [0], [step], [step + 1]), [0]))

    def outputs(self, per_direction_hidden: list[list], finals: list[list]):
        """Y [seq, dirs, batch, hidden] and the final states [dirs, batch, hidden], in the node's layout."""
        bb = self.bb
        sequences = [R.stack(hidden, axis=0) for hidden in per_direction_hidden]  # each [seq, batch, hidden]
        y = bb.emit(R.stack(sequences, axis=1))
        stacked_finals = [bb.emit(R.stack(state, axis=0)) for state in finals]
        if self.layout == 1:
            y = bb.emit(R.permute_dims(y, [2, 0, 1, 3]))
            stacked_finals = [bb.emit(R.permute_dims(s, [1, 0, 2])) for s in stacked_finals]
        return relax.Tuple([y, *stacked_finals])


def convert_lstm(bb: relax.BlockBuilder, inputs: list, attrs: dict, constant, quantized: bool = False) -> relax.Tuple:
    """ONNX LSTM (gate order i, o, f, c) -> (Y, Y_h, Y_c); ``quantized``: DynamicQuantizeLSTM's inputs."""
    rnn = _Recurrence(bb, "DynamicQuantizeLSTM" if quantized else "LSTM", inputs, attrs, constant, quantized)
    initial_c = rnn._state(rnn._optional(inputs, 6))
    peepholes = rnn._optional(inputs, 7)
    h = rnn.hidden
    sequences, last_h, last_c = [], [], []
    for direction in range(rnn.directions):
        f, g, act_h = rnn.activations[direction]
        projected = rnn.gate_input(4, direction, recurrent_bias_gates=4)
        recurrent_product = rnn.products.recurrent(direction)
        hidden = rnn.direction_slice(rnn.initial_h, direction) if rnn.initial_h is not None else rnn.zeros_state()
        cell = rnn.direction_slice(initial_c, direction) if initial_c is not None else rnn.zeros_state()
        peep = None
        if peepholes is not None:
            p = rnn.direction_slice(peepholes, direction)
            peep = [bb.emit(R.strided_slice(p, [0], [k * h], [(k + 1) * h])) for k in range(3)]  # i, o, f
        outputs = {}
        for step in rnn.time_order(direction):
            gates = bb.emit(R.add(rnn.step_input(projected, step), recurrent_product(hidden)))
            i, o, fg, c = (bb.emit(R.strided_slice(gates, [1], [k * h], [(k + 1) * h])) for k in range(4))
            if peep is not None:
                i = R.add(i, R.multiply(peep[0], cell))
                fg = R.add(fg, R.multiply(peep[2], cell))
            i = f(rnn.pre_activation(i))
            fg = f(rnn.pre_activation(fg))
            c = g(rnn.pre_activation(c))
            cell = bb.emit(R.add(R.multiply(fg, cell), R.multiply(i, c)))
            if peep is not None:
                o = R.add(o, R.multiply(peep[1], cell))
            o = f(rnn.pre_activation(o))
            hidden = bb.emit(R.multiply(o, act_h(cell)))
            outputs[step] = hidden
        sequences.append([outputs[t] for t in range(rnn.steps)])
        last_h.append(hidden)
        last_c.append(cell)
    return rnn.outputs(sequences, [last_h, last_c])


def convert_gru(bb: relax.BlockBuilder, inputs: list, attrs: dict, constant) -> relax.Tuple:
    """ONNX GRU (gate order z, r, h; ``linear_before_reset`` either way) -> (Y, Y_h)."""
    rnn = _Recurrence(bb, "GRU", inputs, attrs, constant)
    linear_before_reset = bool(int(attrs.get("linear_before_reset", 0)))
    h = rnn.hidden
    sequences, last_h = [], []
    for direction in range(rnn.directions):
        f, g = rnn.activations[direction]
        # Rb of z and r add to the input projection; Rb of h does too unless it must be scaled by r.
        projected = rnn.gate_input(3, direction, recurrent_bias_gates=2 if linear_before_reset else 3)
        recurrent_bias_h = rnn.recurrent_bias(3, direction, 2) if linear_before_reset else None
        recurrent = rnn.direction_slice(rnn.recurrent, direction)
        recurrent_zr_t = bb.emit(R.permute_dims(R.strided_slice(recurrent, [0], [0], [2 * h]), [1, 0]))
        recurrent_h_t = bb.emit(R.permute_dims(R.strided_slice(recurrent, [0], [2 * h], [3 * h]), [1, 0]))
        hidden = rnn.direction_slice(rnn.initial_h, direction) if rnn.initial_h is not None else rnn.zeros_state()
        outputs = {}
        for step in rnn.time_order(direction):
            x_gates = rnn.step_input(projected, step)
            x_z, x_r, x_h = (bb.emit(R.strided_slice(x_gates, [1], [k * h], [(k + 1) * h])) for k in range(3))
            zr = bb.emit(R.matmul(hidden, recurrent_zr_t))
            z = f(rnn.pre_activation(R.add(x_z, R.strided_slice(zr, [1], [0], [h]))))
            r = bb.emit(f(rnn.pre_activation(R.add(x_r, R.strided_slice(zr, [1], [h], [2 * h])))))
            if linear_before_reset:
                h_part = R.matmul(hidden, recurrent_h_t)
                if recurrent_bias_h is not None:
                    h_part = R.add(h_part, recurrent_bias_h)
                candidate = R.add(x_h, R.multiply(r, h_part))
            else:
                candidate = R.add(x_h, R.matmul(R.multiply(r, hidden), recurrent_h_t))
            candidate = bb.emit(g(rnn.pre_activation(candidate)))
            z = bb.emit(z)
            one = relax.const(1.0, rnn.dtype)
            hidden = bb.emit(R.add(R.multiply(R.subtract(one, z), candidate), R.multiply(z, hidden)))
            outputs[step] = hidden
        sequences.append([outputs[t] for t in range(rnn.steps)])
        last_h.append(hidden)
    return rnn.outputs(sequences, [last_h])

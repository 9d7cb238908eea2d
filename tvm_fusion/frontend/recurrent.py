"""ONNX LSTM and GRU as Relax (TVM's importer has no converter for either; CRNN OCR models use them).

The recurrence is unrolled over the (static) sequence length. The input projection of every
time step is one matmul up front (``X·Wᵀ`` for all steps at once), so each step only
multiplies the hidden state by ``Rᵀ`` and applies the gate math, which TVM's FuseOps and our
``gemm_epilogue`` turn into a few kernels per step. Directions are forward, reverse and
bidirectional; layouts 0 (time-major) and 1 (batch-major); biases, initial states and LSTM
peepholes are optional; ``clip`` bounds the gate pre-activations as ONNX Runtime does.
ONNX Runtime's DynamicQuantizeLSTM (``quantize_dynamic``'s LSTM: int8 weights, each product's
left operand quantized to uint8 at run time) is the LSTM with those products computed as
ONNX Runtime computes them (``quantized.py``).
``sequence_lens`` is taken only when it is absent or a constant equal to the sequence length
for every batch entry; ``input_forget`` is refused. Both name the node when they refuse.

The float arithmetic is ONNX Runtime's CPU kernels' (``uni_directional_lstm.cc``,
``deep_cpu_gru.cc``, ``rnn_helpers.cc``), operation for operation, because a quantized LSTM
quantizes each step's hidden state and a last-bit difference there moves whole quantization
steps: the gate sums in its order (``X·Wᵀ + H·Rᵀ``, then a peephole term, then ``Wb + Rb``
summed once), its sigmoid and tanh (MLAS's rational functions, or its GRU's own), and each
product that it rounds before a sum rounded here too (``_rounded``). On x86 with fma the
outputs equal ONNX Runtime's bit for bit (``tests/frontend/test_recurrent.py``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax import op as R

from ..errors import ModelError
from . import ort_arithmetic
from .integer_matmul import emit_integer_matmul, integer_kernels_enabled, integer_matmul_applies
from .quantized import DynamicQuantization, centered_constant, constant_array

# ONNX's default activations: LSTM (f, g, h), GRU (f, g); repeated per direction.
_DEFAULTS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "DynamicQuantizeLSTM": ("Sigmoid", "Tanh", "Tanh"),
             "GRU": ("Sigmoid", "Tanh")}


def _activation(bb: relax.BlockBuilder, name: str, alpha: float | None, beta: float | None, dtype: str,
                kernels: str = "mlas") -> Callable[[relax.Expr], relax.Expr]:
    """Sigmoid and Tanh (float32) as ONNX Runtime computes them where it uses them: ``kernels``
    "mlas" (MlasComputeLogistic/MlasComputeTanh: LSTM gates, GRU's update gate) or "gru" (its
    GRU reset and output gates' own rational functions, ``rnn_helpers.cc``)."""
    exact = dtype == "float32"
    if name == "Sigmoid":
        kernel = ort_arithmetic.mlas_logistic if kernels == "mlas" else ort_arithmetic.gru_logistic
        return (lambda x: _emit_te(bb, kernel, x)) if exact else R.sigmoid
    if name == "Tanh":
        kernel = ort_arithmetic.mlas_tanh if kernels == "mlas" else ort_arithmetic.gru_tanh
        return (lambda x: _emit_te(bb, kernel, x)) if exact else R.tanh
    if name == "Relu":
        return R.nn.relu
    if name == "HardSigmoid":  # ONNX defaults alpha 0.2, beta 0.5; ONNX Runtime rounds alpha·x
        a, b = (0.2 if alpha is None else alpha), (0.5 if beta is None else beta)
        return lambda x: R.clip(R.add(_rounded(bb, R.multiply(x, relax.const(a, dtype))), relax.const(b, dtype)),
                                0.0, 1.0)
    raise KeyError(name)


def _rounded(bb: relax.BlockBuilder, product: relax.Expr) -> relax.Expr:
    """``product`` rounded to its dtype on its own, as ONNX Runtime rounds it before adding it
    to a sum: an LLVM arithmetic fence, across which no fma contraction can merge the multiply
    into the add (TVM lets LLVM contract ``a·b + c`` on targets with fma)."""
    return _emit_te(bb, ort_arithmetic.fence, product)


def _emit_te(bb: relax.BlockBuilder, function: Callable[[te.Tensor], te.Tensor], value: relax.Expr) -> relax.Expr:
    """An element-wise TE ``function`` of ``value`` (bound first: ``emit_te`` takes variables)."""
    value = value if isinstance(value, relax.Var) else bb.emit(value)
    return bb.emit_te(function, value, primfunc_name_hint=function.__name__)


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
        centered, scale = weights[0][direction], relax.const(weights[1][direction])

        def product(left: relax.Expr) -> relax.Expr:
            quantized = DynamicQuantization(bb, bb.normalize(left))
            # The int8 kernel reads a quarter of the float weight's bytes: a step's recurrent
            # product streams its whole weight for one row of output.
            if integer_kernels_enabled() and integer_matmul_applies(quantized.values, centered):
                whole = emit_integer_matmul(bb, quantized.values, quantized.zero_point, centered)
            else:
                whole = R.matmul(quantized.centered(bb), relax.const(centered))
            return _rounded(bb, R.multiply(whole, R.multiply(quantized.scale, scale)))

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
        self.biases = self._optional(inputs, 3)
        self._check_sequence_lens(self._optional(inputs, 4), constant)
        self.initial_h = self._state(self._optional(inputs, 5))

    def refuse(self, what: str, fix: str):
        raise ModelError(f"{self.kind} node {self.name!r}: {what} is not supported", fix)

    def _activations(self, attrs: dict) -> list:
        """Per direction, one ``kernels -> [relax.Expr -> relax.Expr]`` per ONNX activation (f, g[, h])."""
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in attrs.get("activations", ())]
        count = len(_DEFAULTS[self.kind])
        names = names or list(_DEFAULTS[self.kind]) * self.directions
        alphas = list(attrs.get("activation_alpha", ()))
        betas = list(attrs.get("activation_beta", ()))
        functions = []
        for index, name in enumerate(names):
            alpha = alphas[index] if index < len(alphas) else None
            beta = betas[index] if index < len(betas) else None
            try:
                _activation(self.bb, name, alpha, beta, self.dtype)
            except KeyError:
                self.refuse(f"activation {name!r}", "use Sigmoid, Tanh, Relu or HardSigmoid")
            functions.append(lambda kernels="mlas", name=name, alpha=alpha, beta=beta:
                             _activation(self.bb, name, alpha, beta, self.dtype, kernels))
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

    def gate_input(self, direction: int):
        """``X·Wᵀ`` for all steps: [seq, batch, gates*hidden]; [batch, gates*hidden] for one step
        (a streaming model's frame), which needs no slicing per step. The biases are added per
        step, after the recurrent product (``bias``), as ONNX Runtime adds them."""
        x = self.x if self.steps > 1 else self.bb.emit(R.squeeze(self.x, [0]))
        return self.bb.emit(self.products.input(direction)(x))

    def bias(self, gates: int, direction: int, gate: int, recurrent: bool | None):
        """One gate's bias (a [hidden] vector), or None without biases: ``Wb + Rb`` summed once in
        float32 (``recurrent=None``, ONNX Runtime's fused bias), or only ``Wb`` or only ``Rb``."""
        if self.biases is None:
            return None
        h, bias = self.hidden, self.direction_slice(self.biases, direction)

        def part(offset: int):
            start = offset + gate * h
            return R.strided_slice(bias, [0], [start], [start + h])

        if recurrent is None:
            return self.bb.emit(R.add(part(0), part(gates * h)))
        return self.bb.emit(part(gates * h if recurrent else 0))

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
    """ONNX LSTM (gate order i, o, f, c) -> (Y, Y_h, Y_c); ``quantized``: DynamicQuantizeLSTM's inputs.

    Each step in ONNX Runtime's order (``uni_directional_lstm.cc``): ``X·Wᵀ + H·Rᵀ``, then the
    peephole term, then ``Wb + Rb``; ``C = C·f + i·g``; ``H = h(C)·o``."""
    rnn = _Recurrence(bb, "DynamicQuantizeLSTM" if quantized else "LSTM", inputs, attrs, constant, quantized)
    initial_c = rnn._state(rnn._optional(inputs, 6))
    peepholes = rnn._optional(inputs, 7)
    h = rnn.hidden
    sequences, last_h, last_c = [], [], []
    for direction in range(rnn.directions):
        f, g, act_h = (activation() for activation in rnn.activations[direction])
        projected = rnn.gate_input(direction)
        recurrent_product = rnn.products.recurrent(direction)
        bias_i, bias_o, bias_f, bias_c = (rnn.bias(4, direction, k, recurrent=None) for k in range(4))
        hidden = rnn.direction_slice(rnn.initial_h, direction) if rnn.initial_h is not None else rnn.zeros_state()
        cell = rnn.direction_slice(initial_c, direction) if initial_c is not None else rnn.zeros_state()
        peep = [None] * 3
        if peepholes is not None:
            p = rnn.direction_slice(peepholes, direction)
            peep = [bb.emit(R.strided_slice(p, [0], [k * h], [(k + 1) * h])) for k in range(3)]  # i, o, f
        outputs = {}
        for step in rnn.time_order(direction):
            gates = bb.emit(R.add(rnn.step_input(projected, step), recurrent_product(hidden)))
            i, o, fg, c = (bb.emit(R.strided_slice(gates, [1], [k * h], [(k + 1) * h])) for k in range(4))
            i = f(rnn.pre_activation(_plus(_plus(i, _product(bb, peep[0], cell)), bias_i)))
            fg = f(rnn.pre_activation(_plus(_plus(fg, _product(bb, peep[2], cell)), bias_f)))
            c = g(rnn.pre_activation(_plus(c, bias_c)))
            cell = bb.emit(R.add(_rounded(bb, R.multiply(cell, fg)), _rounded(bb, R.multiply(i, c))))
            o = f(rnn.pre_activation(_plus(_plus(o, _product(bb, peep[1], cell)), bias_o)))
            hidden = bb.emit(R.multiply(act_h(cell), o))
            outputs[step] = hidden
        sequences.append([outputs[t] for t in range(rnn.steps)])
        last_h.append(hidden)
        last_c.append(cell)
    return rnn.outputs(sequences, [last_h, last_c])


def convert_gru(bb: relax.BlockBuilder, inputs: list, attrs: dict, constant) -> relax.Tuple:
    """ONNX GRU (gate order z, r, h; ``linear_before_reset`` either way) -> (Y, Y_h).

    Each step in ONNX Runtime's order (``deep_cpu_gru.cc``): z and r from ``X·Wᵀ + H·Rᵀ`` then
    ``Wb + Rb``; the candidate from ``X·Whᵀ + (r·H)·Rhᵀ`` then ``Wbh + Rbh``, or with
    ``linear_before_reset`` from ``X·Whᵀ + r·(H·Rhᵀ + Rbh)`` then ``Wbh``; ``H = (1 - z)·h + z·H``."""
    rnn = _Recurrence(bb, "GRU", inputs, attrs, constant)
    linear_before_reset = bool(int(attrs.get("linear_before_reset", 0)))
    h = rnn.hidden
    sequences, last_h = [], []
    for direction in range(rnn.directions):
        make_f, make_g = rnn.activations[direction]
        update, reset, g = make_f(), make_f("gru"), make_g("gru")  # ONNX Runtime's GRU computes f two ways
        projected = rnn.gate_input(direction)
        bias_z, bias_r = (rnn.bias(3, direction, k, recurrent=None) for k in range(2))
        if linear_before_reset:
            bias_h, recurrent_bias_h = (rnn.bias(3, direction, 2, recurrent=r) for r in (False, True))
        else:
            bias_h, recurrent_bias_h = rnn.bias(3, direction, 2, recurrent=None), None
        recurrent = rnn.direction_slice(rnn.recurrent, direction)
        recurrent_zr_t = bb.emit(R.permute_dims(R.strided_slice(recurrent, [0], [0], [2 * h]), [1, 0]))
        recurrent_h_t = bb.emit(R.permute_dims(R.strided_slice(recurrent, [0], [2 * h], [3 * h]), [1, 0]))
        hidden = rnn.direction_slice(rnn.initial_h, direction) if rnn.initial_h is not None else rnn.zeros_state()
        outputs = {}
        for step in rnn.time_order(direction):
            x_gates = rnn.step_input(projected, step)
            x_z, x_r, x_h = (bb.emit(R.strided_slice(x_gates, [1], [k * h], [(k + 1) * h])) for k in range(3))
            zr = bb.emit(R.matmul(hidden, recurrent_zr_t))
            z = update(rnn.pre_activation(_plus(R.add(x_z, R.strided_slice(zr, [1], [0], [h])), bias_z)))
            r = bb.emit(reset(rnn.pre_activation(_plus(R.add(x_r, R.strided_slice(zr, [1], [h], [2 * h])), bias_r))))
            if linear_before_reset:
                h_part = _plus(R.matmul(hidden, recurrent_h_t), recurrent_bias_h)
                candidate = R.add(x_h, _rounded(bb, R.multiply(h_part, r)))
            else:
                candidate = R.add(x_h, R.matmul(R.multiply(hidden, r), recurrent_h_t))
            candidate = bb.emit(g(rnn.pre_activation(_plus(candidate, bias_h))))
            z = bb.emit(z)
            one = relax.const(1.0, rnn.dtype)
            hidden = bb.emit(R.add(_rounded(bb, R.multiply(R.subtract(one, z), candidate)),
                                   _rounded(bb, R.multiply(z, hidden))))
            outputs[step] = hidden
        sequences.append([outputs[t] for t in range(rnn.steps)])
        last_h.append(hidden)
    return rnn.outputs(sequences, [last_h])


def _plus(value: relax.Expr, term: relax.Expr | None) -> relax.Expr:
    """``value + term``, or ``value`` where the term is absent (no bias, no peepholes)."""
    return value if term is None else R.add(value, term)


def _product(bb: relax.BlockBuilder, left: relax.Expr | None, right: relax.Expr) -> relax.Expr | None:
    """A peephole term ``P·C``, rounded before it is added (or None without peepholes)."""
    return None if left is None else _rounded(bb, R.multiply(left, right))

"""TVM's ONNX importer, with our converters for the ops it gets wrong.

* Dropout: TVM ignores ``training_mode`` and imports every Dropout as inference (identity),
  and types its mask like the data. Training mode (a constant true ``training_mode``) becomes
  the counter-based ``dropout_training`` kernel; inference keeps TVM's ``nn.dropout`` (the
  ``dropout`` pattern removes it) with a boolean mask, as ONNX specifies.
* EyeLike: TVM rejects a ``dtype`` attribute that differs from the input's (ONNX allows it),
  names no node when the input is not 2-D, and its ``eye_like`` is constant-folded into a
  stored n x m tensor. Ours is a kernel on the input (``kernels/eye_like.py``).
* Upsample (opsets 7-9, written by older exporters for FPN/YOLO necks): TVM rounds the
  nearest source pixel (ONNX says floor: its output differs from ONNX Runtime's) and fails to
  import opset 9, where the scales are an input. Ours is ``resize2d`` with Upsample's
  asymmetric coordinates and floor.
* LSTM, GRU: TVM has no converter (CRNN OCR recognizers use them); ours are in ``recurrent.py``.
* ConvInteger, ``com.microsoft`` DynamicQuantizeLSTM (``quantize_dynamic`` output): not in TVM;
  ours compute the integer products in float32, exactly (``quantized.py``). MatMulInteger of a
  constant weight too (TVM's runs an int32 matmul no schedule of ours takes). DynamicQuantizeLinear:
  TVM's divides by zero on an all-zero tensor (ONNX Runtime then takes scale 1); ours does not.
* QOperator ops (QLinearConv, QLinearMatMul, QLinearAdd/Mul, ``com.microsoft`` QGemm,
  MatMulIntegerToFloat, DynamicQuantizeMatMul, QLinearGlobalAveragePool), also what
  ``qdq_fusion.py`` makes of QDQ groups: not in TVM; ours compute them as ONNX Runtime's
  integer kernels do, bit for bit (``qoperator.py``). ``com.microsoft`` QLinearSigmoid,
  QLinearLeakyRelu, QLinearConcat and QLinearAveragePool as its tables and float passes
  (``qlinear_lookup.py``).
* Range over a symbolic size (GPT-2's position ids, ``Range(0, sequence, 1)``): TVM gives the
  result a fresh length var, so ``embeddings + positions`` loses its shape and the import
  fails. Ours is ``arange`` with the length as an expression of the input dims.
* Resize of a symbolically sized map by whole-number scales (an FPN's 2x upsampling): TVM
  computes the size as ``int(2.0 * float(h))``, which no later shape can be proven equal to;
  ours gives it ``2 * h``, which is the same size (ONNX floors ``h * scale``).
* Expand to a constant shape of a tensor with symbolic dims (GPT-2's causal mask): TVM's
  converter reads every input dim as a number and fails; ours broadcasts by ONNX's rules.
* Clip: TVM's converter, with its maximum and minimum kernels marked for the ``clip`` pattern.
* Resize with an empty ``scales`` beside its ``sizes`` (paddle2onnx's spelling, valid ONNX):
  TVM's converter refuses it; ours passes the scales on as absent.
* OneHot: TVM's refuses a one-element depth vector (paddle2onnx's) and types its output
  float64 whatever its values' type; ours types it as ONNX does.
* Scaler (``ai.onnx.ml``; skl2onnx's StandardScaler): not in TVM; ``(x - offset) * scale``.

Everything else goes to TVM's own converters.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.relax.frontend.onnx.onnx_frontend import ONNXGraphImporter, get_constant, get_type

from ..errors import ModelError
from ..kernels import CLIP_KERNELS, kernel_attrs
from ..kernels.dropout_training import emit_dropout_training
from ..kernels.eye_like import emit_eye_like
from ..patterns.base import static_shape, whole_numbers
from . import qlinear_lookup, qoperator
from .op_support import unsupported_ops, unsupported_ops_message
from .quantized import DynamicQuantization, centered_constant, integer_input
from .recurrent import convert_gru, convert_lstm

_DEFAULT_RATIO = 0.5


class Importer(ONNXGraphImporter):
    """``ONNXGraphImporter`` that tries our converters first; None from one means "TVM's"."""

    def __init__(self, shape_dict, dtype_dict):
        super().__init__(shape_dict, dtype_dict)
        self._dropouts_without_seed = 0

    def from_onnx(self, graph, opset):
        # TVM warns for every name it sanitizes for Relax ("Renaming name input.1 to input_1");
        # the artifact keeps the ONNX names, so the warning would only mislead.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Renaming name ", category=UserWarning)
            return super().from_onnx(graph, opset)

    def _convert_operator(self, op_name, inputs, attrs, opset):
        convert = {"Dropout": self._dropout, "EyeLike": self._eye_like,
                   "Upsample": self._upsample, "LSTM": self._recurrent(convert_lstm),
                   "GRU": self._recurrent(convert_gru), "Range": self._range,
                   "Expand": self._expand, "Resize": self._resize, "Clip": self._clip, "OneHot": self._one_hot,
                   "Scaler": self._scaler, "Einsum": self._einsum, "ConvInteger": self._conv_integer,
                   "DynamicQuantizeLinear": self._dynamic_quantize_linear, "MatMulInteger": self._matmul_integer,
                   "DynamicQuantizeLSTM": self._recurrent(convert_lstm, quantized=True),
                   "QLinearConv": self._qlinear_conv, **{op: self._quantized(convert) for op, convert in (
                       ("QLinearMatMul", qoperator.qlinear_matmul), ("QGemm", qoperator.qgemm),
                       ("QLinearAdd", qoperator.qlinear_add), ("QLinearMul", qoperator.qlinear_mul),
                       ("MatMulIntegerToFloat", qoperator.matmul_integer_to_float),
                       ("DynamicQuantizeMatMul", qoperator.dynamic_quantize_matmul),
                       ("QLinearGlobalAveragePool", qoperator.qlinear_global_average_pool),
                       ("QLinearAveragePool", qlinear_lookup.qlinear_average_pool),
                       ("QLinearSigmoid", qlinear_lookup.qlinear_sigmoid),
                       ("QLinearLeakyRelu", qlinear_lookup.qlinear_leaky_relu),
                       ("QLinearConcat", qlinear_lookup.qlinear_concat),
                       ("QLinearSoftmax", qlinear_lookup.qlinear_softmax))}}.get(op_name)
        converted = convert(inputs, attrs, opset) if convert is not None else None
        if converted is None:
            return super()._convert_operator(op_name, inputs, attrs, opset)
        return self.bb.normalize(converted)

    def _check_for_unsupported_ops(self, graph):
        """TVM's check would refuse the ops only we convert; ours counts them."""
        missing = unsupported_ops(graph)
        if missing:
            raise ModelError(*unsupported_ops_message(missing))

    def _clip(self, inputs, attrs, opset):
        """TVM's Clip, its maximum and minimum kernels marked (``CLIP_KERNELS``) for the clip pattern."""
        convert = onnx_frontend.Clip.get_converter(opset)
        return convert(_MarkingBuilder(self.bb), inputs, attrs, [self._nodes, self._params])

    def _einsum(self, inputs, attrs, _opset):
        """Relax's einsum op, not TVM's converter's TE kernel, which no pass can read:
        ``passes/einsum_as_matmul.py`` turns the contractions into matmuls the patterns fuse."""
        equation = attrs["equation"]
        return relax.op.einsum(list(inputs), equation.decode() if isinstance(equation, bytes) else equation)

    def _scaler(self, inputs, attrs, _opset):
        """``ai.onnx.ml`` Scaler: ``(x - offset) * scale`` in float32 (ONNX-ML's output type), with
        one offset and scale per feature (the last axis) or one for all."""
        data = inputs[0]
        if data.ty.dtype != "float32":
            data = self.bb.emit(relax.op.astype(data, "float32"))
        offset = relax.const(np.asarray(attrs.get("offset", [0.0]), "float32"))
        scale = relax.const(np.asarray(attrs.get("scale", [1.0]), "float32"))
        return relax.op.multiply(self.bb.emit(relax.op.subtract(data, offset)), scale)

    def _recurrent(self, convert, **options):
        def run(inputs, attrs, _opset):
            return convert(self.bb, inputs, attrs, self._constant, **options)

        return run

    def _constant(self, value):
        return get_constant(value, [self._nodes, self._params])

    def _quantized(self, convert):
        def run(inputs, attrs, _opset):
            return convert(self.bb, inputs, attrs, self._constant)

        return run

    def _qlinear_conv(self, inputs, attrs, opset):
        def conv(data, weights, bias):
            return super(Importer, self)._convert_operator("Conv", [data, weights, bias], attrs, opset)

        return qoperator.qlinear_conv(self.bb, inputs, attrs, self._constant, conv)

    def _conv_integer(self, inputs, attrs, opset):
        """ConvInteger as TVM's float32 Conv of ``x - x_zero_point`` and ``w - w_zero_point``
        (whole numbers: the result is exact), cast to ConvInteger's int32."""
        data_zero_point, weight_zero_point = (inputs[i] if len(inputs) > i else None for i in (2, 3))
        data = integer_input(self.bb, inputs[0], data_zero_point)
        weights = self._centered_weights(inputs[1], weight_zero_point, channel_axis=0)
        if weights is None:  # computed at run time; a zero point per output channel ([M]) as [M, 1, ...]
            if weight_zero_point is not None and weight_zero_point.ty.ndim == 1:
                weight_zero_point = relax.op.reshape(weight_zero_point, [-1] + [1] * (inputs[1].ty.ndim - 1))
            weights = integer_input(self.bb, inputs[1], weight_zero_point)
        return self._as_int32(super()._convert_operator("Conv", [data, weights, None], attrs, opset))

    def _matmul_integer(self, inputs, _attrs, _opset):
        """MatMulInteger of a constant B as the int8 kernel on a VNNI target, else a float32
        MatMul of whole numbers (exact, like ``_conv_integer``) cast to int32, whose weight is
        then packed for our matmul kernel (``qoperator.integer_sum``). A zero point per row of A,
        or a B computed at run time, goes to TVM's int32 converter."""
        data_zero_point, weight_zero_point = (inputs[i] if len(inputs) > i else None for i in (2, 3))
        weights = qoperator.constant_centered_weights(self._constant, inputs[1], weight_zero_point, channel_axis=1)
        zero_point_shape = None if data_zero_point is None else static_shape(data_zero_point)
        if weights is None or weights.ndim != 2 or (
                data_zero_point is not None and (zero_point_shape is None or math.prod(zero_point_shape) != 1)):
            return None
        return qoperator.integer_sum(self.bb, self._constant, inputs[0], data_zero_point, inputs[1],
                                     weight_zero_point, channel_axis=1, dtype="int32")

    def _as_int32(self, product: relax.Expr) -> relax.Expr:
        """An integer op's int32 result from its float32 product of whole numbers."""
        return relax.op.astype(self.bb.normalize(product), "int32")

    def _centered_weights(self, weights, zero_point, channel_axis: int) -> tvm.ir.GenericConst | None:
        """``weights - zero_point`` (one, or one per channel along ``channel_axis``) as a float32
        constant; None unless both are constants."""
        weights = self._constant(weights)
        zero_point = None if zero_point is None else self._constant(zero_point)
        if not isinstance(weights, tvm.ir.GenericConst) or not (
                zero_point is None or isinstance(zero_point, tvm.ir.GenericConst)):
            return None
        return relax.const(centered_constant(weights.value.numpy(), None if zero_point is None
                                             else zero_point.value.numpy(), channel_axis))

    def _dynamic_quantize_linear(self, inputs, _attrs, _opset):
        quantized = DynamicQuantization(self.bb, inputs[0])
        return relax.Tuple([relax.op.astype(quantized.values, "uint8"), quantized.scale,
                            relax.op.astype(quantized.zero_point, "uint8")])

    def _dropout(self, inputs, attrs, opset):
        if opset < 12 or len(inputs) < 3 or inputs[2] is None:
            return self._inference_dropout(inputs, attrs, opset)
        name = attrs["tvm_custom"]["name"] or "(unnamed)"
        training = self._constant(inputs[2])
        if not isinstance(training, tvm.ir.GenericConst):
            raise ModelError(f"Dropout node {name!r}: training_mode is computed at run time",
                             "make training_mode a constant (an initializer) of the mode you "
                             "compile for; a compiled model runs one mode")
        if not bool(training.value.numpy()):
            return self._inference_dropout(inputs, attrs, opset)
        ratio = inputs[1] if len(inputs) > 1 and inputs[1] is not None else relax.const(_DEFAULT_RATIO)
        ratio = self._constant(ratio)
        if ratio.ty.ndim != 0:  # some exporters write the scalar as a 1-element tensor
            ratio = self.bb.emit(relax.op.reshape(ratio, ()))
        if ratio.ty.dtype != "float32":
            ratio = self.bb.emit(relax.op.astype(ratio, "float32"))
        seed = attrs.get("seed")
        if seed is None:
            # ONNX leaves the seed to the runtime. Numbering unseeded Dropouts keeps builds
            # reproducible and gives each node its own mask.
            seed = self._dropouts_without_seed
            self._dropouts_without_seed += 1
        return emit_dropout_training(self.bb, inputs[0], ratio, int(seed))

    def _inference_dropout(self, inputs, attrs, opset):
        """TVM's identity ``nn.dropout``; the mask output, when there is one, all true (bool)."""
        if attrs["tvm_custom"]["num_outputs"] < 2:
            return None
        values = self.bb.emit(relax.TupleGetItem(
            super()._convert_operator("Dropout", inputs, attrs, opset), 0))
        return relax.Tuple([values, relax.op.ones_like(inputs[0], "bool")])

    def _eye_like(self, inputs, attrs, _opset):
        x = inputs[0]
        name = attrs["tvm_custom"]["name"] or "(unnamed)"
        if x.ty.ndim != 2:
            raise ModelError(f"EyeLike node {name!r}: its input has rank {x.ty.ndim}; "
                             "EyeLike takes a 2-D tensor", "fix the model (ONNX requires 2-D)")
        dtype = get_type(attrs["dtype"]) if "dtype" in attrs else x.ty.dtype
        return emit_eye_like(self.bb, x, int(attrs.get("k", 0)), dtype)


    def _range(self, inputs, _attrs, _opset):
        """An integer Range whose bounds are shape expressions, as ``arange`` of known length;
        anything else (constant or data-dependent bounds, floats) goes to TVM's converter."""
        bounds = [self._constant(value) for value in inputs]
        if not any(tvm.ir.is_prim_expr(b) and not isinstance(b, tvm.tirx.IntImm) for b in bounds):
            return None
        values = []
        for bound in bounds:
            if tvm.ir.is_prim_expr(bound):
                values.append(bound)
            elif isinstance(bound, tvm.ir.GenericConst) and bound.value.numpy().size == 1:
                values.append(bound.value.numpy().reshape(()).item())
            else:
                return None
        dtype = str(getattr(bounds[0], "dtype", None) or bounds[0].ty.dtype)
        if "int" not in dtype or not isinstance(values[2], int) or values[2] <= 0:
            return None  # a float range, or a step that is not a positive constant
        return relax.op.arange(*values, dtype=dtype)

    def _resize(self, inputs, attrs, opset):
        """TVM's converter, with whole-number float scales given to it as integers when the
        input has symbolic dims (so each output size is an exact multiple of the input's), and
        an empty ``scales`` beside ``sizes`` (paddle2onnx writes both; ONNX reads the sizes)
        passed as absent, where TVM's would refuse the pair."""
        dims = getattr(inputs[0].ty, "shape", None)
        scales = self._constant(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else None
        if (len(inputs) > 3 and inputs[3] is not None and isinstance(scales, tvm.ir.GenericConst)
                and scales.value.numpy().size == 0):
            return super()._convert_operator("Resize", [*inputs[:2], None, *inputs[3:]], attrs, opset)
        if dims is None or all(isinstance(d, tvm.tirx.IntImm) for d in dims) or not isinstance(
                scales, tvm.ir.GenericConst):
            return None
        values = scales.value.numpy()
        if values.size == 0 or not whole_numbers(values):
            return None
        whole = relax.const(values.astype("int64"))
        return super()._convert_operator("Resize", [*inputs[:2], whole, *inputs[3:]], attrs, opset)

    def _one_hot(self, inputs, attrs, _opset):
        """OneHot with constant depth and values. TVM's refuses a one-element depth vector (ONNX
        allows a scalar or that; paddle2onnx writes the vector) and types its output float64
        whatever the values' type; ONNX types it as the values."""
        depth, values = self._constant(inputs[1]), self._constant(inputs[2])
        if not isinstance(depth, tvm.ir.GenericConst) or not isinstance(values, tvm.ir.GenericConst):
            return None
        depth = int(depth.value.numpy().reshape(-1)[0])
        dtype = str(values.value.numpy().dtype)
        off_value, on_value = (relax.prim_value(tvm.tirx.const(v, dtype)) for v in values.value.numpy().tolist())
        # ONNX counts a negative index from the end; TVM's own helper maps it (unsigned ones stay).
        indices = onnx_frontend._normalize_negative_indices(self.bb, inputs[0],
                                                            relax.const(depth, str(inputs[0].ty.dtype)))
        return relax.op.one_hot(indices, on_value, off_value, depth, attrs.get("axis", -1))

    def _expand(self, inputs, _attrs, _opset):
        """Expand of a symbolically shaped tensor to a constant shape (TVM's handles the rest)."""
        data, shape = inputs[0], self._constant(inputs[1])
        dims = getattr(data.ty, "shape", None)
        if not isinstance(shape, tvm.ir.GenericConst) or dims is None or all(
                isinstance(d, tvm.tirx.IntImm) for d in dims):
            return None
        target = [int(v) for v in shape.value.numpy().reshape(-1)]
        rank = max(len(target), len(dims))
        source = [1] * (rank - len(dims)) + list(dims)
        target = [1] * (rank - len(target)) + target
        # ONNX (numpy) broadcasting: a target 1 keeps the input's dim, an input 1 takes the target's.
        out = [dim if size == 1 else size for dim, size in zip(source, target)]
        if rank == len(dims) and all(a is b for a, b in zip(out, source)):
            return data
        return relax.op.broadcast_to(data, relax.ShapeExpr(out))

    def _upsample(self, inputs, attrs, opset):
        """NCHW Upsample with per-axis scales (1, 1, sh, sw) as ``resize2d``; anything else
        goes to TVM's converter (which then names what it does not support)."""
        x = inputs[0]
        if opset >= 9:
            scales = self._constant(inputs[1]) if len(inputs) > 1 else None
            if not isinstance(scales, tvm.ir.GenericConst):
                return None
            scales = [float(v) for v in scales.value.numpy().reshape(-1)]
        else:
            scales = [float(v) for v in attrs.get("scales", ())]
        shape = [int(d) for d in x.ty.shape] if all(
            isinstance(d, tvm.tirx.IntImm) for d in getattr(x.ty, "shape", None) or ()) else None
        if shape is None or len(shape) != 4 or len(scales) != 4 or scales[:2] != [1.0, 1.0]:
            return None
        mode = attrs.get("mode", b"nearest")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        method = {"nearest": "nearest_neighbor", "linear": "linear", "bilinear": "linear"}.get(mode)
        if method is None:
            return None
        size = [int(dim * scale) for dim, scale in zip(shape[2:], scales[2:])]  # ONNX: floor
        return relax.op.image.resize2d(x, size, layout="NCHW", method=method,
                                       coordinate_transformation_mode="asymmetric",
                                       rounding_method="floor")


class _MarkingBuilder:
    """The importer's BlockBuilder, but ``emit_te`` of a Clip bound kernel marks it as ours."""

    def __init__(self, bb: relax.BlockBuilder):
        self._bb = bb

    def __getattr__(self, name):
        return getattr(self._bb, name)

    def emit_te(self, func, *args, **kwargs):
        kind = CLIP_KERNELS.get(getattr(func, "__name__", ""))
        if kind is not None:
            kwargs["primfunc_attrs"] = kernel_attrs(kind)
        return self._bb.emit_te(func, *args, **kwargs)


def from_onnx(model: onnx.ModelProto, shape_dict: dict[str, list], dtype_dict: dict[str, str]):
    """``tvm.relax.frontend.onnx.from_onnx`` (default-domain opset, checked model) with our converters."""
    opset = next((entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")), 1)
    return Importer(shape_dict, dtype_dict).from_onnx(model.graph, opset)

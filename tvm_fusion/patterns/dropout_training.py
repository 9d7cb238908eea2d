"""Training-mode Dropout fused into the GEMM epilogue, drawn with a counter-based generator.

TVM's ONNX importer treats every Dropout as inference (identity). For a Dropout with
``training_mode`` true the frontend (``frontend/converters.py``) emits
``call_tir(dropout_training, (x, ratio))`` built by ``kernels/dropout_training.py``, whose
mask is a pure function of (seed, flat index) (Philox-4x32-10), so the fused kernel draws
exactly the mask the standalone kernel draws.

The fusion groups matmul [+ bias] [+ activation] + that dropout into one composite; FuseTIR
makes it one kernel with two outputs (values, mask), and the ``MatmulMultiOutput`` schedule
computes bias, activation, mask and scaling on each output tile while it is in registers
instead of four round trips through memory (the seed's headline case: ~15 % of a step).
"""

from __future__ import annotations

from tvm.relax.dpl import is_op, is_tuple, wildcard

from ..kernels.dropout_training import KERNEL_NAME
from .base import scalar_constant
from .activations import ACTIVATIONS
from .gemm_epilogue import GemmEpilogue, gemm_epilogue_pattern, variant_name


class DropoutTraining(GemmEpilogue):
    """A GEMM epilogue whose last step is a training-mode dropout (checks: its own, then the epilogue's)."""

    name = "dropout_training"
    runs_before = ("gemm_epilogue",)
    description = ("matmul [+ bias] [+ activation] + training-mode Dropout -> one kernel "
                   "(values and mask from a counter-based generator in the epilogue)")

    kernels = {"kernel": KERNEL_NAME}  # our kernel, told by its tvm_fusion.kernel attribute

    def variants(self):
        variants = []
        for bias in (True, False):
            for activation in (*ACTIVATIONS, None):
                chain, annotations = gemm_epilogue_pattern(bias, activation, residual=False)
                kernel, ratio = wildcard(), wildcard()
                root = is_op("relax.call_tir")(kernel, is_tuple([chain, ratio]))
                variants.append((variant_name(bias, activation, False) + "_dropout", root,
                                 {**annotations, "kernel": kernel, "ratio": ratio, "dropout": root}))
        return sorted(variants, key=lambda v: -len(v[0].split("_")))

    def check(self, context):
        found = context.annotated_expr
        ratio = scalar_constant(found["ratio"])
        if ratio is None:
            return "the dropout ratio is computed at run time; the fusion needs a constant ratio"
        if not 0.0 <= ratio < 1.0:
            return f"dropout ratio {ratio:g} is outside [0, 1)"
        return super().check(context)

"""ConvTranspose epilogue: conv2d_transpose + bias + activation + residual Add (+ activation)
as one kernel.

Decoder heads (DBNet, U-Net, FPN upsampling) end in ``ConvTranspose -> [BN] -> activation``;
the BN is folded into the weights and bias by ``conv_bn_fold``, which leaves a per-channel
bias add. The importer spells ONNX's bias input as a separate ``add`` of a ``(1, C, 1, 1)``
constant, so unfused the bias and the activation are two more passes over a map that is
``stride**2`` times larger than the decoder's input. Fused, they run on the output tile.
Output rows and columns may be symbolic; batch and channels must be static.
"""

from __future__ import annotations

from .conv_epilogue import ConvEpilogue, epilogue_variants


class ConvTransposeEpilogue(ConvEpilogue):
    """The conv epilogue's checks and kernel shape, for conv2d_transpose (no SE input scale)."""

    name = "conv_transpose_epilogue"
    operator = "conv_transpose"
    runs_before = ("resize_merge",)
    description = ("conv2d_transpose (strided/padded/grouped, output_padding) + bias + activation "
                   "(relu, clip, leakyrelu, sigmoid, silu, hardsigmoid, hardswish) + residual add "
                   "+ activation")

    def variants(self):
        return epilogue_variants("relax.nn.conv2d_transpose", "conv_transpose", with_input_scale=False)

    def layout_reason(self, attrs) -> str | None:
        if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCHW", "IOHW", "NCHW"):
            return (f"conv_transpose layout {attrs.data_layout}/{attrs.kernel_layout}/"
                    f"{attrs.out_layout} is not NCHW/IOHW/NCHW (the only one TOPI lowers)")
        return None

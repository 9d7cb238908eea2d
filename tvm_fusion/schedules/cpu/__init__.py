"""Default CPU schedule rules, one per module, re-exported here by name (alphabetical) for
imports like ``from tvm_fusion.schedules.cpu import Softmax``.

This list sets no order and registers nothing: the registry finds every rule by its module and
asks them in the order their ``runs_before``/``runs_after`` declare (``schedules/registry.py``).
"""

from .attention import Attention
from .bf16_matmul_amx import Bf16MatmulAmx
from .bf16_matmul_avx512 import Bf16MatmulAvx512
from .conv2d_nchw import Conv2dNCHW
from .conv_taps_in_lanes import ConvTapsInLanes
from .conv2d_nchwc import Conv2dNCHWc
from .conv2d_transpose import Conv2dTranspose
from .depthwise_conv2d import DepthwiseConv2d
from .depthwise_conv2d_nchwc import DepthwiseConv2dNCHWc
from .fallback import Fallback
from .injective import Injective
from .int8_matmul_amx import Int8MatmulAmx
from .int8_matmul_vnni import Int8MatmulVnni
from .matmul_epilogue import MatmulEpilogue
from .matmul_multi_output import MatmulMultiOutput
from .pooling import Pooling
from .reduction import Reduction
from .resize import Resize
from .skip_norm import SkipNorm
from .softmax import Softmax
from .softmax_outer_axis import SoftmaxOverOuterAxis
from .squeeze_excitation import SqueezeExcitation
from .whole_reduction import WholeTensorReduction
from .winograd_conv2d_nchwc import WinogradConv2dNCHWc

__all__ = ["Attention", "Bf16MatmulAmx", "Bf16MatmulAvx512", "Conv2dNCHW", "Conv2dNCHWc", "Conv2dTranspose", "ConvTapsInLanes", "DepthwiseConv2d",
           "DepthwiseConv2dNCHWc", "Fallback", "Injective", "Int8MatmulAmx", "Int8MatmulVnni", "MatmulEpilogue", "MatmulMultiOutput",
           "Pooling", "Reduction", "Resize", "SkipNorm", "Softmax", "SoftmaxOverOuterAxis",
           "SqueezeExcitation", "WholeTensorReduction", "WinogradConv2dNCHWc"]

"""AVX512_BF16's ``vdpbf16ps`` as TensorIR can call it: 16 float32 lanes, each plus the 2
products of a pair of bf16 in each operand.

TVM 0.27 cannot pass the instruction its operands: its LLVM intrinsic takes ``<32 x bfloat>``
vectors, which TVM neither forms (its bf16 legalization widens every bf16 value to float32, and
a bfloat vector made after that crashes its LLVM backend) nor accepts from a reinterpret. So
``dpbf16ps`` calls a function of a few lines of LLVM IR (``DPBF16PS_LLVM``) that takes the
operands as ``<16 x i32>``, each i32 a pair of bf16 bits, bitcasts them and calls the
instruction. A kernel links that IR into its module with the ``pragma_import_llvm`` annotation
on one of its loops (``IMPORT_ANNOTATION``); LLVM inlines the function, and the kernel's code is
the instruction itself.
"""

from tvm import tirx
from tvm.ir import Expr

IMPORT_ANNOTATION = "pragma_import_llvm"
DPBF16PS_FUNCTION = "tvm_fusion_dpbf16ps"
# linkonce_odr: every kernel of a module links its own copy in, and the linker keeps one.
DPBF16PS_LLVM = f"""
define linkonce_odr <16 x float> @{DPBF16PS_FUNCTION}(<16 x float> %sum, <16 x i32> %a, <16 x i32> %b) #0 {{
  %a_pairs = bitcast <16 x i32> %a to <32 x bfloat>
  %b_pairs = bitcast <16 x i32> %b to <32 x bfloat>
  %result = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %sum, <32 x bfloat> %a_pairs, <32 x bfloat> %b_pairs)
  ret <16 x float> %result
}}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
attributes #0 = {{ alwaysinline nounwind memory(none) "target-features"="+avx512f,+avx512bf16" }}
"""
LANES = 16  # float32 sums per instruction, each adding 2 bf16 x bf16 products


def dpbf16ps(sums: Expr, a_pairs: Expr, b_pairs: Expr) -> Expr:
    """``sums`` (float32x16) plus the products of the bf16 pairs in ``a_pairs`` and ``b_pairs``
    (int32x16, each lane two bf16's bits, the lower k in the lower half): the kernel calling it
    must import ``DPBF16PS_LLVM``."""
    return tirx.call_extern(f"float32x{LANES}", DPBF16PS_FUNCTION, sums, a_pairs, b_pairs)

"""One module per pattern with a fused ONNX op, named after the pattern: the builder that turns
one match's ONNX nodes into ``tvm_fusion`` nodes, the ``onnx.reference`` OpRun that defines each
op in numpy, and the module's ``SPEC`` (``spec.OnnxSpec``) that ``registry`` finds them by.

A pattern that shares another's builder has a short module of its own that says so
(``flattened_linear`` writes ``gemm_epilogue``'s op); ``activation`` holds the op the six
activation rewrites share, and has no ``SPEC``.
"""

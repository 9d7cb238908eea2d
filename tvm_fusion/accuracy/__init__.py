"""Numerical accuracy against a reference run: the error measures (``output_error``, pure numpy)
that ``bench`` reports for every runner against ONNX Runtime float32, and the checks that a
reduced-precision (bf16) build is judged by."""

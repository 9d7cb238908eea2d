"""Model frontends (ONNX for now)."""

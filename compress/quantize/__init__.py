"""INT8 quantization methods and their kernels, SmoothQuant, ONNX export."""

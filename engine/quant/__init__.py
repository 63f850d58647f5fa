"""Quantized layer types the engine runs (INT8 weight-only and W8A8) and their CPU kernel loaders."""

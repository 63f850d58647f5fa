import torch

from compress.int8 import dequantize_weight, dynamic_int8_linear, quantize_weight_per_channel


def test_per_channel_roundtrip_error_bounded_by_half_step():
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    q, scale = quantize_weight_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (32,)
    assert (dequantize_weight(q, scale) - w).abs().max() <= scale.max() / 2 + 1e-6


def test_dynamic_linear_close_to_float():
    torch.manual_seed(0)
    w, b, x = torch.randn(64, 32), torch.randn(64), torch.randn(5, 32)
    layer = dynamic_int8_linear(*quantize_weight_per_channel(w), b)
    ref = x @ w.T + b
    assert (layer(x) - ref).abs().max() < 0.05 * ref.abs().max()

import pytest
import torch
import torch.nn.functional as F

from engine.kernel_paths import forced_cpu_kernel_path
from engine.platform import exact_int8_gemm_cpu
from engine.quant import int8
from engine.quant.int8 import (
    Int8WeightOnlyLinear,
    W8A8Linear,
    amx_cpu_kernel,
    amx_cpu_kernel_reason,
    block_hadamard,
    cpu_int8_flags,
    dequantize_weight,
    format_microbench,
    fused_cpu_kernels,
    fused_cpu_kernels_reason,
    gemm_microbench,
    hadamard_matrix,
    int8_linear,
    quantize_per_token,
    quantize_weight_per_channel,
    weight_only_cpu_kernel,
)


def test_per_channel_roundtrip_error_bounded_by_half_step():
    torch.manual_seed(0)
    w = torch.randn(32, 48)
    q, scale = quantize_weight_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (32,)
    assert (dequantize_weight(q, scale) - w).abs().max() <= scale.max() / 2 + 1e-6


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_weight_only_equals_the_dequantized_float_linear(rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(64, 32), torch.randn(64), torch.randn(2, rows, 32)
    w8, scale = quantize_weight_per_channel(w)
    layer = Int8WeightOnlyLinear(w8, scale, b)
    expected = x @ dequantize_weight(w8, scale).T + b  # [2, rows, 64]
    got = layer(x)
    assert got.shape == (2, rows, 64) and got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    got_bf16 = layer(x.bfloat16())
    assert got_bf16.dtype == torch.bfloat16
    assert (got_bf16.float() - expected).abs().max() < 0.02 * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_decode_kernel_equals_the_dequantized_linear(dtype, kernel_path_allows):
    """The C++ decode kernel: 1-8 rows, an odd output count and K not a multiple of 64 (tails)."""
    kernel_path_allows("gemv")
    weight_only_cpu_kernel(True)
    if not weight_only_cpu_kernel():
        pytest.fail("weight-only INT8 CPU kernel did not build")
    torch.manual_seed(0)
    w, b = torch.randn(67, 200), torch.randn(67)
    w8, scale = quantize_weight_per_channel(w)
    layer = Int8WeightOnlyLinear(w8, scale, b)
    for rows in range(1, 9):
        x = torch.randn(rows, 200).to(dtype)
        got = layer(x)
        ref = x.float() @ dequantize_weight(w8, scale).T + b
        assert got.dtype == dtype and got.shape == (rows, 67)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_kernel_epilogues_round_as_the_torch_ops(dtype, kernel_path_allows):
    """The residual add and SwiGLU epilogues of the decode kernel (the layer's ``add`` and ``silu_mul``):
    ``residual + y`` bit for bit, and ``silu(gate) * up`` of the ``[gate; up]`` output to the last bit of
    x's dtype (its exp is not ATen's)."""
    kernel_path_allows("gemv")
    assert weight_only_cpu_kernel(True), "weight-only INT8 CPU kernel did not build"
    torch.manual_seed(0)
    w, b = torch.randn(130, 200), torch.randn(130)
    w8, scale = quantize_weight_per_channel(w)
    layer = Int8WeightOnlyLinear(w8, scale, b)
    ops = int8._GEMV.ops
    for rows in (1, 3, 8):
        x, residual = torch.randn(rows, 200).to(dtype), torch.randn(rows, 130).to(dtype)
        y = layer(x)
        assert torch.equal(layer.add(x, residual), residual + y)
        gate, up = y.chunk(2, dim=-1)
        got = ops.weight_only_mm(x, w8, scale, b, None, True)
        assert got.shape == (rows, 65) and got.dtype == dtype
        assert torch.equal(layer.silu_mul(x), got)  # the layer's own SwiGLU is the epilogue
        ulp = 2**-7 if dtype == torch.bfloat16 else 2**-22
        torch.testing.assert_close(got, F.silu(gate) * up, rtol=ulp, atol=1e-6)
    with pytest.raises(RuntimeError, match="residual or silu_mul"):
        ops.weight_only_mm(x, w8, scale, b, residual, True)


@pytest.fixture
def int8_activations_at_every_row_count(monkeypatch):
    """``W8A8Linear`` quantizes the activations of every input: no weight-only path for few rows."""
    monkeypatch.setattr(int8, "W8A8_GEMV_MAX_ROWS", 0)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_w8a8_equals_int8_arithmetic_with_per_token_scales(rows, int8_activations_at_every_row_count):
    torch.manual_seed(0)
    w, b, x = torch.randn(48, 96), torch.randn(48), torch.randn(rows, 96)
    x[:, 3] *= 30  # an outlier channel: per-token scales keep the other rows' precision
    w8, scale = quantize_weight_per_channel(w)
    layer = int8_linear("w8a8", w8, scale, b)
    assert isinstance(layer, W8A8Linear)
    xq, x_scale = quantize_per_token(x)
    exact = (xq.double() @ w8.double().T) * x_scale.double() * scale.double() + b.double()  # [rows, 48]
    got = layer(x)
    assert torch.allclose(got.double(), exact, atol=1e-3, rtol=1e-4)
    reference = x @ w.T + b
    assert (got - reference).abs().max() < 0.03 * reference.abs().max()
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="scheme 'int4'"):
        int8_linear("int4", w8, scale)


@pytest.fixture
def aten_path_restored():
    """The fused oneDNN-path kernels forced (AMX off, so an AMX CPU runs them too); both re-enabled afterwards."""
    amx_cpu_kernel(False)
    yield
    fused_cpu_kernels(True)
    amx_cpu_kernel(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a8_fused_cpu_kernel_is_bit_identical_to_the_aten_path(
    dtype, with_bias, aten_path_restored, kernel_path_allows
):
    kernel_path_allows("fused")
    if not fused_cpu_kernels():
        pytest.fail(f"fused w8a8 CPU kernels did not build: {fused_cpu_kernels_reason()}")
    torch.manual_seed(0)
    w, b = torch.randn(40, 72), torch.randn(40) if with_bias else None
    x = (torch.randn(3, 23, 72) * torch.rand(3, 23, 1) * 8).to(dtype)  # [batch, rows, in], rows of varied range
    x[0, 0] = 0  # an all-zero row takes the 1e-8 scale floor
    x[1, :, 5] *= 40  # an outlier channel
    w8, scale = quantize_weight_per_channel(w)
    layer = W8A8Linear(w8, scale, b)
    xq_fused, scale_fused = torch.ops.lmforge_int8.quantize_per_token(x.reshape(-1, 72))
    fused = layer(x)
    fused_cpu_kernels(False)
    xq, x_scale = quantize_per_token(x.reshape(-1, 72))
    aten = layer(x)
    assert torch.equal(xq_fused, xq) and torch.equal(scale_fused, x_scale)
    assert fused.dtype == dtype and fused.shape == (3, 23, 40)
    assert torch.equal(fused, aten)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_fused_epilogues_round_once_where_the_aten_path_rounds_twice(
    dtype, aten_path_restored, kernel_path_allows
):
    kernel_path_allows("fused")
    if not fused_cpu_kernels():
        pytest.fail(f"fused w8a8 CPU kernels did not build: {fused_cpu_kernels_reason()}")
    torch.manual_seed(1)
    half, in_features = 45, 100  # 2 x 16 columns + a tail of 13 per half; 100 = 6 x 16 + 4 inputs
    w, b = torch.randn(2 * half, in_features), torch.randn(2 * half)
    w8, scale = quantize_weight_per_channel(w)
    gated, square = W8A8Linear(w8, scale, b), W8A8Linear(*quantize_weight_per_channel(torch.randn(2 * half, 100)))
    x = (torch.randn(19, in_features) * 3).to(dtype)
    residual = torch.randn(19, 2 * half).to(dtype)
    fused = gated.silu_mul(x), square.add(x, residual)
    xq, x_scale = quantize_per_token(x)
    acc = (xq.double() @ w8.double().T) * x_scale.double() * scale.double() + b.double()  # [19, 2 half]
    gate, up = acc.chunk(2, dim=-1)
    fused_cpu_kernels(False)
    aten = gated.silu_mul(x), square.add(x, residual)
    exact_silu_mul = F.silu(gate) * up
    exact_add = (xq.double() @ square.weight_int8.double().T) * x_scale.double() * square.weight_scale.double()
    exact_add = exact_add + residual.double()
    tol = 2**-8 if dtype == torch.bfloat16 else 2e-6  # bf16: half a unit in the last place; fp32: a few ulps + exp
    for got, unfused, exact in zip(fused, aten, (exact_silu_mul, exact_add), strict=True):
        assert got.dtype == unfused.dtype == dtype and got.shape == unfused.shape == exact.shape
        torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol * exact.abs().max().item())
        # one rounding of the float32 result against the ATen path's rounding of the GEMM output first
        assert (got.double() - exact).abs().mean() <= (unfused.double() - exact).abs().mean() * 1.01
    # the op's argument checks (on an AVX2-only CPU the layers above ran the fp32 GEMM and packed nothing)
    packed = torch.ops.onednn.qlinear_prepack(square.weight_int8, None)
    with pytest.raises(RuntimeError, match="residual must be"):
        torch.ops.lmforge_int8.w8a8_linear_epilogue(
            x, packed, square.weight_scale, square._zero_points, None, residual[:, :5], False
        )
    with pytest.raises(RuntimeError, match="not both or neither"):
        torch.ops.lmforge_int8.w8a8_linear_epilogue(
            x, packed, square.weight_scale, square._zero_points, None, None, False
        )


def test_microbench_times_every_variant_and_names_the_fastest():
    results = gemm_microbench([(64, 32, 2)], rows=(1, 8), threads=1, repeats=1, number=1)
    assert set(results) == {"M=1", "M=8"}
    assert set(results["M=1"]) == {"fp32", "bf16", "int8-weight-only", "int8-weight-only-fp32", "w8a8"}
    assert all(v > 0 for times in results.values() for v in times.values())
    assert "fastest:" in format_microbench(results)


@pytest.fixture
def amx_restored(int8_activations_at_every_row_count):
    """AMX re-enabled afterwards."""
    yield
    amx_cpu_kernel(True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w8a8_few_rows_without_amx_run_a_gemv_on_the_plain_weight(dtype, amx_restored, monkeypatch):
    """Without AMX, 1 to ``W8A8_GEMV_MAX_ROWS`` rows run ``w8a8_gemv`` where the CPU has VNNI or AVX2 (the quantized
    activations and exact int32 sums of the path more rows run: with VNNI the oneDNN path's numbers bit for bit,
    epilogues included; AVX2-only, the fp32 GEMM's for the plain product, whose add and SwiGLU round twice),
    else the weight-only kernel (float activations)."""
    monkeypatch.setattr(int8, "W8A8_GEMV_MAX_ROWS", 4)
    torch.manual_seed(2)
    half, in_features = 37, 130
    w, b = torch.randn(2 * half, in_features), torch.randn(2 * half)
    w8, scale = quantize_weight_per_channel(w)
    layer = W8A8Linear(w8, scale, b)
    float_weight = (w8.double() * scale.double()[:, None]).T  # [in, 2 half]
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    gemv = weight_only_cpu_kernel() and not amx_cpu_kernel()
    w8a8_gemv = gemv and int8._use_fused() and int8._int8_gemv_cpu()
    for rows in (1, 4, 5):
        x = (torch.randn(rows, in_features) * 3).to(dtype)
        residual = torch.randn(rows, 2 * half).to(dtype)
        exact = x.double() @ float_weight + b.double()  # float activations: what the weight-only kernel computes
        xq, x_scale = quantize_per_token(x)
        exact_w8a8 = (xq.double() @ w8.double().T) * x_scale.double() * scale.double() + b.double()
        expected = exact if gemv and rows <= 4 and not w8a8_gemv else exact_w8a8
        for got, ref in (
            (layer(x), expected),
            (layer.add(x, residual), expected + residual.double()),
            (layer.silu_mul(x), F.silu(expected[:, :half]) * expected[:, half:]),
        ):
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        if w8a8_gemv and rows <= 4:  # the same numbers as the path more rows run
            monkeypatch.setattr(int8, "W8A8_GEMV_MAX_ROWS", 0)
            wide = (layer(x), layer.add(x, residual), layer.silu_mul(x))
            monkeypatch.setattr(int8, "W8A8_GEMV_MAX_ROWS", 4)
            few = (layer(x), layer.add(x, residual), layer.silu_mul(x))
            compared = 3 if exact_int8_gemm_cpu() else 1
            assert all(torch.equal(a, e) for a, e in zip(few[:compared], wide[:compared]))


def test_w8a8_gemv_follows_replaced_weights(amx_restored):
    """The few-row path keeps plain references to the layer's buffers; a buffer replaced after a call (another tensor
    set in its place) is what the next call reads. (Weights are never changed in place after the first call: the
    oneDNN-packed copy is made once too.)"""
    torch.manual_seed(4)
    w8, scale = quantize_weight_per_channel(torch.randn(24, 64))
    layer = W8A8Linear(w8, scale, None)
    if not weight_only_cpu_kernel():
        return  # no GEMV kernel built here: the few-row path is the oneDNN one
    x = torch.randn(1, 64)
    first = layer._gemv(x)
    other8, other_scale = quantize_weight_per_channel(torch.randn(24, 64))
    layer.weight_int8, layer.weight_scale = other8.clone(), other_scale.clone()
    torch.testing.assert_close(layer._gemv(x), W8A8Linear(other8, other_scale, None)._gemv(x), rtol=0, atol=0)
    assert not torch.equal(layer._gemv(x), first)


def _amx_expected() -> bool:
    """Whether this machine should run the AMX kernels (CPU flags and a successful build)."""
    if forced_cpu_kernel_path() not in ("auto", "amx"):  # held off before the CPU flags are even read
        assert not amx_cpu_kernel() and "forbidden" in amx_cpu_kernel_reason()
        return False
    if "amx_int8" not in cpu_int8_flags():
        assert not amx_cpu_kernel() and "lacks" in amx_cpu_kernel_reason()  # the fallback is chosen, and said why
        return False
    if not amx_cpu_kernel():
        pytest.fail(f"the CPU has AMX-INT8 but the AMX kernels are not in use: {amx_cpu_kernel_reason()}")
    return True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w8a8_amx_kernel_is_bit_identical_to_the_onednn_path(dtype, amx_restored):
    amx = _amx_expected()
    torch.manual_seed(0)
    for out_features, in_features in ((40, 72), (67, 130), (18, 576)):  # N not a multiple of 16, K not of 64
        w, b = torch.randn(out_features, in_features), torch.randn(out_features)
        w8, scale = quantize_weight_per_channel(w)
        for layer in (W8A8Linear(w8, scale, b), W8A8Linear(w8, scale)):
            for rows in (1, 3, 17, 65):
                x = (torch.randn(rows, in_features) * torch.rand(rows, 1) * 8).to(dtype)
                x[0] = 0  # the 1e-8 scale floor
                x[-1, 5] *= 40  # an outlier channel
                got = layer(x)
                amx_cpu_kernel(False)
                onednn = layer(x)
                amx_cpu_kernel(True)
                assert got.dtype == dtype and got.shape == (rows, out_features)
                assert torch.equal(got, onednn), (amx, out_features, in_features, rows)
                xq, x_scale = quantize_per_token(x)
                exact = (xq.double() @ w8.double().T) * x_scale.double() * scale.double()
                exact = exact + (b.double() if layer.bias is not None else 0)
                tol = 2**-8 if dtype == torch.bfloat16 else 1e-6
                torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol * exact.abs().max().item())


def test_amx_quantizer_equals_the_reference_over_every_bf16_magnitude():
    if not _amx_expected():
        return
    positive = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # every finite |x|
    amax = positive[torch.linspace(1, len(positive) - 1, 61).long()]  # row maxima from tiny to 3e38
    x = torch.where(positive[None, :] <= amax[:, None], positive[None, :], amax[:, None])  # [61, 32640]
    x = torch.cat((x, -x, torch.zeros(1, x.shape[1], dtype=x.dtype)))
    x[3, 7] = float("inf")  # a row whose scale is infinite takes the division (inf / inf itself is NaN in both)
    q, scale = torch.ops.lmforge_int8_amx.quantize_per_token(x)
    q_ref, scale_ref = quantize_per_token(x)
    finite = x.isfinite()
    assert torch.equal(scale, scale_ref) and torch.equal(q[finite], q_ref[finite])
    q32, scale32 = torch.ops.lmforge_int8_amx.quantize_per_token(x.float() * 1.001)
    q32_ref, scale32_ref = quantize_per_token(x.float() * 1.001)
    assert torch.equal(scale32, scale32_ref) and torch.equal(q32[finite], q32_ref[finite])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w8a8_add_and_silu_mul_epilogues_equal_the_float_reference(dtype, amx_restored):
    _amx_expected()
    torch.manual_seed(0)
    half, in_features = 37, 130  # each half padded to 16 channels on its own
    w, b = torch.randn(2 * half, in_features), torch.randn(2 * half)
    w8, scale = quantize_weight_per_channel(w)
    layer = W8A8Linear(w8, scale, b)
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    for rows in (1, 17, 65):
        x = (torch.randn(2, rows, in_features) * 3).to(dtype)  # [batch, rows, in]
        residual = torch.randn(2, rows, 2 * half).to(dtype)
        xq, x_scale = quantize_per_token(x.reshape(-1, in_features))
        exact = (xq.double() @ w8.double().T) * x_scale.double() * scale.double() + b.double()  # [2 rows, 2 half]
        gate, up = exact.chunk(2, dim=-1)
        silu_mul = layer.silu_mul(x)
        assert silu_mul.dtype == dtype and silu_mul.shape == (2, rows, half)
        reference = (F.silu(gate) * up).reshape(2, rows, half)
        torch.testing.assert_close(silu_mul.double(), reference, rtol=tol, atol=tol * reference.abs().max().item())
        added = layer.add(x, residual)
        reference = exact.reshape(2, rows, 2 * half) + residual.double()
        assert added.dtype == dtype and added.shape == residual.shape
        torch.testing.assert_close(added.double(), reference, rtol=tol, atol=tol * reference.abs().max().item())
    with pytest.raises(ValueError, match="even out_features"):
        W8A8Linear(w8[:-1], scale[:-1]).silu_mul(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w8a8_outlier_channels_get_their_own_per_token_scale(dtype, amx_restored):
    amx = _amx_expected()
    torch.manual_seed(0)
    half, in_features = 37, 130
    w, b = torch.randn(2 * half, in_features), torch.randn(2 * half)
    w8, scale = quantize_weight_per_channel(w)
    outliers = torch.tensor([120, 3, 64, 9])  # unsorted on purpose
    layer = W8A8Linear(w8, scale, b, outliers)
    assert layer.outlier_channels.tolist() == [3, 9, 64, 120]
    rest = torch.tensor([c for c in range(in_features) if c not in (3, 9, 64, 120)])
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    for rows in (1, 17, 65):
        x = (torch.randn(rows, in_features) * 2).to(dtype)
        x[:, [3, 9, 64, 120]] *= 30  # the channels that would otherwise set every row's scale
        q1, s1 = quantize_per_token(x[:, rest])
        q2, s2 = quantize_per_token(x[:, [3, 9, 64, 120]])
        exact = (q1.double() @ w8[:, rest].double().T) * s1.double() + (
            q2.double() @ w8[:, [3, 9, 64, 120]].double().T
        ) * s2.double()
        exact = exact * scale.double() + b.double()  # [rows, 2 half]
        residual = torch.randn(rows, 2 * half).to(dtype)
        gate, up = exact.chunk(2, dim=-1)
        for use_amx in (True, False):
            amx_cpu_kernel(use_amx)
            got, added, gated = layer(x), layer.add(x, residual), layer.silu_mul(x)
            assert got.dtype == dtype and got.shape == (rows, 2 * half), (amx, use_amx)
            torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol * exact.abs().max().item())
            reference = exact + residual.double()
            torch.testing.assert_close(added.double(), reference, rtol=tol, atol=tol * reference.abs().max().item())
            reference = F.silu(gate) * up
            torch.testing.assert_close(gated.double(), reference, rtol=tol, atol=tol * reference.abs().max().item())
        amx_cpu_kernel(True)
        truth = x.double() @ dequantize_weight(w8, scale).double().T + b.double()
        one_scale = W8A8Linear(w8, scale, b)(x).double()  # the outliers' scale rounds the small channels coarsely
        assert (one_scale - truth).abs().mean() > 2 * (layer(x).double() - truth).abs().mean()
    for bad, match in (
        (torch.tensor([3, 3]), "twice"),
        (torch.tensor([130]), "in \\[0, 130\\)"),
        (torch.tensor([]), "1 to"),
    ):
        with pytest.raises(ValueError, match=match):
            W8A8Linear(w8, scale, None, bad.long())


def _butterflies(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x [M, K]`` float32 times H_block on each run of ``block``: the fast Walsh-Hadamard stages of stride 1, 2,
    ... in float32, the adds of the C++ scalar loop in its order."""
    v = x.reshape(-1, block)
    h = 1
    while h < block:
        pairs = v.view(v.shape[0], block // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        v = torch.stack((a + b, a - b), dim=2).reshape(v.shape)
        h *= 2
    return v.reshape(x.shape)


# 2 and 4: the scalar butterflies; 8 and up: AVX2's lane permutes; 16 and up: AVX-512's, where built
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [2, 4, 8, 64, 256])
def test_block_hadamard_equals_the_matrix_product(dtype, block, aten_path_restored):
    h = hadamard_matrix(block)
    assert torch.equal(h @ h.T, block * torch.eye(block)) and torch.equal(h, h.T)
    torch.manual_seed(0)
    x = (torch.randn(5, 512) * 4).to(dtype)
    reference = (x.double().reshape(-1, block) @ h.double()).reshape(5, 512)  # [5, 512]
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-6
    for fused in (True, False):  # the C++ butterflies, the float32 matmul
        fused_cpu_kernels(fused)
        got = block_hadamard(x, block)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), reference, rtol=tol, atol=tol * reference.abs().max().item())
        if fused and fused_cpu_kernels():  # every vector path: the scalar loop's float32 adds, bit for bit
            assert torch.equal(got, _butterflies(x.float(), block).to(dtype))
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w8a8_input_hadamard_rotates_once_on_every_path(dtype, amx_restored, monkeypatch):
    """``y = Q(x H) W'^T`` with ``W' = W H / b``: the plain, add and silu_mul calls, few rows (weight-only kernel)
    and many, and the outlier spread: one channel of x at 40x no longer sets its token's scale."""
    monkeypatch.setattr(int8, "W8A8_GEMV_MAX_ROWS", 4)
    torch.manual_seed(3)
    block, in_features, out_features = 64, 128, 48
    w, b = torch.randn(out_features, in_features), torch.randn(out_features)
    h = hadamard_matrix(block, torch.float64)
    rotated = (w.double().view(out_features, -1, block) @ h).view_as(w) / block  # W H / b, [out, in]
    w8, scale = quantize_weight_per_channel(rotated.float())
    layer = int8_linear("w8a8", w8, scale, b, input_hadamard=torch.tensor([block]))
    assert isinstance(layer, W8A8Linear) and layer.input_hadamard == block
    plain = W8A8Linear(w8, scale, b)
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    for rows in (1, 4, 40):
        x = torch.randn(rows, in_features) * 2
        x[:, 5] *= 40
        x = x.to(dtype)
        xh = block_hadamard(x, block)
        expected = plain(xh).double()  # the rotation applied once, then the layer's own path
        residual = torch.randn(rows, out_features).to(dtype)
        torch.testing.assert_close(layer(x).double(), expected, rtol=tol, atol=tol * expected.abs().max().item())
        added = layer.add(x, residual).double()
        reference = expected + residual.double()
        torch.testing.assert_close(added, reference, rtol=tol, atol=tol * reference.abs().max().item())
        truth = x.double() @ w.double().T + b.double()
        if rows > 4:  # INT8 activations: the rotated layer is closer to the float truth than the unrotated one
            unrotated = W8A8Linear(*quantize_weight_per_channel(w), b)(x).double()
            assert (layer(x).double() - truth).abs().mean() < 0.5 * (unrotated - truth).abs().mean()
    gated = int8_linear("w8a8", w8, scale, b, input_hadamard=block)
    gate, up = plain(block_hadamard(x, block)).double().chunk(2, dim=-1)
    reference = F.silu(gate) * up
    torch.testing.assert_close(gated.silu_mul(x).double(), reference, rtol=tol, atol=tol * reference.abs().max().item())
    for bad in (48, 3, 256):
        with pytest.raises(ValueError, match="input_hadamard"):
            W8A8Linear(w8, scale, b, input_hadamard=bad)
    with pytest.raises(ValueError, match="w8a8 scheme only"):
        int8_linear("weight-only", w8, scale, b, input_hadamard=block)


def test_w8a8_gemv_refuses_inputs_it_cannot_take():
    if not int8._use_fused():
        pytest.skip(f"fused INT8 kernels not in use: {int8.fused_cpu_kernels_reason()}")
    w8 = torch.ones(6, 8, dtype=torch.int8)
    args = (w8, w8.sum(1, dtype=torch.int32), torch.ones(6), None)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        torch.ops.lmforge_int8.w8a8_gemv(torch.randn(5, 8), *args)
    with pytest.raises(RuntimeError, match="w_sum must be contiguous int32"):
        torch.ops.lmforge_int8.w8a8_gemv(torch.randn(2, 8), w8, torch.ones(6), torch.ones(6), None)
    with pytest.raises(RuntimeError, match="residual must be"):
        torch.ops.lmforge_int8.w8a8_gemv(torch.randn(2, 8), *args, torch.randn(2, 5))


def _fused_kernels_and_extreme_weight(kernel_path_allows, in_features: int, seed: int):
    """The fused w8a8 kernels built (else the test fails), and ``(w8 [70, in] int8, w_scale [70])`` seeded, its first
    rows all +127 and all -127 (where a saturating int16 pair sum would go wrong)."""
    kernel_path_allows("fused")
    if not int8._use_fused():
        pytest.fail(f"fused w8a8 CPU kernels did not build: {int8.fused_cpu_kernels_reason()}")
    torch.manual_seed(seed)
    w8 = torch.randint(-127, 128, (70, in_features), dtype=torch.int8)
    w8[0] = 127
    w8[1] = -127
    return w8, torch.rand(70) * 0.01 + 1e-3


@pytest.mark.parametrize("in_features", [5, 32, 101, 576, 1536])
def test_w8a8_gemm_i16_sums_equal_the_exact_integer_products(in_features, kernel_path_allows):
    """``w8a8_gemm_i16`` (the AVX2 int16 GEMM, a scalar loop elsewhere) sums q x w exactly for any row count (tiles of
    4 rows and their tails), column count (panels of 16 and a part) and odd ``in`` (a zero pair), +-127 included:
    ``float(sum) * w_scale * x_scale`` rounded once, bit for bit; the residual and SwiGLU epilogues round once too."""
    w8, scale = _fused_kernels_and_extreme_weight(kernel_path_allows, in_features, seed=6)
    n = w8.shape[0]
    bias = torch.randn(n)
    packed = torch.ops.lmforge_int8.pack_weight_i16(w8)
    assert packed.shape == (5, (in_features + 1) // 2, 16, 2) and packed.dtype == torch.int16
    for rows in (1, 3, 4, 9, 64):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, in_features)
            x[0, ::2], x[0, 1::2] = 5.0, -5.0  # quantizes to +-127
            x = x.to(dtype)
            xq, x_scale = quantize_per_token(x)
            plain = (xq.long() @ w8.long().T).float() * scale * x_scale  # [rows, n], exact sums
            got = torch.ops.lmforge_int8.w8a8_gemm_i16(x, packed, scale, None)
            assert torch.equal(got, plain.to(dtype))
            residual = torch.randn(rows, n).to(dtype)
            got = torch.ops.lmforge_int8.w8a8_gemm_i16(x, packed, scale, bias, residual)
            assert torch.equal(got, (plain + bias + residual.float()).to(dtype))
            got = torch.ops.lmforge_int8.w8a8_gemm_i16(x, packed, scale, bias, None, True)
            gate, up = (plain + bias).chunk(2, dim=-1)
            tol = 1e-5 if dtype == torch.float32 else 8e-3
            torch.testing.assert_close(got, (F.silu(gate) * up).to(dtype), rtol=tol, atol=1e-6)
    with pytest.raises(RuntimeError, match="pack_weight_i16 of an int8"):
        torch.ops.lmforge_int8.w8a8_gemm_i16(torch.randn(2, in_features + 2), packed, scale, None)


def test_w8a8_layer_runs_the_int16_gemm_where_onednn_is_not_exact(monkeypatch, kernel_path_allows):
    """Without an exact oneDNN int8 GEMM (AVX2 and no VNNI) a ``W8A8Linear`` of more rows than the GEMV takes runs
    ``w8a8_gemm_i16`` on an int16 copy of its weight (no float32 copy) with the same numbers as the exact products;
    ``add`` and ``silu_mul`` take its epilogues."""
    kernel_path_allows("fused")
    if not int8._use_fused():
        pytest.fail(f"fused w8a8 CPU kernels did not build: {int8.fused_cpu_kernels_reason()}")
    monkeypatch.setattr(int8, "_int16_gemm_cpu", lambda: True)
    torch.manual_seed(7)
    w8 = torch.randint(-127, 128, (48, 40), dtype=torch.int8)
    scale = torch.rand(48) * 0.01 + 1e-3
    layer = W8A8Linear(w8, scale)
    x = torch.randn(2, 6, 40)
    xq, x_scale = quantize_per_token(x.reshape(12, 40))
    plain = ((xq.long() @ w8.long().T).float() * scale * x_scale).reshape(2, 6, 48)
    assert torch.equal(layer(x), plain)
    assert layer._packed_i16 is not None and layer._weight_float is None
    residual = torch.randn(2, 6, 48)
    assert torch.equal(layer.add(x, residual), plain + residual)
    gate, up = plain.chunk(2, dim=-1)
    torch.testing.assert_close(layer.silu_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("in_features", [32, 100, 576, 1536])
def test_w8a8_gemv_sums_equal_the_exact_integer_products(in_features, kernel_path_allows):
    """``w8a8_gemv``'s int32 sums are the exact ones on whichever instructions this CPU compiled it for (VNNI u8 x s8,
    AVX2 |w| x sign(w) q, scalar), weights and activations at +-127 included (where a saturating int16 pair sum of
    u8 q + 128 x w would go wrong): ``float(sum) * w_scale * x_scale`` rounded once, bit for bit."""
    w8, scale = _fused_kernels_and_extreme_weight(kernel_path_allows, in_features, seed=5)
    for rows in (1, 2, 3, 4):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, in_features)
            x[0, ::2], x[0, 1::2] = 5.0, -5.0  # quantizes to +-127
            x = x.to(dtype)
            got = torch.ops.lmforge_int8.w8a8_gemv(x, w8, w8.sum(1, dtype=torch.int32), scale, None)
            xq, x_scale = quantize_per_token(x)
            sums = xq.long() @ w8.long().T  # [rows, n], exact
            assert torch.equal(got, (sums.float() * scale * x_scale).to(dtype))

"""Tests of the pseudo-gradient codecs against references written here (numpy, from the format definitions).

Error bounds used below (per element x in a block with absmax A; s = the block scale, s <= A/qmax * (1 + u_s) with
u_s = 2^-23 for fp32 scales (one fp32 division) and 2^-7 for bf16 scales (rounded *up* to bf16, one bf16 ulp);
every bound also allows the fp32 roundings of `x / s` and `q * s`, and |x| itself for subnormal x, which is flushed):

- none: exact.
- bf16: round to nearest with 8 significant bits: |err| <= 2^-8 |x|.
- fp16: 11 significant bits in fp16's normal range: 2^-11 |x|; below it (subnormals, step 2^-24 in scale units)
  at most half a step: 2^-25 s.
- int8: round to nearest integer in scale units: |err| <= s / 2 = A / 254 (fp32 scales).
- fp8 e4m3: 4 significant bits in the normal range (|x / s| >= 2^-6): 2^-4 |x|; subnormal step 2^-9: 2^-10 s.
- fp4 E3M0, nearest in linear space: between 2^-(k+1) and 2^-k the worst point is the midpoint 0.75 * 2^-k, off by
  0.25 * 2^-k = |x| / 3; below 2^-6 the value goes to 0 or 2^-6, off by at most 2^-7 s.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from hf_diloco.core.compression.codecs import CODECS, Codec, make_codec, quantization_residual

NAMES = ("none", "bf16", "fp16", "int8", "fp8", "fp4")
BLOCK_NAMES = ("fp16", "int8", "fp8", "fp4")
SCALE_DTYPES = ("fp32", "bf16")
ALL = [(name, scale) for name in NAMES for scale in SCALE_DTYPES]
# sign has no per-element error bound (it keeps only directions); it joins the tests of format-independent properties.
WITH_SIGN = ALL + [("sign", scale) for scale in SCALE_DTYPES]
TINY = 2.0**-126
QMAX = {"fp16": 65504.0, "int8": 127.0, "fp8": 448.0, "fp4": 1.0}
QMIN = {"fp16": 2.0**-24, "int8": 1.0, "fp8": 2.0**-9, "fp4": 2.0**-6}
VALUE_BITS = {"none": 32, "bf16": 16, "fp16": 16, "int8": 8, "fp8": 8, "fp4": 4}
pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- references built from the format definitions


def _fp8_e4m3fn_table() -> np.ndarray:
    """Value of every byte as float8 e4m3fn (bias 7, no inf, S.1111.111 is NaN)."""
    table = np.empty(256)
    for byte in range(256):
        sign, exponent, mantissa = byte >> 7, (byte >> 3) & 0xF, byte & 7
        if exponent == 15 and mantissa == 7:
            value = np.nan
        elif exponent == 0:
            value = mantissa / 8 * 2.0**-6
        else:
            value = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        table[byte] = -value if sign else value
    return table


def _fp16_magnitudes() -> np.ndarray:
    subnormal = np.arange(1024) * 2.0**-24
    normal = [(1 + m / 1024) * 2.0 ** (e - 15) for e in range(1, 31) for m in range(1024)]
    return np.concatenate([subnormal, normal])


FP8_TABLE = _fp8_e4m3fn_table()
FP4_MAGNITUDES = np.array([0.0] + [2.0**-k for k in range(6, -1, -1)])
FP4_TABLE = np.concatenate([FP4_MAGNITUDES, [0.0], -FP4_MAGNITUDES[1:]])  # code = sign << 3 | exponent


def _grid(name: str) -> np.ndarray:
    """Sorted codes (in scale units) each codec can send."""
    if name == "int8":
        return np.arange(-127, 128, dtype=np.float64)
    if name == "fp8":
        finite = FP8_TABLE[~np.isnan(FP8_TABLE)]
        return np.unique(finite)
    if name == "fp16":
        mags = _fp16_magnitudes()
        return np.unique(np.concatenate([-mags, mags]))
    return np.unique(FP4_TABLE)


def _bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _fp32_to_bf16_nearest_even(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return _bf16_bits_to_fp32(rounded.astype(np.uint16))


def _bf16_round_up(values: np.ndarray) -> np.ndarray:
    """Smallest bf16 >= each positive fp32 value."""
    truncated = (values.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    bumped = (truncated.view(np.uint32) + np.uint32(0x10000)).view(np.float32)
    return np.where(truncated < values, bumped, truncated).astype(np.float32)


def _parse(name: str, payload: torch.Tensor, numel: int, block: int, scale_dtype: str):
    """Split a payload into (codes in scale units as float64, fp32 scales) the way the format defines it."""
    raw = payload.numpy().tobytes()
    value_nbytes = numel * VALUE_BITS[name] // 8
    values, scale_bytes = raw[:value_nbytes], raw[value_nbytes:]
    if name == "int8":
        codes = np.frombuffer(values, dtype=np.int8).astype(np.float64)
    elif name == "fp8":
        codes = FP8_TABLE[np.frombuffer(values, dtype=np.uint8)]
    elif name == "fp16":
        codes = np.frombuffer(values, dtype="<f2").astype(np.float64)
    else:
        packed = np.frombuffer(values, dtype=np.uint8)
        nibbles = np.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)
        assert not np.any(nibbles == 8), "zero must be sent with sign 0"
        codes = FP4_TABLE[nibbles]
    if scale_dtype == "fp32":
        scales = np.frombuffer(scale_bytes, dtype="<f4")
    else:
        scales = _bf16_bits_to_fp32(np.frombuffer(scale_bytes, dtype="<u2"))
    assert scales.size == numel // block
    return codes, scales.astype(np.float32)


def _reference_scales(name: str, x: np.ndarray, block: int, scale_dtype: str) -> np.ndarray:
    absmax = np.abs(x.astype(np.float32)).reshape(-1, block).max(axis=1)
    scales = np.maximum(absmax / np.float32(QMAX[name]), np.float32(TINY / QMIN[name])).astype(np.float32)
    return scales if scale_dtype == "fp32" else _bf16_round_up(scales)


def error_bound(name: str, x: torch.Tensor, block: int, scale_dtype: str) -> torch.Tensor:
    """Largest |decode(encode(x)) - x| allowed per element (see the module docstring for the derivation)."""
    x = x.double()
    ax = x.abs()
    flush = torch.where(ax < TINY, ax, torch.zeros_like(ax))
    if name == "none":
        return torch.zeros_like(x)
    if name == "bf16":
        return 2.0**-8 * ax + flush
    slack = 1 + (2.0**-7 if scale_dtype == "bf16" else 2.0**-23)
    absmax = ax.view(-1, block).amax(dim=1, keepdim=True).expand(-1, block).reshape(-1)
    s = torch.clamp(absmax / QMAX[name] * slack, min=TINY / QMIN[name])
    fp32 = 2.0**-22 * ax  # the fp32 roundings of x / s and q * s
    if name == "fp16":
        bound = 2.0**-11 * ax + 2.0**-25 * s
    elif name == "int8":
        bound = s / 2
    elif name == "fp8":
        bound = 2.0**-4 * ax + 2.0**-10 * s
    else:
        bound = torch.maximum(ax / 3, 2.0**-7 * s)
    return bound * (1 + 2.0**-20) + fp32 + flush


def expected_nbytes(name: str, numel: int, block: int, scale_dtype: str) -> int:
    scale_bytes = 4 if scale_dtype == "fp32" else 2
    formulas = {
        "none": numel * 4,
        "bf16": numel * 2,
        "fp16": numel * 2 + numel // block * scale_bytes,
        "int8": numel + numel // block * scale_bytes,
        "fp8": numel + numel // block * scale_bytes,
        "fp4": numel // 2 + numel // block * scale_bytes,
        "sign": numel // 8 + numel // block * scale_bytes,
    }
    return formulas[name]


def round_trip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x), x.numel())


def assert_within_bound(name: str, x: torch.Tensor, y: torch.Tensor, block: int, scale_dtype: str) -> None:
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.isfinite(y).all()
    err = (y.double() - x.double()).abs()
    bound = error_bound(name, x, block, scale_dtype)
    worst = int(torch.argmax(err - bound))
    assert (err <= bound).all(), f"{name}: x={x[worst].item()!r} -> {y[worst].item()!r}, bound {bound[worst]:.3g}"


# ---------------------------------------------------------------- format and layout


@pytest.mark.parametrize("block", [2, 128])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("name", BLOCK_NAMES)
def test_block_payload_matches_reference(name: str, scale_dtype: str, block: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(block * 24, generator=gen) * torch.logspace(-3, 3, block * 24)[torch.randperm(block * 24)]
    codec = make_codec(name, block, scale_dtype)
    payload = codec.encode(x)
    codes, scales = _parse(name, payload, x.numel(), block, scale_dtype)
    xn = x.numpy()

    np.testing.assert_array_equal(scales, _reference_scales(name, xn, block, scale_dtype))
    # Each code is the nearest sendable code to x / s (up to the fp32 rounding of the division).
    ratio = xn.astype(np.float64).reshape(-1, block) / scales.astype(np.float64)[:, None]
    ratio = ratio.reshape(-1)
    grid = _grid(name)
    idx = np.clip(np.searchsorted(grid, ratio), 1, grid.size - 1)
    nearest = np.minimum(np.abs(grid[idx] - ratio), np.abs(grid[idx - 1] - ratio))
    np.testing.assert_array_less(np.abs(codes - ratio), nearest + 1e-6 * np.abs(ratio) + 1e-300)
    # Decode is exactly code * scale in fp32.
    reference = (codes.astype(np.float32).reshape(-1, block) * scales[:, None]).reshape(-1)
    np.testing.assert_array_equal(codec.decode(payload, x.numel()).numpy(), reference)


def test_bf16_payload_is_round_to_nearest_even() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 1e3
    codec = make_codec("bf16")
    payload = codec.encode(x)
    sent = _bf16_bits_to_fp32(np.frombuffer(payload.numpy().tobytes(), dtype="<u2"))
    np.testing.assert_array_equal(sent, _fp32_to_bf16_nearest_even(x.numpy()))
    np.testing.assert_array_equal(codec.decode(payload, x.numel()).numpy(), sent)


def test_none_payload_is_the_fp32_bytes() -> None:
    x = torch.randn(77)
    payload = make_codec("none").encode(x)
    assert payload.numpy().tobytes() == x.numpy().astype("<f4").tobytes()


@pytest.mark.parametrize("name", list(CODECS))
def test_only_a_codec_whose_payload_is_the_fp32_bytes_says_so(name: str) -> None:
    """An exchange sends the values where they lie for a codec with `payload_is_values` (no encode, no decode)."""
    codec = make_codec(name, 128, "fp32")
    x = torch.randn(4096)
    payload = codec.encode(x)
    is_the_bytes = payload.numel() == 4 * x.numel() and payload.numpy().tobytes() == x.numpy().astype("<f4").tobytes()
    assert codec.payload_is_values == is_the_bytes == (name == "none")


def test_int8_golden_bytes() -> None:
    x = torch.tensor([254.0, -127.0, 1.0, 0.0, -0.9, 0.3, 3.0, -1.0])
    payload = make_codec("int8", block_size=4).encode(x)
    # Block 0: scale 2, codes 127, -64 (-63.5 rounds half to even), 0 (0.5 -> 0), 0.
    # Block 1: scale 3/127, codes round(-0.9*127/3) = -38, round(0.3*127/3) = 13, 127, round(-127/3) = -42.
    assert payload[:8].view(torch.int8).tolist() == [127, -64, 0, 0, -38, 13, 127, -42]
    assert payload[8:].numpy().tobytes() == np.array([2.0, np.float32(3.0) / np.float32(127)], "<f4").tobytes()


def test_fp4_golden_bytes_and_tie_rule() -> None:
    # Scale = absmax = 8. In scale units: 1, -0.5, 0.25, 0 | 0.75 (tie -> 1), 2^-7 (tie -> 2^-6), <2^-7 (-> 0), -2^-6.
    x = torch.tensor([8.0, -4.0, 2.0, 0.0, 6.0, 8 * 2.0**-7, 8 * 2.0**-8, -8 * 2.0**-6])
    payload = make_codec("fp4", block_size=8).encode(x)
    codes = [0x7, 0x8 | 6, 5, 0, 7, 1, 0, 0x8 | 1]
    assert payload[:4].tolist() == [codes[i] | codes[i + 1] << 4 for i in range(0, 8, 2)]
    assert payload[4:].numpy().tobytes() == np.array([8.0], "<f4").tobytes()
    expected = [8.0, -4.0, 2.0, 0.0, 8.0, 8 * 2.0**-6, 0.0, -8 * 2.0**-6]
    assert make_codec("fp4", block_size=8).decode(payload, 8).tolist() == expected


@pytest.mark.parametrize("name,scale_dtype", WITH_SIGN)
@pytest.mark.parametrize("blocks", [1, 3, 257])
def test_encoded_size_and_dtype(name: str, scale_dtype: str, blocks: int) -> None:
    block = 64
    codec = make_codec(name, block, scale_dtype)
    numel = blocks * block
    x = torch.randn(numel)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == codec.encoded_nbytes(numel) == expected_nbytes(name, numel, block, scale_dtype)
    assert codec.align == (1 if name in ("none", "bf16") else block)
    assert codec.name == name
    assert codec.encoded_nbytes(0) == 0 and codec.decode(codec.encode(torch.zeros(0)), 0).numel() == 0


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize("name,scale_dtype", ALL)
@pytest.mark.parametrize("block", [32, 128])
def test_round_trip_error_bound(name: str, scale_dtype: str, block: int) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(block * 40, generator=gen) * 1e-2
    codec = make_codec(name, block, scale_dtype)
    y = round_trip(codec, x)
    assert_within_bound(name, x, y, block, scale_dtype)
    if name == "none":
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", BLOCK_NAMES)
def test_documented_headline_bounds(name: str) -> None:
    """The bounds quoted in the docs, for fp32 scales: int8 absmax/254, fp8 2^-4, fp4 1/3 (in their normal range)."""
    x = torch.randn(128 * 50, generator=torch.Generator().manual_seed(4))
    y = round_trip(make_codec(name), x)
    absmax = x.view(-1, 128).abs().amax(1, keepdim=True).expand(-1, 128).reshape(-1)
    rel = ((y - x).abs() / x.abs()).double()
    if name == "int8":
        assert ((y - x).abs() <= absmax / 254 * (1 + 1e-6)).all()
    elif name == "fp8":
        assert (rel[x.abs() >= absmax / 448 * 2**-6] <= 2**-4 + 1e-6).all()
    elif name == "fp4":
        assert (rel[x.abs() >= absmax * 2**-6] <= 1 / 3 + 1e-6).all()
    else:
        assert (rel[x.abs() >= absmax / 65504 * 2**-14] <= 2**-11 + 1e-6).all()


@pytest.mark.parametrize("name,scale_dtype", WITH_SIGN)
def test_residual_is_what_the_round_trip_drops(name: str, scale_dtype: str) -> None:
    x = torch.randn(256, generator=torch.Generator().manual_seed(5))
    codec = make_codec(name, 128, scale_dtype)
    residual = quantization_residual(codec, x)
    assert torch.equal(residual, x - round_trip(codec, x))
    if name == "none":
        assert not residual.any()


@pytest.mark.parametrize("name,scale_dtype", ALL)
def test_mean_over_workers_close_to_exact_mean(name: str, scale_dtype: str) -> None:
    """Decode each worker's payload, average in fp32, requantize (what the exchange does); compare to the fp32 mean.

    Triangle inequality: |out - mean(x)| <= mean_m bound(x_m) + bound(avg) + the fp32 rounding of the average.
    """
    block, workers = 128, 3
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(block * 16, generator=gen)
    xs = [base + 0.3 * torch.randn(block * 16, generator=gen) for _ in range(workers)]
    codec = make_codec(name, block, scale_dtype)
    avg = sum(round_trip(codec, x) for x in xs) / workers
    out = round_trip(codec, avg)
    exact = torch.stack([x.double() for x in xs]).mean(0)
    first = sum(error_bound(name, x, block, scale_dtype) for x in xs) / workers
    rounding = 4 * 2.0**-24 * torch.stack([x.double().abs() for x in xs]).amax(0)
    bound = first + error_bound(name, avg, block, scale_dtype) + rounding
    assert ((out.double() - exact).abs() <= bound).all()
    # The averaged error is also well inside the per-worker bound on average (errors are not all aligned).
    if name != "none":
        assert (out.double() - exact).abs().mean() < bound.mean()


# ---------------------------------------------------------------- adversarial inputs


@pytest.mark.parametrize("name,scale_dtype", ALL)
def test_all_zeros_decode_to_zeros(name: str, scale_dtype: str) -> None:
    codec = make_codec(name, 64, scale_dtype)
    for x in (torch.zeros(64 * 3), -torch.zeros(64 * 3)):
        y = round_trip(codec, x)
        assert torch.isfinite(y).all() and not y.any()


@pytest.mark.parametrize("name,scale_dtype", ALL)
def test_outlier_block_stays_finite_and_other_blocks_unaffected(name: str, scale_dtype: str) -> None:
    block = 64
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(block * 4, generator=gen) * 1e-3
    x[5] = 1e30
    x[block + 7] = -1e30
    codec = make_codec(name, block, scale_dtype)
    y = round_trip(codec, x)
    assert_within_bound(name, x, y, block, scale_dtype)
    assert y[5].item() == pytest.approx(1e30, rel=2**-3) and y[block + 7].item() == pytest.approx(-1e30, rel=2**-3)
    clean = slice(2 * block, None)
    if name in BLOCK_NAMES:
        assert torch.equal(y[clean], round_trip(codec, x[clean].clone()))


@pytest.mark.parametrize("name,scale_dtype", ALL)
def test_extreme_magnitudes_saturate_instead_of_overflowing(name: str, scale_dtype: str) -> None:
    fmax = torch.finfo(torch.float32).max
    x = torch.tensor([fmax, -fmax, 1.0, -3e38] * 32)
    codec = make_codec(name, 64, scale_dtype)
    y = round_trip(codec, x)
    assert torch.isfinite(y).all()
    assert torch.equal(torch.sign(y[::4]), torch.ones(32)) and torch.equal(torch.sign(y[1::4]), -torch.ones(32))
    if scale_dtype == "fp32":
        assert_within_bound(name, x, y, 64, scale_dtype)
    else:  # the largest bf16 scale may sit one bf16 ulp below absmax / qmax: saturation costs up to 2^-7
        err = (y.double() - x.double()).abs()
        assert (err <= error_bound(name, x, 64, scale_dtype) + 2.0**-7 * x.double().abs()).all()


@pytest.mark.parametrize("name,scale_dtype", ALL)
def test_subnormal_inputs(name: str, scale_dtype: str) -> None:
    """Subnormal blocks, and subnormals next to normal values: no NaN/inf, within bound, same with FTZ on or off."""
    block = 64
    gen = torch.Generator().manual_seed(8)
    tiny = torch.randn(block * 2, generator=gen) * 1e-40
    mixed = torch.randn(block, generator=gen) * 1e-36
    mixed[::3] = 1e-40
    x = torch.cat([tiny, mixed, torch.full((block,), 1e-45)])
    codec = make_codec(name, block, scale_dtype)
    y = round_trip(codec, x)
    assert_within_bound(name, x, y, block, scale_dtype)
    if name != "none":
        assert not y[: block * 2].any()  # subnormals are flushed to zero explicitly, on every machine


@pytest.mark.parametrize("name,scale_dtype", ALL)
def test_mixed_signs_keep_their_sign(name: str, scale_dtype: str) -> None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(128 * 4, generator=gen).abs() + 0.01
    x[::2] *= -1
    y = round_trip(make_codec(name, 128, scale_dtype), x)
    assert ((torch.sign(y) == torch.sign(x)) | (y == 0)).all()
    assert_within_bound(name, x, y, 128, scale_dtype)


@pytest.mark.parametrize("name,scale_dtype", WITH_SIGN)
def test_non_finite_input_stays_in_its_block(name: str, scale_dtype: str) -> None:
    x = torch.randn(128 * 2)
    x[3] = float("nan")
    y = round_trip(make_codec(name, 128, scale_dtype), x)
    assert torch.isnan(y[3])
    assert torch.isfinite(y[128:]).all()


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("name,scale_dtype", WITH_SIGN)
def test_decode_is_deterministic(name: str, scale_dtype: str) -> None:
    gen = torch.Generator().manual_seed(10)
    x = torch.cat([torch.randn(128 * 6, generator=gen), torch.randn(128, generator=gen) * 1e-38])
    codec = make_codec(name, 128, scale_dtype)
    payload = codec.encode(x)
    first = codec.decode(payload, x.numel())
    assert torch.equal(first.view(torch.int32), codec.decode(payload.clone(), x.numel()).view(torch.int32))
    # A payload at an odd offset of a bigger receive buffer decodes to the same bits.
    buffer = torch.cat([torch.zeros(1, dtype=torch.uint8), payload, torch.zeros(3, dtype=torch.uint8)])
    shifted = codec.decode(buffer[1 : 1 + payload.numel()], x.numel())
    assert torch.equal(first.view(torch.int32), shifted.view(torch.int32))
    # Hardware that flushes subnormals to zero must see the same bytes and the same floats.
    try:
        torch.set_flush_denormal(True)
        payload_ftz = codec.encode(x)
        decoded_ftz = codec.decode(payload, x.numel())
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(payload_ftz, payload)
    assert torch.equal(decoded_ftz.view(torch.int32), first.view(torch.int32))


@pytest.mark.parametrize("name,scale_dtype", ALL)
def test_decode_is_stable_across_requantization(name: str, scale_dtype: str) -> None:
    """Encoding a decoded tensor again stays within one quantization step (no drift across the two-stage exchange)."""
    x = torch.randn(128 * 4, generator=torch.Generator().manual_seed(11))
    codec = make_codec(name, 128, scale_dtype)
    once = round_trip(codec, x)
    twice = round_trip(codec, once)
    assert_within_bound(name, once, twice, 128, scale_dtype)
    if name in ("none", "bf16", "fp4") and scale_dtype == "fp32":
        assert torch.equal(once, twice)  # these grids are closed under re-encoding


# ---------------------------------------------------------------- argument checks


def test_make_codec_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="compression"):
        make_codec("int4")
    with pytest.raises(ValueError, match="compression_scale_dtype"):
        make_codec("int8", scale_dtype="fp16")
    with pytest.raises(ValueError, match="compression_block_size"):
        make_codec("int8", block_size=0)
    with pytest.raises(ValueError, match="compression_block_size"):
        make_codec("fp4", block_size=3)


@pytest.mark.parametrize("name", NAMES + ("sign",))
def test_length_and_payload_checks(name: str) -> None:
    codec = make_codec(name, 64)
    if codec.align > 1:
        with pytest.raises(ValueError, match="multiple of 64"):
            codec.encode(torch.randn(65))
    with pytest.raises(ValueError):
        codec.encode(torch.randn(2, 64))
    payload = codec.encode(torch.randn(128))
    with pytest.raises(ValueError, match="payload"):
        codec.decode(payload[:-1], 128)
    with pytest.raises(ValueError, match="payload"):
        codec.decode(payload.view(torch.int8), 128)


# ---------------------------------------------------------------- sign (1 bit per value)


def _sign_reference(x: np.ndarray, block: int, scale_dtype: str) -> tuple[bytes, np.ndarray]:
    """Payload bytes and decoded values of `sign` from its definition: bit j of byte i is element 8i+j < 0,
    scale = mean |x| of the block (at least 2^-126, rounded up to bf16 for bf16 scales), element = ±scale."""
    x = x.astype(np.float32)
    x = np.where(np.abs(x) < TINY, np.float32(0), x)
    bits = np.packbits((x < 0).astype(np.uint8), bitorder="little")
    mean = np.abs(x).reshape(-1, block).astype(np.float64).mean(axis=1)
    scales = np.maximum(mean.astype(np.float32), np.float32(TINY))
    if scale_dtype == "bf16":
        scales = _bf16_round_up(scales)
        scale_bytes = (scales.view(np.uint32) >> 16).astype("<u2").tobytes()
    else:
        scale_bytes = scales.astype("<f4").tobytes()
    decoded = (np.where(x < 0, -1.0, 1.0).astype(np.float32).reshape(-1, block) * scales[:, None]).reshape(-1)
    return bits.tobytes() + scale_bytes, decoded


@pytest.mark.parametrize("block", [8, 256])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_sign_payload_matches_reference(scale_dtype: str, block: int) -> None:
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(block * 12, generator=gen) * torch.logspace(-3, 3, block * 12)[torch.randperm(block * 12)]
    x[:block] = 0.0  # an all-zero block decodes to ±(smallest scale)
    x[block + 1] = 1e-40  # a subnormal is flushed to +0 before its sign is taken
    codec = make_codec("sign", block, scale_dtype)
    payload = codec.encode(x)
    expected_bytes, expected_values = _sign_reference(x.numpy(), block, scale_dtype)
    assert (
        payload.numel()
        == codec.encoded_nbytes(x.numel())
        == x.numel() // 8 + x.numel() // block * (4 if scale_dtype == "fp32" else 2)
    )
    assert payload.numpy().tobytes()[: x.numel() // 8] == expected_bytes[: x.numel() // 8]
    # The mean may differ from the float64 reference in its last fp32 bit (summation order); decode must use the
    # scale it sent, so compare the decoded values to the reference within that one ulp.
    decoded = codec.decode(payload, x.numel()).numpy()
    np.testing.assert_allclose(decoded, expected_values, rtol=2.0**-22 if scale_dtype == "fp32" else 2.0**-7)
    assert np.array_equal(np.sign(decoded), np.where(x.numpy() < 0, -1.0, 1.0))


def test_sign_golden_bytes() -> None:
    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 0.0, 5.0, -6.0, 7.0])
    payload = make_codec("sign", block_size=8).encode(x)
    assert payload[0].item() == 0b01001010  # elements 1, 3 and 6 are negative
    assert payload[1:].numpy().tobytes() == np.array([3.5], "<f4").tobytes()  # mean |x| = 28 / 8
    assert make_codec("sign", block_size=8).decode(payload, 8).tolist() == [3.5, -3.5, 3.5, -3.5, 3.5, 3.5, -3.5, 3.5]


def test_sign_keeps_the_most_energy_a_sign_code_can() -> None:
    """Mean |x| is the least-squares magnitude: any other common magnitude loses more; on Gaussian data the round
    trip keeps about 2/pi of the energy, and error feedback adds up to everything over many rounds."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(256 * 64, generator=gen)
    codec = make_codec("sign", 256)
    y = round_trip(codec, x)
    error = float((x - y).square().sum())
    for factor in (0.9, 1.1):
        assert error < float((x - y * factor).square().sum())
    assert 1 - error / float(x.square().sum()) == pytest.approx(2 / np.pi, abs=0.01)
    sent, residual, total = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(x)
    for _ in range(200):
        delta = torch.randn(x.numel(), generator=gen) + 0.5
        total += delta
        carried = delta + residual
        sent += round_trip(codec, carried)
        residual = quantization_residual(codec, carried)
    assert float((sent - total).norm() / total.norm()) < 0.01


def test_sign_needs_whole_bytes_per_block() -> None:
    with pytest.raises(ValueError, match="compression_block_size must be a multiple of 8"):
        make_codec("sign", block_size=12)


# ---------------------------------------------------------------- topk (chunk-wise top-k, 2-bit values)


def _topk_reference_decode(payload: bytes, numel: int, k: int, scale_dtype: str) -> list[float]:
    """Decoded values from the `topk` format definition, byte by byte: per 4096-value chunk, k 12-bit indices (two per
    3 bytes), then k 2-bit codes (four per byte, bit 0 magnitude 1 / 0.5, bit 1 negative), then the scales."""
    chunks = numel // 4096
    index_bytes, code_bytes = k * 3 // 2, k // 4
    decoded = [0.0] * numel
    for chunk in range(chunks):
        start = chunk * index_bytes
        indices = []
        for b0, b1, b2 in zip(*[iter(payload[start : start + index_bytes])] * 3):
            indices += [b0 | (b1 & 0xF) << 8, b1 >> 4 | b2 << 4]
        codes_at = chunks * index_bytes + chunk * code_bytes
        codes = [byte >> shift & 3 for byte in payload[codes_at : codes_at + code_bytes] for shift in (0, 2, 4, 6)]
        if scale_dtype == "fp32":
            at = chunks * (index_bytes + code_bytes) + 4 * chunk
            (scale,) = struct.unpack("<f", payload[at : at + 4])
        else:
            at = chunks * (index_bytes + code_bytes) + 2 * chunk
            (scale,) = struct.unpack("<f", b"\0\0" + payload[at : at + 2])
        assert indices == sorted(set(indices))  # ascending and distinct within the chunk
        for index, code in zip(indices, codes):
            decoded[chunk * 4096 + index] = (-1 if code & 2 else 1) * (1.0 if code & 1 else 0.5) * scale
    return decoded


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_topk_sends_each_chunks_largest_values_and_decodes_as_its_definition(scale_dtype: str) -> None:
    codec = make_codec("topk", scale_dtype=scale_dtype, density=0.03)
    k = 124  # 0.03 x 4096 = 122.9, to a multiple of 4
    assert codec.k == k and codec.encoded_nbytes(2 * 4096) == 2 * (
        k * 3 // 2 + k // 4 + (4 if scale_dtype == "fp32" else 2)
    )
    x = torch.randn(2 * 4096, generator=torch.Generator().manual_seed(0))
    x[5000] = 1e30  # an outlier sets its chunk's scale; the other chunk keeps its own
    payload = codec.encode(x)
    assert payload.numel() == codec.encoded_nbytes(x.numel())
    reference = torch.tensor(_topk_reference_decode(bytes(payload.tolist()), x.numel(), k, scale_dtype))
    decoded = codec.decode(payload, x.numel())
    assert torch.equal(decoded, reference)
    sent = decoded.view(2, -1) != 0
    largest = torch.zeros_like(sent).scatter_(1, x.view(2, -1).abs().topk(k, dim=1).indices, True)
    assert torch.equal(sent, largest)  # the k largest magnitudes of every chunk, nothing else
    assert torch.equal(decoded.sign()[sent.view(-1)], x.sign()[sent.view(-1)])
    # Each sent value is the nearer of scale/2 and scale (scale = the chunk's absmax, rounded up to bf16 there).
    scales = x.view(2, -1).abs().amax(dim=1)
    ratio = (decoded.view(2, -1).abs() / scales[:, None])[sent]
    rounding = 2**-7 if scale_dtype == "bf16" else 0.0
    assert ratio.max() <= 1.0 + rounding and ratio.min() >= 0.5
    # decode_sum: zeros + each decoded payload in turn, bit for bit (different supports).
    other = codec.encode(torch.randn(2 * 4096, generator=torch.Generator().manual_seed(1)))
    total = torch.zeros(2 * 4096) + decoded + codec.decode(other, 2 * 4096)
    assert torch.equal(codec.decode_sum([payload, other], 2 * 4096), total)


def test_topk_zeros_decode_to_zeros_and_a_nan_shows() -> None:
    codec = make_codec("topk")
    x = torch.zeros(3 * 4096)
    x[4096:8192] = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    x[10000] = float("nan")
    decoded = codec.decode(codec.encode(x), x.numel())
    assert torch.equal(decoded[:4096], torch.zeros(4096)) and not decoded[:4096].signbit().any()  # +0.0
    assert int((decoded[4096:8192] != 0).sum()) == 64 and bool(decoded[8192:].isnan().any())


def test_topk_density_is_checked() -> None:
    for density in (0, 1.5, "1/64", True):
        with pytest.raises(ValueError, match="topk_density"):
            make_codec("topk", density=density)
    assert make_codec("topk", density=1e-6).k == 4 and make_codec("topk", density=1.0).k == 4096

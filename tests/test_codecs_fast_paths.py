"""The codecs' fast paths (pieces, thread pool, fp4's table, sign's numpy bit packing, `decode_sum`, `decode(out=)`)
give exactly what a straightforward implementation of the wire format gives, written here on whole tensors.

The reference is the format as the codecs module defines it, with no pieces and no tables: flush subnormals, one
scale per block (absmax / qmax, or mean |x| for sign; clamped; rounded up to bf16 when stored as bf16), quantize
`x / scale` (fp4: bucketize against the thresholds 2^-7 and 0.75 * 2^-k), pack, and decode as `code * scale`.
Payloads must be equal byte for byte; decoded values bit for bit, a NaN counting as equal to any NaN (the bits of a
NaN that a NaN scale produces depend on which of torch's loops computed it, in the reference too).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_diloco.core.compression.codecs import coding_pool, make_codec

pytestmark = pytest.mark.timeout(300)

TINY = 2.0**-126
QMAX = {"fp16": 65504.0, "int8": 127.0, "fp8": 448.0, "fp4": 1.0, "sign": 1.0}
QMIN = {"fp16": 2.0**-24, "int8": 1.0, "fp8": 2.0**-9, "fp4": 2.0**-6, "sign": 1.0}
VALUE_BITS = {"none": 32, "bf16": 16, "fp16": 16, "int8": 8, "fp8": 8, "fp4": 4, "sign": 1}
FP4_THRESHOLDS = [2.0**-7] + [0.75 * 2.0**-k for k in range(5, -1, -1)]
FP4_MAGNITUDES = [0.0] + [2.0 ** (e - 7) for e in range(1, 8)]
PIECE = 1 << 18  # values per piece: lengths below cross it


# ---------------------------------------------------------------- the straightforward reference


def _flush(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float32)
    return torch.where(x.abs() < TINY, torch.zeros(()), x)


def _largest_scale(qmax: float, bf16: bool) -> float:
    """Largest scale (bf16-representable when `bf16`) whose product with qmax is a finite fp32 number."""
    fp32_max = float(np.finfo(np.float32).max)
    scale = np.float32(fp32_max / qmax)
    while float(scale) * qmax > fp32_max:
        scale = np.nextafter(scale, np.float32(0))
    if bf16:
        scale = (np.array([scale]).view(np.uint32) & 0xFFFF0000).view(np.float32)[0]
    return float(scale)


def _round_up_to_bf16(scales: torch.Tensor) -> torch.Tensor:
    out = []
    for value in scales.tolist():
        if value != value:  # NaN: as torch converts it
            out.append(torch.tensor(value).to(torch.bfloat16).float().item())
            continue
        bits = int(np.array([value], dtype=np.float32).view(np.uint32)[0])
        if bits & 0xFFFF:
            bits = (bits | 0xFFFF) + 1
        out.append(float(np.array([bits], dtype=np.uint32).view(np.float32)[0]))
    return torch.tensor(out, dtype=torch.float32)


def _scales(name: str, blocks: torch.Tensor, bf16: bool) -> torch.Tensor:
    raw = blocks.abs().mean(dim=1) if name == "sign" else blocks.abs().amax(dim=1) / QMAX[name]
    largest = _largest_scale(QMAX[name], bf16)
    scales = raw.clamp(TINY / QMIN[name], largest)
    return _round_up_to_bf16(scales).clamp(max=largest) if bf16 else scales


def _fp4_codes(scaled: torch.Tensor) -> torch.Tensor:
    exponent = torch.bucketize(scaled.abs(), torch.tensor(FP4_THRESHOLDS), right=True)
    sign = (scaled < 0) & (exponent > 0)
    return (exponent | (sign.long() << 3)).to(torch.uint8)


def reference_encode(name: str, values: torch.Tensor, block: int, scale_dtype: str) -> torch.Tensor:
    if name == "none":
        return values.to(torch.float32).contiguous().view(torch.uint8).clone()
    if name == "bf16":
        limit = torch.finfo(torch.bfloat16).max
        return _flush(values).clamp(-limit, limit).to(torch.bfloat16).view(torch.uint8)
    bf16 = scale_dtype == "bf16"
    blocks = _flush(values).view(-1, block)
    scales = _scales(name, blocks, bf16)
    scaled = (blocks / scales[:, None]).view(-1)
    if name == "fp4":
        codes = _fp4_codes(scaled).view(-1, 2)
        value_bytes = codes[:, 0] | (codes[:, 1] << 4)
    elif name == "sign":
        bits = (scaled < 0).view(-1, 8).to(torch.int64) << torch.arange(8)
        value_bytes = bits.sum(dim=1).to(torch.uint8)
    elif name == "int8":
        value_bytes = scaled.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        dtype = torch.float16 if name == "fp16" else torch.float8_e4m3fn
        value_bytes = scaled.clamp(-QMAX[name], QMAX[name]).to(dtype).view(torch.uint8)
    stored = scales.to(torch.bfloat16 if bf16 else torch.float32).view(torch.uint8)
    return torch.cat([value_bytes, stored])


def reference_decode(name: str, payload: torch.Tensor, numel: int, block: int, scale_dtype: str) -> torch.Tensor:
    raw = payload.clone()
    if name == "none":
        return raw.view(torch.float32)
    if name == "bf16":
        return raw.view(torch.bfloat16).float()
    value_nbytes = numel * VALUE_BITS[name] // 8
    scales = raw[value_nbytes:].clone().view(torch.bfloat16 if scale_dtype == "bf16" else torch.float32).float()
    value_bytes = raw[:value_nbytes]
    if name == "fp4":
        table = torch.tensor(FP4_MAGNITUDES + [0.0] + [-m for m in FP4_MAGNITUDES[1:]])
        codes = torch.stack([value_bytes & 0xF, value_bytes >> 4], dim=1).view(-1)
        units = table[codes.long()]
    elif name == "sign":
        bits = (value_bytes[:, None].long() >> torch.arange(8)) & 1
        units = torch.where(bits.view(-1) == 1, -1.0, 1.0)
    elif name == "int8":
        units = value_bytes.view(torch.int8).float()
    else:
        units = value_bytes.view(torch.float16 if name == "fp16" else torch.float8_e4m3fn).float()
    return (units.view(-1, block) * scales[:, None]).view(-1)


def assert_same_payload(name: str, payload: torch.Tensor, expected: torch.Tensor, numel: int, block: int) -> None:
    """Byte for byte, except the fp16 / fp8 codes of a block whose scale is NaN: they are NaNs, whose bits torch's
    loops choose (the scale bytes of such a block must still be equal)."""
    if name in ("fp16", "fp8") and numel:
        value_nbytes = numel * VALUE_BITS[name] // 8
        scales = reference_decode(
            name, expected, numel, block, "fp32" if expected.numel() - value_nbytes == numel // block * 4 else "bf16"
        )
        nan_blocks = torch.isnan(scales.view(-1, block)).any(dim=1)
        keep = torch.ones_like(payload, dtype=torch.bool)
        keep[:value_nbytes].view(-1, block * VALUE_BITS[name] // 8)[nan_blocks] = False
        payload, expected = payload[keep], expected[keep]
    assert torch.equal(payload, expected)


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor) -> None:
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(actual[~nan].view(torch.int32), expected[~nan].view(torch.int32))


# ---------------------------------------------------------------- inputs


def hard_values(numel: int, seed: int) -> list[torch.Tensor]:
    """Pseudo-gradients, and vectors full of what the fast paths must treat exactly as the definition does."""
    gen = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(numel, generator=gen) * 1e-3
    specials = torch.tensor(
        [0.0, -0.0, 1e-40, -1e-40, -1.4e-45, float("inf"), -float("inf"), float("nan"), 3e38, -3e38, -1.2e-38]
    )
    sprinkled = torch.randn(numel, generator=gen)
    where = torch.randint(0, numel, (numel // 50,), generator=gen)
    sprinkled[where] = specials[torch.randint(0, len(specials), (len(where),), generator=gen)]
    tiny = torch.randn(numel, generator=gen) * 1e-37  # blocks whose scale is near the smallest one
    tiny[::7] = -1e-40
    outliers = torch.randn(numel, generator=gen)
    outliers[::127] = 1e30  # huge scales: small negatives divide to -0 for sign (its bit is then 0)
    outliers[1::131] = -1e-30
    on_thresholds = torch.tensor(FP4_THRESHOLDS + [2.0**-8, 2.0**-6, 1.0, -1.0, -0.75, 0.0, 0.5, -(2.0**-7)])
    exact = on_thresholds[torch.randint(0, len(on_thresholds), (numel,), generator=gen)]
    exact[::8] = 1.0  # so that every block's absmax is 1 and the thresholds stay exact
    return [gaussian, sprinkled, tiny, outliers, exact, torch.zeros(numel), gaussian.double()]


CASES = [
    (name, block, scale_dtype)
    for name in ("none", "bf16", "fp16", "int8", "fp8", "fp4", "sign")
    for block, scale_dtype in ((128, "fp32"), (512, "bf16"), (8, "bf16"))
]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize(("name", "block", "scale_dtype"), CASES)
def test_encode_and_decode_match_the_straightforward_implementation(name, block, scale_dtype):
    codec = make_codec(name, block, scale_dtype)
    with coding_pool(2) as pool:
        for numel in (block * 3, PIECE + block * 5):  # one piece; two, the last one short
            for values in hard_values(numel, seed=numel):
                expected = reference_encode(name, values, block, scale_dtype)
                payload = codec.encode(values)
                assert_same_payload(name, payload, expected, numel, block)
                assert torch.equal(codec.encode(values, pool), payload)  # threads change nothing
                decoded = reference_decode(name, payload, numel, block, scale_dtype)
                assert_same_values(codec.decode(payload, numel), decoded)
                assert_same_values(codec.decode(payload, numel, pool=pool), decoded)
                out = torch.full((numel,), 7.0)
                assert codec.decode(payload, numel, out=out) is out
                assert_same_values(out, decoded)


@pytest.mark.parametrize(("name", "block", "scale_dtype"), CASES)
def test_decode_sum_is_the_ordered_sum_of_the_decoded_payloads(name, block, scale_dtype):
    codec = make_codec(name, block, scale_dtype)
    numel = PIECE + block * 3
    payloads = [reference_encode(name, values, block, scale_dtype) for values in hard_values(numel, seed=1)[:4]]
    payloads.append(payloads[0][torch.arange(payloads[0].numel())])  # an equal payload at another address
    expected = torch.zeros(numel)
    for payload in payloads:
        expected += reference_decode(name, payload, numel, block, scale_dtype)
    with coding_pool(3) as pool:
        assert_same_values(codec.decode_sum(payloads, numel), expected)
        assert_same_values(codec.decode_sum(payloads, numel, pool), expected)


def test_fp4_code_is_decided_by_the_top_ten_bits():
    """Each of the 1024 sign / exponent / first-mantissa-bit patterns spans one code: its smallest and largest
    magnitude bucketize alike (except -inf and the signalling NaNs after it, which no division returns)."""
    patterns = torch.arange(1024, dtype=torch.int64) << 22
    low = patterns.to(torch.int32).view(torch.float32)
    high = (patterns | 0x3FFFFF).to(torch.int32).view(torch.float32)
    low_codes, high_codes = _fp4_codes(low), _fp4_codes(high)
    differ = (low_codes != high_codes).nonzero().view(-1).tolist()
    assert differ == [1022]  # 0b1_11111111_0: -inf at the bottom, signalling NaNs above it
    assert float(low[1022]) == -float("inf") and bool(torch.isnan(high[1022]))
    codec = make_codec("fp4", 2, "fp32")
    for values in (low, high):  # each pattern next to a 1.0: the fast path against the definition
        pairs = torch.stack([values, torch.ones_like(values)], dim=1).view(-1)
        assert torch.equal(codec.encode(pairs), reference_encode("fp4", pairs, 2, "fp32"))


def test_decode_refuses_an_output_it_cannot_write():
    codec = make_codec("fp4")
    payload = codec.encode(torch.randn(256))
    for wrong in (torch.empty(255), torch.empty(256, dtype=torch.float64), torch.empty(512)[::2]):
        with pytest.raises(ValueError, match="contiguous fp32 tensor of 256 values"):
            codec.decode(payload, 256, out=wrong)

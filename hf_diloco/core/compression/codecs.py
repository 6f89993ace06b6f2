"""Codecs for the exchanged pseudo-gradient.

A codec turns a flat fp32 tensor whose length is a multiple of `codec.align` into a flat uint8 payload (values
and per-block scales packed together) and back. The exchange never sums encoded values: it decodes to fp32 first.

Wire format (native byte order, little-endian on every platform torch supports):

| `compression` | payload                                                                 | `align`      |
|---------------|-------------------------------------------------------------------------|--------------|
| `none`        | fp32 values (4 bytes each)                                              | 1            |
| `bf16`        | bf16 values (2 bytes each), no scales                                   | 1            |
| `fp16`        | fp16 values (2 bytes each), then one scale per block                    | `block_size` |
| `int8`        | int8 values in [-127, 127], then one scale per block                    | `block_size` |
| `fp8`         | float8 e4m3fn values in [-448, 448], then one scale per block           | `block_size` |
| `fp4`         | 4-bit E3M0 codes, two per byte (element 2i low nibble), then the scales | `block_size` |
| `sign`        | 1-bit signs, eight per byte (element 8i+j in bit j), then the scales    | `block_size` |
| `topk`        | per 4096-value chunk k 12-bit indices and 2-bit codes, then the scales  | 4096         |

Scales are fp32 (4 bytes) or bf16 (2 bytes, `scale_dtype="bf16"`). A decoded element is `q * scale` with `q` the
dequantized code, computed as one fp32 multiply.

Design choices:

- `bf16` stores no scales: bf16 has fp32's 8-bit exponent, so every finite fp32 value (clamped to the bf16 maximum)
  is representable without overflow and a scale would only add bytes. `fp16` does use scales (absmax -> 65504): its
  5-bit exponent overflows at 65504 and flushes below 2^-24, both well inside the range of pseudo-gradients.
- Scales are rounded *up* to the storage dtype and the values are quantized against the stored scale, so the block
  absmax never lands beyond the largest code and encode/decode agree on the scale bit for bit.
- Determinism across machines: some hardware flushes subnormal floats to zero (FTZ/DAZ), others do not. Encode
  therefore flushes subnormal fp32 inputs (|x| < 2^-126) to zero itself, and scales are clamped so that the
  smallest nonzero code times the scale is a normal fp32 number. Decode is then a single IEEE fp32 multiply of
  normal numbers (or a table lookup), which gives the same bits everywhere. Scales are also clamped from above so
  that the largest code times the scale stays finite: huge outliers saturate instead of turning into inf.
- `fp4` (E3M0, 1 sign + 3 exponent bits, no mantissa): exponent code `e = 0` is zero and `e = 1..7` is the
  magnitude `scale * 2^(e - 7)`, with `scale = absmax`; that is magnitudes absmax * 2^-k for k = 0..6, plus zero.
  Rounding is to the nearest representable value in *linear* space (decision thresholds `0.75 * 2^-k` between
  neighbouring powers of two and `2^-7` between 2^-6 and zero); exact ties go to the larger magnitude. The relative
  error is at most 1/3 for |x| >= absmax * 2^-6 and the absolute error at most absmax * 2^-7 below it.
- `sign` (1 bit per value): bit 1 means negative, 0 means non-negative; an element decodes to `±scale` with
  `scale = mean |x|` of its block, the magnitude that minimises the block's squared error for a sign code (absmax
  would overshoot almost every element). It keeps only the direction of each value, so it is meant for error
  feedback (`error_feedback: true`), which carries what it drops into the next sync. A block of zeros decodes to
  ±(the smallest scale), a normal fp32 number, not to zero.
- Non-finite inputs are not supported: a NaN makes its whole block decode to NaN (so divergence stays visible),
  an inf saturates like a huge outlier.

Speed: a long vector is coded in pieces of whole blocks (about 2^18 values, 1 MB of fp32), so that the several passes
over a piece stay in the core's cache instead of streaming the whole vector through memory once per pass; with a
thread pool (`coding_pool`) the pieces run in parallel. Every block is coded on its own, so neither the piece size
nor the threads change a bit of the payload or of the decoded values. `fp4` finds each code with one table lookup on
the top 10 bits of `value / scale` (sign, exponent, first mantissa bit: rounding to the nearest power of two in
linear space depends on nothing else) and two codes per lookup; `sign` packs and unpacks its bits with numpy.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np
import torch

_FP32_MAX = torch.finfo(torch.float32).max
_FP32_TINY = 2.0**-126  # smallest normal fp32
_LARGEST_SUBNORMAL = float(torch.nextafter(torch.tensor(_FP32_TINY), torch.tensor(0.0)))
_SCALE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_PIECE_VALUES = 1 << 18  # values coded at a time: a piece's passes stay in a core's cache


def coding_pool(threads: int) -> ThreadPoolExecutor:
    """Threads for `encode`, `decode` and `decode_sum` to code the pieces of a long vector in parallel (each runs
    torch on one thread, so that the pieces do not also split every operation among all cores)."""
    return ThreadPoolExecutor(
        threads, thread_name_prefix="diloco-coding", initializer=torch.set_num_threads, initargs=(1,)
    )


def _flush_subnormals(values: torch.Tensor) -> torch.Tensor:
    """fp32 copy of `values` with subnormals (and -0.0) replaced by +0.0, the same on FTZ and non-FTZ hardware."""
    values = values.detach().to(torch.float32)
    return torch.where(values.abs() < _FP32_TINY, torch.zeros((), dtype=torch.float32, device=values.device), values)


def _has_subnormal(magnitudes: torch.Tensor) -> bool:
    """Whether non-negative fp32 `magnitudes` hold a subnormal (a value that flushing would change)."""
    # Bits - 1, masked: 0 becomes the largest int, a subnormal (bits 1 ... 2^23 - 1) stays below 2^23 - 1.
    return bool((magnitudes.view(torch.int32) - 1).bitwise_and_(0x7FFFFFFF).amin() < 0x7FFFFF)


def _reinterpret(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Fresh tensor of `dtype` from raw bytes; copies so that any storage offset (alignment) is fine."""
    return payload.clone(memory_format=torch.contiguous_format).view(dtype)


def _round_up_to_bf16(scale: torch.Tensor) -> torch.Tensor:
    """Smallest bf16 value >= each (positive, finite) fp32 `scale`, returned as fp32."""
    rounded = scale.to(torch.bfloat16)
    too_small = rounded.to(torch.float32) < scale
    bits = rounded.view(torch.int16)
    # Positive bf16 values are ordered like their bit patterns: +1 is the next larger value.
    return torch.where(too_small, bits + 1, bits).view(torch.bfloat16).to(torch.float32)


def _largest_scale(qmax: float, scale_dtype: torch.dtype) -> float:
    """Largest scale of `scale_dtype` for which `qmax * scale` is still a finite fp32 number."""
    scale = torch.tensor(_FP32_MAX / qmax, dtype=torch.float64).to(torch.float32)
    while float(scale) * qmax > _FP32_MAX:
        scale = torch.nextafter(scale, torch.zeros_like(scale))
    if scale_dtype == torch.bfloat16:
        # Truncating the low 16 bits of a positive fp32 rounds it down to bf16.
        scale = (scale.view(torch.int32) & -65536).view(torch.float32)
    return float(scale)


def _pieces(numel: int, align: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of about `_PIECE_VALUES` values, each a multiple of `align` long, covering `numel`."""
    step = max(1, _PIECE_VALUES // align) * align
    return [(start, min(numel, start + step)) for start in range(0, numel, step)]


def check_output_vector(out: torch.Tensor | None, numel: int, what: str) -> None:
    """Refuse an `out` that is not a contiguous 1-D fp32 tensor of `numel` values (`what` begins the message)."""
    if out is not None and (out.dtype != torch.float32 or out.shape != (numel,) or not out.is_contiguous()):
        raise ValueError(
            f"{what} into a contiguous fp32 tensor of {numel} values, got {out.dtype} {tuple(out.shape)}."
        )


def _for_each_piece(work: Callable[[int, int], object], pieces: Sequence[tuple[int, int]], pool: Executor | None):
    if pool is None or len(pieces) < 2:
        for start, stop in pieces:
            work(start, stop)
    else:
        list(pool.map(lambda piece: work(*piece), pieces))


class Codec:
    """Base codec: lossless fp32 (`compression="none"`).

    Subclasses override `encoded_nbytes`, `_encode_piece` and `_decode_piece` (or, for block codecs, the hooks of
    `BlockCodec`); the argument checks and the splitting into pieces are shared. Every codec declares what the rest of
    the package derives from the registry `CODECS`: its `name` (the `compression` value), its `bits` per value on the
    wire, a `nominal_error` (relative squared error on absmax-scaled blocks of Gaussian-like values; only its order
    and rough size matter, to the adaptive policy) and whether the adaptive policy may step up to it from a codec of
    fewer bits (`adaptive_step`).
    """

    name = "none"
    bits = 32
    align = 1
    nominal_error = 0.0
    adaptive_step = True

    @classmethod
    def build(cls, block_size: int, scale_dtype: str) -> Codec:
        """The codec for `compression=cls.name` (codecs without scale blocks ignore both arguments)."""
        return cls()

    @property
    def payload_is_values(self) -> bool:
        """Whether a payload is the fp32 values' own bytes (codec `none`: a codec that keeps this class's piece
        coding), so that an exchange may send values where they lie and receive them where they go."""
        kind = type(self)
        return kind._encode_piece is Codec._encode_piece and kind.encoded_nbytes is Codec.encoded_nbytes

    def encoded_nbytes(self, numel: int) -> int:
        """Bytes of the payload that `encode` returns for `numel` values."""
        self._check_numel(numel)
        return numel * 4

    def encode(self, values: torch.Tensor, pool: Executor | None = None) -> torch.Tensor:
        """Encode a 1-D float tensor whose length is a multiple of `align` into a 1-D uint8 payload.

        `pool` (`coding_pool`) codes the pieces of a long vector in parallel; the payload is the same without it.
        """
        self._check_values(values)
        values = values.detach().to(torch.float32).contiguous()
        payload = torch.empty(self.encoded_nbytes(values.numel()), dtype=torch.uint8)
        _for_each_piece(
            lambda start, stop: self._encode_piece(values, start, stop, payload),
            _pieces(values.numel(), self.align),
            pool,
        )
        return payload

    def decode(
        self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None, pool: Executor | None = None
    ) -> torch.Tensor:
        """Decode a payload of `encoded_nbytes(numel)` bytes into a fresh 1-D fp32 tensor of `numel` values, or into
        `out` (a contiguous 1-D fp32 tensor of `numel` values), which is returned."""
        self._check_payload(payload, numel)
        self._check_out(out, numel)
        pieces = _pieces(numel, self.align)
        if out is None and len(pieces) == 1:
            return self._decode_piece(payload, numel, 0, numel)
        if out is None:
            out = torch.empty(numel, dtype=torch.float32)
        _for_each_piece(
            lambda start, stop: self._decode_piece(payload, numel, start, stop, out[start:stop]), pieces, pool
        )
        return out

    def decode_sum(
        self,
        payloads: Sequence[torch.Tensor],
        numel: int,
        pool: Executor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The fp32 sum of the decoded payloads, added in their order to zeros: bit for bit
        `zeros + decode(payloads[0]) + decode(payloads[1]) + ...`, without holding any decoded vector whole; in a
        fresh tensor or written into `out` (a contiguous 1-D fp32 tensor of `numel` values), which is returned."""
        for payload in payloads:
            self._check_payload(payload, numel)
        self._check_out(out, numel)
        total = torch.empty(numel, dtype=torch.float32) if out is None else out

        def add_piece(start: int, stop: int) -> None:
            part = total[start:stop].zero_()
            for payload in payloads:
                self._add_decoded_piece(part, payload, numel, start, stop)

        _for_each_piece(add_piece, _pieces(numel, self.align), pool)
        return total

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, align={self.align})"

    @staticmethod
    def _check_out(out: torch.Tensor | None, numel: int) -> None:
        check_output_vector(out, numel, "decode writes")

    def _encode_piece(self, values: torch.Tensor, start: int, stop: int, payload: torch.Tensor) -> None:
        """Write the payload bytes of `values[start:stop]` (contiguous fp32) into `payload`."""
        payload[4 * start : 4 * stop].copy_(values[start:stop].view(torch.uint8))

    def _decode_piece(
        self, payload: torch.Tensor, numel: int, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Values [start, stop) of the `numel` a payload holds, as a fresh fp32 tensor or written into `out`."""
        if out is None:
            return _reinterpret(payload[4 * start : 4 * stop], torch.float32)
        out.view(torch.uint8).copy_(payload[4 * start : 4 * stop])
        return out

    def _add_decoded_piece(self, part: torch.Tensor, payload: torch.Tensor, numel: int, start: int, stop: int) -> None:
        """`part += ` values [start, stop) of the `numel` a payload holds."""
        part += self._decode_piece(payload, numel, start, stop)

    def _check_numel(self, numel: int) -> None:
        if numel < 0 or numel % self.align:
            raise ValueError(f"{self.name} codec needs a length that is a multiple of {self.align}, got {numel}.")

    def _check_values(self, values: torch.Tensor) -> None:
        if values.dim() != 1 or not values.is_floating_point():
            raise ValueError(f"{self.name} codec encodes 1-D float tensors, got {values.dtype} {tuple(values.shape)}.")
        self._check_numel(values.numel())

    def _check_payload(self, payload: torch.Tensor, numel: int) -> None:
        expected = self.encoded_nbytes(numel)
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expected:
            raise ValueError(
                f"{self.name} codec expects a 1-D uint8 payload of {expected} bytes for {numel} values, "
                f"got {payload.dtype} {tuple(payload.shape)}."
            )


class BF16Codec(Codec):
    """Round to nearest bf16 (8 significant bits, relative error <= 2^-8); no scales, see the module docstring."""

    name = "bf16"
    bits = 16
    align = 1
    nominal_error = 5e-6

    def encoded_nbytes(self, numel: int) -> int:
        self._check_numel(numel)
        return numel * 2

    def _encode_piece(self, values: torch.Tensor, start: int, stop: int, payload: torch.Tensor) -> None:
        bf16_max = torch.finfo(torch.bfloat16).max
        rounded = _flush_subnormals(values[start:stop]).clamp_(-bf16_max, bf16_max).to(torch.bfloat16)
        payload[2 * start : 2 * stop].copy_(rounded.view(torch.uint8))

    def _decode_piece(
        self, payload: torch.Tensor, numel: int, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        decoded = _reinterpret(payload[2 * start : 2 * stop], torch.bfloat16)
        return decoded.to(torch.float32) if out is None else out.copy_(decoded)


class BlockCodec(Codec, abc.ABC):
    """Base of the codecs with one absmax scale per block of `block_size` values.

    A block's scale is `absmax / qmax` (rounded up to `scale_dtype`, clamped as the module docstring explains); an
    element is sent as the code nearest to `value / scale` and decoded as `code * scale`. The payload holds every
    block's value bytes, then every block's scale.

    Args:
        block_size (`int`): values per scale; also `align`.
        scale_dtype (`str`): `"fp32"` or `"bf16"`, the dtype scales are stored in.
    """

    bits: int  # bits per value on the wire
    qmax: float  # magnitude the block absmax maps to
    qmin: float  # smallest nonzero code magnitude

    def __init__(self, block_size: int = 128, scale_dtype: str = "fp32") -> None:
        self.align = self.block_size = block_size
        self.scale_dtype = _SCALE_DTYPES[scale_dtype]
        self.scale_nbytes = self.scale_dtype.itemsize
        self.min_scale = _FP32_TINY / self.qmin
        self.max_scale = _largest_scale(self.qmax, self.scale_dtype)

    @classmethod
    def build(cls, block_size: int, scale_dtype: str) -> Codec:
        return cls(block_size, scale_dtype)

    def __repr__(self) -> str:
        dtype = "bf16" if self.scale_dtype == torch.bfloat16 else "fp32"
        return f"{type(self).__name__}(block_size={self.block_size}, scale_dtype={dtype!r})"

    def encoded_nbytes(self, numel: int) -> int:
        self._check_numel(numel)
        return numel * self.bits // 8 + numel // self.block_size * self.scale_nbytes

    # Whether every code x scale is an exact fp32 product (codes 0, +-1 or powers of two, products never subnormal).
    exact_products = False

    def block_scales(self, blocks: torch.Tensor) -> torch.Tensor:
        """fp32 scales (exactly representable in `scale_dtype`) of a `(num_blocks, block_size)` fp32 tensor."""
        return self._stored_scales(blocks.abs().amax(dim=1) / self.qmax)

    def _stored_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """Raw fp32 scales clamped to the codec's range and rounded up to `scale_dtype` (in place when fp32)."""
        scales = scales.clamp_(self.min_scale, self.max_scale)
        if self.scale_dtype == torch.bfloat16:
            scales = _round_up_to_bf16(scales).clamp_(max=self.max_scale)
        return scales

    def _encode_piece(self, values: torch.Tensor, start: int, stop: int, payload: torch.Tensor) -> None:
        codes, scales = self._encode_blocks(values[start:stop].view(-1, self.block_size))
        codes_out, scales_out = self._piece_bytes(payload, values.numel(), start, stop)
        codes_out.copy_(codes)
        scales_out.copy_(scales.to(self.scale_dtype).view(torch.uint8))

    def _piece_bytes(
        self, payload: torch.Tensor, numel: int, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload's bytes of values [start, stop): their value bytes, and their blocks' scales."""
        block = self.block_size
        scale_bytes = numel * self.bits // 8 + start // block * self.scale_nbytes
        return (
            payload[start * self.bits // 8 : stop * self.bits // 8],
            payload[scale_bytes : scale_bytes + (stop - start) // block * self.scale_nbytes],
        )

    def _decode_piece(
        self, payload: torch.Tensor, numel: int, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        codes, scales = self._codes_and_scales(payload, numel, start, stop)
        if out is None:
            return codes.mul_(scales).view(-1)
        torch.mul(codes, scales, out=out.view(-1, self.block_size))
        return out

    def _add_decoded_piece(self, part: torch.Tensor, payload: torch.Tensor, numel: int, start: int, stop: int) -> None:
        if not self.exact_products:
            return super()._add_decoded_piece(part, payload, numel, start, stop)
        # code x scale is exact, so adding it in one fused step rounds the sum once, as multiply-then-add does.
        codes, scales = self._codes_and_scales(payload, numel, start, stop)
        part.view(-1, self.block_size).addcmul_(codes, scales)

    def _codes_and_scales(
        self, payload: torch.Tensor, numel: int, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Values [start, stop) of a payload as (codes in scale units, `(blocks, block_size)`; fp32 scales, `(blocks, 1)`)."""
        block = self.block_size
        scale_bytes = numel * self.bits // 8 + start // block * self.scale_nbytes
        scales = _reinterpret(
            payload[scale_bytes : scale_bytes + (stop - start) // block * self.scale_nbytes], self.scale_dtype
        )
        codes = self._dequantize(payload[start * self.bits // 8 : stop * self.bits // 8], stop - start)
        return codes.view(-1, block), scales.to(torch.float32)[:, None]

    def _encode_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(num_blocks, block_size)` fp32 values -> (uint8 value bytes, fp32 scales)."""
        flushed = _flush_subnormals(blocks)
        scales = self.block_scales(flushed)
        return self._quantize(flushed / scales[:, None]), scales

    @abc.abstractmethod
    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        """`(num_blocks, block_size)` values in scale units -> 1-D uint8 value bytes."""

    @abc.abstractmethod
    def _dequantize(self, value_bytes: torch.Tensor, numel: int) -> torch.Tensor:
        """1-D uint8 value bytes -> fresh 1-D fp32 tensor of codes in scale units."""


class FP16Codec(BlockCodec):
    """Round to nearest fp16 after scaling the block absmax to 65504 (relative error <= 2^-11 in fp16's normal range)."""

    name = "fp16"
    bits = 16
    nominal_error = 1e-7
    adaptive_step = False  # bf16 is the 16-bit step: no scales, fp32's range
    qmax = torch.finfo(torch.float16).max
    qmin = 2.0**-24

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.clamp_(-self.qmax, self.qmax).to(torch.float16).view(-1).view(torch.uint8)

    def _dequantize(self, value_bytes: torch.Tensor, numel: int) -> torch.Tensor:
        return _reinterpret(value_bytes, torch.float16).to(torch.float32)


class Int8Codec(BlockCodec):
    """Symmetric int8: `round(value / scale)` in [-127, 127] with `scale = absmax / 127`, error <= absmax / 254."""

    name = "int8"
    bits = 8
    nominal_error = 2e-4
    adaptive_step = False  # fp8 is the 8-bit step
    qmax = 127.0
    qmin = 1.0

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round_().clamp_(-self.qmax, self.qmax).to(torch.int8).view(-1).view(torch.uint8)

    def _dequantize(self, value_bytes: torch.Tensor, numel: int) -> torch.Tensor:
        return value_bytes.view(torch.int8).to(torch.float32)


class FP8Codec(BlockCodec):
    """float8 e4m3fn with the block absmax scaled to 448 (relative error <= 2^-4 in e4m3's normal range)."""

    name = "fp8"
    bits = 8
    nominal_error = 1e-3
    qmax = 448.0
    qmin = 2.0**-9

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        # e4m3fn has no inf: out-of-range values would become NaN, hence the clamp.
        return scaled.clamp_(-self.qmax, self.qmax).to(torch.float8_e4m3fn).view(-1).view(torch.uint8)

    def _dequantize(self, value_bytes: torch.Tensor, numel: int) -> torch.Tensor:
        return value_bytes.view(torch.float8_e4m3fn).to(torch.float32)


class FP4Codec(BlockCodec):
    """E3M0 fp4: sign bit + 3-bit exponent, magnitudes `absmax * 2^-k` (k = 0..6) or zero, two codes per byte.

    A code is `sign << 3 | e`; `e = 0` is zero (always with sign 0) and `e > 0` means `2^(e - 7)` in scale units.
    Element `2i` goes in the low nibble of byte `i`, element `2i + 1` in the high nibble.

    Every threshold is a power of two or 1.5 times one, so the code of `value / scale` is decided by its sign, its
    exponent and its first mantissa bit, the top 10 bits of the fp32: `_CODE_OF_TOP_BITS` holds the code of each of
    the 1024 combinations (built from `THRESHOLDS` themselves), `_PAIR_BYTE` the byte of two neighbours at once.
    """

    name = "fp4"
    bits = 4
    nominal_error = 4e-2
    qmax = 1.0
    qmin = 2.0**-6
    # Midpoints between neighbouring magnitudes 0, 2^-6, ..., 2^0: rounding to nearest in linear space.
    THRESHOLDS = (2.0**-7,) + tuple(0.75 * 2.0**-k for k in range(5, -1, -1))
    MAGNITUDES = (0.0,) + tuple(2.0 ** (e - 7) for e in range(1, 8))
    # A block whose scale is at least this codes a subnormal input as 0 without flushing it first:
    # |subnormal| / scale < 2^-126 / 2^-119 = 2^-7, the lowest threshold.
    _NO_FLUSH_SCALE = 2.0**-119
    exact_products = True  # a code is 0 or 2^-6 ... 2^0 and a scale at least 2^-120
    _pair_byte: torch.Tensor | None = None
    _code_values: torch.Tensor | None = None

    def __init__(self, block_size: int = 128, scale_dtype: str = "fp32") -> None:
        if block_size % 2:
            raise ValueError(f"compression_block_size must be even for fp4 (two values per byte), got {block_size}.")
        super().__init__(block_size, scale_dtype)

    def _encode_piece(self, values: torch.Tensor, start: int, stop: int, payload: torch.Tensor) -> None:
        blocks = values[start:stop].view(-1, self.block_size)
        # absmax from the largest and smallest value: two reductions without an |x| pass; qmax is 1, so it is the
        # scale. Flushing subnormals changes no scale (the clamp lifts a block of subnormals to min_scale either way).
        scales = self._stored_scales(torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()))
        if not bool(scales.amin() >= self._NO_FLUSH_SCALE):  # tiny blocks, or a NaN: the definition's path
            return super()._encode_piece(values, start, stop, payload)
        codes_out, scales_out = self._piece_bytes(payload, values.numel(), start, stop)
        # Two neighbours' top 10 bits as one 20-bit index: the fp32 pair read as one int64, element 2i in the low
        # half; computed in place in the quotient's memory, and the codes looked up straight into the payload.
        pair = torch.div(blocks, scales[:, None]).view(-1).view(torch.int64)
        pair.bitwise_right_shift_(22).bitwise_and_(0x3FF000003FF)
        pair.bitwise_or_(pair >> 22).bitwise_and_(0xFFFFF)
        torch.index_select(self._pair_table(), 0, pair, out=codes_out)
        scales_out.copy_(scales.to(self.scale_dtype).view(torch.uint8))

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        scaled = scaled.view(-1)
        thresholds = torch.tensor(self.THRESHOLDS, dtype=torch.float32, device=scaled.device)
        # right=True: a magnitude exactly on a threshold goes to the larger neighbour.
        exponent = torch.bucketize(scaled.abs(), thresholds, right=True).to(torch.uint8)
        sign = ((scaled < 0) & (exponent > 0)).to(torch.uint8)
        codes = (exponent | (sign << 3)).view(-1, 2)
        return codes[:, 0] | (codes[:, 1] << 4)

    def _dequantize(self, value_bytes: torch.Tensor, numel: int) -> torch.Tensor:
        # One 8-byte element per byte: a 1-D lookup is several times faster than gathering rows of two fp32.
        return torch.index_select(self._byte_values(), 0, value_bytes.to(torch.int32)).view(torch.float32)

    @classmethod
    def _pair_table(cls) -> torch.Tensor:
        """uint8 byte of every (element 2i, element 2i + 1) pair of top-10-bit patterns, indexed high * 1024 + low."""
        if cls._pair_byte is None:
            top_bits = torch.arange(1024, dtype=torch.int32) << 22
            # Quiet NaNs (all a division returns) and -inf share the pattern 0b1_11111111_1 / _0 with no other value:
            # codes are taken from the pattern with its other mantissa bits zero, i.e. +-inf, or a quiet NaN.
            codes = cls()._quantize(top_bits.view(torch.float32).repeat_interleave(2).view(-1, 2))
            codes = codes & 0xF  # the code of one element: both halves of the byte are equal
            cls._pair_byte = (codes.view(-1, 1) << 4 | codes.view(1, -1)).view(-1)
        return cls._pair_byte

    @classmethod
    def _byte_values(cls) -> torch.Tensor:
        """The two codes of every byte in scale units, low nibble first, as 256 fp32 pairs each viewed as one int64."""
        if cls._code_values is None:
            table = torch.tensor(cls.MAGNITUDES + (0.0,) + tuple(-m for m in cls.MAGNITUDES[1:]), dtype=torch.float32)
            byte = torch.arange(256)
            cls._code_values = torch.stack([table[byte & 0xF], table[byte >> 4]], dim=1).view(torch.int64).view(-1)
        return cls._code_values


class SignCodec(BlockCodec):
    """1-bit sign with one `mean |x|` scale per block, eight codes per byte (1 = negative; element 8i+j in bit j)."""

    name = "sign"
    bits = 1
    # 1 - 2/pi of a Gaussian's energy is lost when only the signs and the mean magnitude are sent.
    nominal_error = 0.36
    adaptive_step = False  # the fewest bits: only ever a floor
    qmax = 1.0
    qmin = 1.0
    _SIGN_SAFE_SCALE = 2.0**24
    exact_products = True  # a code is +-1

    def __init__(self, block_size: int = 128, scale_dtype: str = "fp32") -> None:
        if block_size % 8:
            raise ValueError(
                f"compression_block_size must be a multiple of 8 for sign (eight values per byte), got {block_size}."
            )
        super().__init__(block_size, scale_dtype)

    def block_scales(self, blocks: torch.Tensor) -> torch.Tensor:
        return self._stored_scales(blocks.abs().mean(dim=1))

    def _encode_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        magnitudes = blocks.abs()
        scales = self._stored_scales(magnitudes.mean(dim=1))
        # The sign of `value / scale` is the sign of `value` unless flushing would change a mean or the quotient
        # could round to -0 (|value| >= 2^-126 over a scale below 2^24 stays above 2^-150); a NaN fails the test.
        if _has_subnormal(magnitudes) or not bool(scales.amax() < self._SIGN_SAFE_SCALE):
            return super()._encode_blocks(blocks)
        return self._quantize(blocks), scales

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        negative = (scaled < 0).view(-1)
        return torch.from_numpy(np.packbits(negative.numpy(), bitorder="little"))

    def _dequantize(self, value_bytes: torch.Tensor, numel: int) -> torch.Tensor:
        negative = torch.from_numpy(np.unpackbits(value_bytes.numpy(), bitorder="little"))
        # 1 - 2 * bit: +1 for a 0 bit, -1 for a 1 bit, exactly.
        return torch.mul(negative, -2.0).add_(1.0)


class TopKCodec(Codec):
    """Chunk-wise top-k: in every flat chunk of `CHUNK` (4096) consecutive values, the `k` largest in magnitude, each
    sent as a 12-bit index inside its chunk and a 2-bit code, with one scale per chunk; every other value is dropped.

    `k = density x 4096`, rounded to a multiple of 4 (four codes per byte, two indices per 3 bytes), at least 4.
    Payload: every chunk's indices (ascending within the chunk; index `a` then `b` packed into 3 bytes as
    `a & 0xFF`, `a >> 8 | (b & 0xF) << 4`, `b >> 4`), then every chunk's codes (element 4i+j of a chunk's list in bits
    2j, 2j+1 of byte i: bit 0 the magnitude, 1 for `scale` and 0 for `scale / 2`, bit 1 the sign, 1 negative), then
    the scales (`scale = ` the absmax of the chunk, rounded up to `scale_dtype`). A magnitude is rounded to the nearer
    of the two levels in linear space (the threshold `0.75 x scale`, a tie to the larger). Chunks are flat slices of
    the vector (not 64 x 64 tiles of a matrix). What it drops is most of the energy, so it is meant for error
    feedback and the `all_gather` pattern (every worker's payload decoded and summed: the supports differ, so a
    re-encoded average would drop again, without feedback). A chunk of zeros has scale 0 and decodes to zeros; a
    NaN makes its chunk's `k` values NaN.
    """

    name = "topk"
    bits = 0  # under one bit per value: 12 + 2 bits for 1/64 of the values, and a scale, are 0.23 bits
    nominal_error = 0.9
    adaptive_step = False
    CHUNK = 4096
    LEVELS = (0.5, 1.0)

    def __init__(self, density: float = 1 / 64, scale_dtype: str = "fp32") -> None:
        check_topk_density(density)
        self.density = density
        self.k = topk_count(density)
        self.align = self.CHUNK
        self.scale_dtype = _SCALE_DTYPES[scale_dtype]
        self.scale_nbytes = torch.finfo(self.scale_dtype).bits // 8
        self.min_scale = 2.0**-125  # half of it is the smallest normal fp32
        self.max_scale = _largest_scale(1.0, self.scale_dtype)

    @classmethod
    def build(cls, block_size: int, scale_dtype: str, density: float = 1 / 64) -> Codec:
        return cls(density, scale_dtype)

    def __repr__(self) -> str:
        return f"TopKCodec(density={self.density!r}, k={self.k}, scale_dtype={self.scale_dtype})"

    def encoded_nbytes(self, numel: int) -> int:
        self._check_numel(numel)
        return numel // self.CHUNK * self._chunk_nbytes()

    def _chunk_nbytes(self) -> int:
        return self.k * 3 // 2 + self.k // 4 + self.scale_nbytes

    def _sections(self, payload: torch.Tensor, numel: int, start: int, stop: int):
        """The payload's index, code and scale bytes of the chunks of values [start, stop)."""
        chunks, first, count = numel // self.CHUNK, start // self.CHUNK, (stop - start) // self.CHUNK
        index_bytes, code_bytes = self.k * 3 // 2, self.k // 4
        codes_at, scales_at = chunks * index_bytes, chunks * (index_bytes + code_bytes)
        return (
            payload[first * index_bytes : (first + count) * index_bytes],
            payload[codes_at + first * code_bytes : codes_at + (first + count) * code_bytes],
            payload[scales_at + first * self.scale_nbytes : scales_at + (first + count) * self.scale_nbytes],
        )

    def _encode_piece(self, values: torch.Tensor, start: int, stop: int, payload: torch.Tensor) -> None:
        chunks = _flush_subnormals(values[start:stop]).view(-1, self.CHUNK)
        magnitudes = chunks.abs()
        index = magnitudes.topk(self.k, dim=1, sorted=False).indices.sort(dim=1).values
        picked = chunks.gather(1, index)
        absmax = magnitudes.amax(dim=1)
        scales = absmax.clamp(self.min_scale, self.max_scale)  # a NaN stays NaN: its chunk decodes to NaN
        if self.scale_dtype == torch.bfloat16:
            scales = _round_up_to_bf16(scales).clamp_(max=self.max_scale)
        scales[absmax == 0] = 0.0  # a chunk of zeros (a joining worker's, say) adds exactly nothing
        big = (picked.abs() >= 0.75 * scales[:, None]).to(torch.uint8)
        codes = (big | (picked < 0).to(torch.uint8) << 1).view(-1, 4)
        index_out, codes_out, scales_out = self._sections(payload, values.numel(), start, stop)
        pairs = index.view(-1, 2).to(torch.int32)
        low, high = pairs[:, 0], pairs[:, 1]
        packed = torch.stack([low & 0xFF, (low >> 8) | ((high & 0xF) << 4), high >> 4], dim=1)
        index_out.copy_(packed.to(torch.uint8).view(-1))
        codes_out.copy_(codes[:, 0] | codes[:, 1] << 2 | codes[:, 2] << 4 | codes[:, 3] << 6)
        scales_out.copy_(scales.to(self.scale_dtype).view(torch.uint8))

    def _positions_and_values(
        self, payload: torch.Tensor, numel: int, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sent values of [start, stop): their positions in that range (int64) and their fp32 values."""
        index_bytes, code_bytes, scale_bytes = self._sections(payload, numel, start, stop)
        triples = index_bytes.view(-1, 3).to(torch.int64)
        low = triples[:, 0] | (triples[:, 1] & 0xF) << 8
        high = triples[:, 1] >> 4 | triples[:, 2] << 4
        index = torch.stack([low, high], dim=1).view(-1, self.k)
        index += torch.arange(0, stop - start, self.CHUNK, dtype=torch.int64)[:, None]
        codes = code_bytes.to(torch.int64)[:, None].bitwise_right_shift(torch.tensor([0, 2, 4, 6])).bitwise_and_(3)
        levels = torch.tensor([0.5, 1.0, -0.5, -1.0], dtype=torch.float32)[codes.view(-1, self.k)]
        scales = _reinterpret(scale_bytes, self.scale_dtype).to(torch.float32)
        return index.view(-1), levels.mul_(scales[:, None]).view(-1)

    def _decode_piece(
        self, payload: torch.Tensor, numel: int, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = torch.empty(stop - start, dtype=torch.float32) if out is None else out
        index, values = self._positions_and_values(payload, numel, start, stop)
        out.zero_().index_put_((index,), values)
        return out

    def _add_decoded_piece(self, part: torch.Tensor, payload: torch.Tensor, numel: int, start: int, stop: int) -> None:
        # The positions are distinct, so this adds each sent value once and zero everywhere else, as the dense sum.
        index, values = self._positions_and_values(payload, numel, start, stop)
        part.index_put_((index,), values, accumulate=True)


def topk_count(density: float) -> int:
    """Values `topk` sends per 4096-value chunk at `density`: a multiple of 4, at least 4."""
    return min(TopKCodec.CHUNK, max(4, round(density * TopKCodec.CHUNK / 4) * 4))


def check_topk_density(density: float) -> None:
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(f"topk_density must be a number in (0, 1] (the share of values sent), got {density!r}.")


# The registry every list of codecs derives from (the config's choices, bits per value, the adaptive ladder). Its
# order is part of the wire format: an adaptive decision is broadcast as an index into `COMPRESSIONS`.
CODECS: dict[str, type[Codec]] = {
    codec.name: codec for codec in (Codec, BF16Codec, FP16Codec, Int8Codec, FP8Codec, FP4Codec, SignCodec, TopKCodec)
}
COMPRESSIONS = tuple(CODECS)
CODEC_BITS = {name: codec.bits for name, codec in CODECS.items()}
CODEC_ERROR = {name: codec.nominal_error for name, codec in CODECS.items()}


def make_codec(name: str, block_size: int = 128, scale_dtype: str = "fp32", density: float = 1 / 64) -> Codec:
    """Build the codec for `compression=name`.

    Args:
        name (`str`): one of `COMPRESSIONS` (`none`, `bf16`, `fp16`, `int8`, `fp8`, `fp4`, `sign`, `topk`).
        block_size (`int`): values per scale (`compression_block_size`); must be even for `fp4`, a multiple of 8
            for `sign`.
        scale_dtype (`str`): `fp32` or `bf16`, the dtype of the stored scales (`compression_scale_dtype`).
        density (`float`): the share of values `topk` sends (`topk_density`); the other codecs ignore it.

    Raises:
        `ValueError` naming the offending field (`compression`, `compression_block_size`,
        `compression_scale_dtype`).
    """
    if name not in CODECS:
        raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}; got {name!r}.")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"compression_block_size must be a positive integer, got {block_size!r}.")
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"compression_scale_dtype must be one of {', '.join(_SCALE_DTYPES)}; got {scale_dtype!r}.")
    if name == TopKCodec.name:
        return TopKCodec.build(block_size, scale_dtype, density)
    return CODECS[name].build(block_size, scale_dtype)


def quantization_residual(codec: Codec, values: torch.Tensor) -> torch.Tensor:
    """What `codec` drops from `values`: `values - decode(encode(values))`, in fp32 (for error feedback)."""
    values = values.detach().to(torch.float32)
    return values - codec.decode(codec.encode(values), values.numel())

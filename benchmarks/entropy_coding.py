"""Throughput and size of the exchange's entropy coding (`entropy_coding: true`) on one encoded payload.

    python -m benchmarks.entropy_coding --numel 64000000 --threads 1 2

Encodes `--numel` standard-normal values with `--compression` (block 128, fp32 scales), then deflates and inflates
the payload exactly as the exchange does (1 MiB pieces, zlib level 1) with each thread count, `--repeats` times, and
prints the median MB/s of the encoded payload and the deflated size as a share of it. What real pseudo-gradients
deflate to is in BENCHMARKS.md's bytes table (`benchmarks.comm`); i.i.d. Gaussian codes are close to the worst case.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from hf_diloco.core.compression.codecs import make_codec
from hf_diloco.core.exchange.payloads import deflate_payload, inflate_payload


def measure(payload: torch.Tensor, threads: int, repeats: int) -> dict:
    deflate_seconds, inflate_seconds = [], []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            started = time.perf_counter()
            packed = deflate_payload(payload, pool)
            deflate_seconds.append(time.perf_counter() - started)
            started = time.perf_counter()
            restored = inflate_payload(packed, payload.numel(), worker=0, pool=pool)
            inflate_seconds.append(time.perf_counter() - started)
            assert torch.equal(restored, payload)
    megabytes = payload.numel() / 1e6
    return {
        "threads": threads,
        "deflate_mb_per_s": megabytes / statistics.median(deflate_seconds),
        "inflate_mb_per_s": megabytes / statistics.median(inflate_seconds),
        "deflated_share": packed.numel() / payload.numel(),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=64_000_000)
    parser.add_argument("--compression", default="fp4")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    codec = make_codec(args.compression, 128)
    numel = -(-args.numel // codec.align) * codec.align  # whole scale blocks, as the exchange pads
    payload = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(0)))
    print(f"{args.compression} payload of {numel:,} values: {payload.numel() / 1e6:.1f} MB")
    results = [measure(payload, threads, args.repeats) for threads in args.threads]
    for r in results:
        print(
            f"threads {r['threads']}: deflate {r['deflate_mb_per_s']:.0f} MB/s, inflate {r['inflate_mb_per_s']:.0f} "
            f"MB/s, deflated size {100 * r['deflated_share']:.1f}% of the payload"
        )
    return results


if __name__ == "__main__":
    main()

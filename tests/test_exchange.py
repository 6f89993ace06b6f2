"""The outer exchange on real gloo processes: quantized averages, byte formulas, robust clipping, dead peers, NaN."""

from __future__ import annotations

import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hf_diloco import DiLoCo, DiLoCoConfig
from hf_diloco.core.compression.codecs import make_codec
from hf_diloco.core.exchange import exchange as exchange_module
from hf_diloco.core.exchange.exchange import OuterExchange
from hf_diloco.core.exchange.payloads import deflate_payload, inflate_payload
from hf_diloco.core.exchange.pending import OuterSyncError, PendingExchange
from hf_diloco.core.exchange.transport import OuterGroup, exchange_point_to_point
from hf_diloco.core.layout.topology import Topology
from tests.dist_utils import run_on_processes
from tests.engine_common import INNER_LR, inner_step, tiny_llama, tiny_model, train_engine

CODECS = ["none", "bf16", "fp16", "int8", "fp8", "fp4", "sign"]
# Relative error of one encode, from the codec bounds (tests/test_codecs.py); the average is encoded twice.
# sign sends ±mean|x| of a block: off by at most the block's absmax.
RELATIVE_BOUND = {"none": 0.0, "bf16": 2**-8, "fp16": 2**-10, "int8": 1 / 127, "fp8": 2**-3, "fp4": 0.5, "sign": 1.0}


def _vector(rank: int, numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank)
    vector = torch.randn(numel, generator=generator)
    vector[::97] *= 50  # outliers inside blocks
    return vector


def _exchange_every_codec(rank: int, world: int, numel: int) -> dict:
    topology = Topology.from_default_group()
    out = {}
    for name in CODECS:
        exchange = OuterExchange(topology, make_codec(name, block_size=64, scale_dtype="fp32"))
        result = exchange.launch(_vector(rank, numel), f"test {name}").wait()
        out[name] = (result.average, result.bytes_sent, exchange.wire_bytes(numel))
        exchange.close()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [2, 3])
def test_quantized_average_and_bytes_on_the_wire(workers):
    numel = 1000  # divides neither the block (64) nor the number of workers
    results = run_on_processes(_exchange_every_codec, workers, numel)
    exact = sum(_vector(rank, numel) for rank in range(workers)) / workers
    scale = max(_vector(rank, numel).abs().max() for rank in range(workers))
    for name in CODECS:
        averages = [r[name][0] for r in results]
        for other in averages[1:]:
            assert torch.equal(averages[0], other), name  # every worker decodes the same bytes
        error = (averages[0] - exact).abs().max()
        assert error <= 2 * RELATIVE_BOUND[name] * scale + 1e-6, (name, float(error))
        sent, formula = results[0][name][1], results[0][name][2]
        assert sent == formula, name
    # wire bytes: 2 (M-1) chunks of the padded vector; fp32 -> 4 B/elem, int8 -> ~1/4, fp4 -> ~1/8, plus scales
    padded = -(-numel // (workers * 64)) * workers * 64
    chunk = padded // workers
    fp32_bytes = 2 * (workers - 1) * chunk * 4
    assert results[0]["none"][1] == 2 * (workers - 1) * -(-numel // workers) * 4  # fp32 needs no block padding
    assert results[0]["int8"][1] == 2 * (workers - 1) * (chunk + chunk // 64 * 4)
    assert results[0]["fp4"][1] == 2 * (workers - 1) * (chunk // 2 + chunk // 64 * 4)
    assert results[0]["fp4"][1] / fp32_bytes == pytest.approx(1 / 8 + 1 / 64, rel=1e-9)
    assert results[0]["sign"][1] == 2 * (workers - 1) * (chunk // 8 + chunk // 64 * 4)


# topk too: a chunk-wise top-k whose workers' supports differ, decoded and summed in fp32.
GATHER_CODECS = [*CODECS, "topk"]


def _payload(sender: int, receiver: int, nbytes: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * sender + receiver)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


# Bytes member i sends to member j (uneven, one pair empty); what each member sends itself is never sent.
POINT_TO_POINT_SIZES = [[0, 5000, 17], [1, 0, 0], [70000, 3, 0]]


def _point_to_point_and_all_to_all(rank: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    import torch.distributed as dist

    outgoing = [
        _payload(rank, j, n) if j != rank else torch.empty(0, dtype=torch.uint8)
        for j, n in enumerate(POINT_TO_POINT_SIZES[rank])
    ]
    arriving = [POINT_TO_POINT_SIZES[j][rank] if j != rank else 0 for j in range(world)]
    by_messages = torch.full((sum(arriving),), 7, dtype=torch.uint8)
    exchange_point_to_point(
        by_messages.split(arriving), torch.cat(outgoing).split([p.numel() for p in outgoing]), dist.group.WORLD, rank
    )
    by_collective = torch.empty(sum(arriving), dtype=torch.uint8)
    sizes = [p.numel() for p in outgoing]
    dist.all_to_all_single(by_collective, torch.cat(outgoing), output_split_sizes=arriving, input_split_sizes=sizes)
    return list(by_messages.split(arriving)), list(by_collective.split(arriving))


@pytest.mark.timeout(120)
def test_point_to_point_exchange_delivers_what_all_to_all_delivers():
    results = run_on_processes(_point_to_point_and_all_to_all, 3)
    for rank, (by_messages, by_collective) in enumerate(results):
        for sender in range(3):
            expected = _payload(sender, rank, POINT_TO_POINT_SIZES[sender][rank]) if sender != rank else None
            if expected is None:
                assert by_messages[sender].numel() == 0
                continue
            assert torch.equal(by_messages[sender], expected), (rank, sender)
            assert torch.equal(by_collective[sender], expected), (rank, sender)


def _exchange_all_gather(rank: int, world: int, numel: int) -> dict:
    topology = Topology.from_default_group()
    out = {}
    for name in GATHER_CODECS:
        for pattern in ("all_gather", "reduce_scatter"):
            exchange = OuterExchange(topology, make_codec(name, block_size=64), keep_residual=True, pattern=pattern)
            result = exchange.launch(_vector(rank, numel), f"test {name}").wait()
            out[name, pattern] = (result.average, result.residual, result.bytes_sent, exchange.wire_bytes(numel))
            exchange.close()
    # Elastic membership: the last worker joined during the round and sends zeros; the average is over the others.
    exchange = OuterExchange(topology, make_codec("topk"), keep_residual=True, pattern="all_gather")
    joined = OuterGroup(torch.distributed.group.WORLD, rank, world, contributes=rank < world - 1)
    result = exchange.launch(_vector(rank, numel), "test topk with a joining worker", outer=joined).wait()
    out["joined"] = (result.average, result.contributors, result.bytes_sent, exchange.wire_bytes(numel))
    exchange.close()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [2, 3])
def test_all_gather_pattern_quantizes_each_contribution_once(workers):
    """Reference: each worker's padded vector encoded once, decoded by everyone, summed in worker order, / M."""
    numel = 1000
    results = run_on_processes(_exchange_all_gather, workers, numel)
    for name in GATHER_CODECS:
        codec = make_codec(name, block_size=64)
        padded_numel = -(-numel // (workers * codec.align)) * workers * codec.align
        decoded = []
        for rank in range(workers):
            padded = torch.zeros(padded_numel)
            padded[:numel] = _vector(rank, numel)
            decoded.append(codec.decode(codec.encode(padded), padded_numel))
        total = torch.zeros(padded_numel)
        for part in decoded:
            total += part
        expected = (total / workers)[:numel]
        for rank, result in enumerate(results):
            average, residual, sent, bound = result[name, "all_gather"]
            assert torch.equal(average, expected), (name, rank)
            assert torch.equal(residual, _vector(rank, numel) - decoded[rank][:numel]), (name, rank)
            assert sent == bound == (workers - 1) * codec.encoded_nbytes(padded_numel), (name, rank)
            reduce_scatter_bytes = result[name, "reduce_scatter"][2]
            if workers == 2:
                assert sent == reduce_scatter_bytes, name  # the same bytes for two workers
            else:
                assert sent == reduce_scatter_bytes * workers // 2, name
    codec = make_codec("topk")
    padded_numel = -(-numel // (workers * codec.align)) * workers * codec.align
    contributions = torch.zeros(padded_numel)
    for rank in range(workers - 1):
        padded = torch.zeros(padded_numel)
        padded[:numel] = _vector(rank, numel)
        contributions += codec.decode(codec.encode(padded), padded_numel)
    for average, contributors, sent, bound in (result["joined"] for result in results):
        assert contributors == workers - 1 and torch.equal(average, (contributions / (workers - 1))[:numel])
        assert sent == bound + (workers - 1) * 8  # and the contributor count, one int64 all-reduced


def _exchange_into_out(rank: int, world: int, sizes: tuple[int, ...]) -> dict:
    """Each exchange twice, into a fresh tensor and into `out` (filled with NaN first), with the same vector."""
    topology = Topology.from_default_group()
    found = {}
    for numel in sizes:
        for name in ("none", "fp4", "sign"):
            for pattern in ("all_gather", "reduce_scatter"):
                codec = make_codec(name, block_size=64)
                exchange = OuterExchange(topology, codec, keep_residual=True, pattern=pattern)
                fresh = exchange.launch(_vector(rank, numel), f"test {name}").wait()
                out = torch.full((numel,), float("nan"))
                into = exchange.launch(_vector(rank, numel), f"test {name} into out", out=out).wait()
                found[numel, name, pattern] = {
                    "fresh": (fresh.average, fresh.residual),
                    "into": (into.average, into.residual),
                    "average_is_out": into.average.data_ptr() == out.data_ptr() and into.average.shape == out.shape,
                }
                exchange.close()
    with pytest.raises(ValueError, match="contiguous fp32 tensor of 10 values, got torch.float32 \\(9,\\)"):
        exchange.launch(torch.zeros(10), "wrong out", out=torch.zeros(9))
    return found


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [2, 3])
def test_the_average_written_into_out_is_the_fresh_average_bit_for_bit(workers):
    # 1000 is padded for the blocks of 2 and 3 workers; 1152 is a whole number of them.
    for rank, result in enumerate(run_on_processes(_exchange_into_out, workers, (1000, 1152))):
        assert len(result) == 2 * 3 * 2
        for key, found in result.items():
            where = (workers, rank, *key)
            assert found["average_is_out"], where
            for fresh, into in zip(found["fresh"], found["into"]):
                assert torch.equal(fresh.view(torch.int32), into.view(torch.int32)), where


def _pieces_against_whole(rank: int, world: int) -> dict:
    """Each codec's `reduce_scatter` exchange of one vector, whole and in pieces (`pipelined_exchange`, its piece
    size lowered so that a 98,304-value vector is cut): average, residual and bytes sent, and how many pieces."""
    from hf_diloco.core.exchange import pipelined as pipelined_exchange

    topology, numel, found = Topology.from_default_group(), 3 * 8 * 4096, {}
    for name in ("none", "fp4", "sign", "topk"):
        codec = make_codec(name, block_size=64)
        for piece_values in (1 << 40, 64):
            pipelined_exchange.PIECE_VALUES = piece_values
            exchange = OuterExchange(topology, codec, keep_residual=True)
            result = exchange.launch(_vector(rank, numel), f"test {name}").wait()
            pieces = pipelined_exchange.pipeline_pieces(numel // world, codec.align)
            found[name, pieces > 1] = (result.average.clone(), result.residual.clone(), result.bytes_sent, pieces)
            exchange.close()
    return found


@pytest.mark.parametrize("workers", [2, 3])
def test_an_exchange_in_pieces_is_the_whole_exchange_bit_for_bit(workers):
    """A long shard exchanged in K pipelined pieces (both phases on the wire at once) averages, keeps a residual and
    counts bytes exactly as the exchange of the whole chunk, for every kind of codec: values, block scales, top-k."""
    for rank, found in enumerate(run_on_processes(_pieces_against_whole, workers)):
        for name in ("none", "fp4", "sign", "topk"):
            whole, pieces = found[name, False], found[name, True]
            assert whole[3] == 1 and pieces[3] >= 6, (name, whole[3], pieces[3])
            for a, b in zip(whole[:2], pieces[:2]):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (workers, rank, name)
            assert whole[2] == pieces[2], (workers, rank, name, whole[2], pieces[2])


def _error_feedback_rounds(rank: int, world: int, pattern: str, rounds: int) -> dict:
    exchange = OuterExchange(
        Topology.from_default_group(), make_codec("sign", block_size=64), keep_residual=True, pattern=pattern
    )
    residual, applied, produced = torch.zeros(640), torch.zeros(640), torch.zeros(640)
    for index in range(rounds):
        delta = torch.randn(640, generator=torch.Generator().manual_seed(1000 * rank + index)) + 0.3
        produced += delta
        result = exchange.launch(delta + residual, f"round {index}").wait()
        applied += result.average
        residual = result.residual
    exchange.close()
    return {"applied": applied, "produced": produced, "residual": residual}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pattern", ["all_gather", "reduce_scatter"])
def test_error_feedback_loses_nothing_with_one_quantization(pattern):
    """With all_gather, sum of applied averages + mean of the last residuals == mean of everything produced (up to
    fp32 rounding): error feedback accounts for every bit sign dropped. reduce_scatter's requantization of the
    average has no error feedback, so there the books do not balance."""
    workers, rounds = 2, 30
    results = run_on_processes(_error_feedback_rounds, workers, pattern, rounds)
    assert torch.equal(results[0]["applied"], results[1]["applied"])
    produced = sum(r["produced"] for r in results) / workers
    carried = sum(r["residual"] for r in results) / workers
    imbalance = float((results[0]["applied"] + carried - produced).norm() / produced.norm())
    if pattern == "all_gather":
        assert imbalance < 1e-5
    else:
        assert imbalance > 0.05


def _exchange_with_and_without_entropy_coding(rank: int, world: int, numel: int) -> dict:
    topology = Topology.from_default_group()
    out = {}
    for name in CODECS:
        for entropy_coding in (False, True):
            codec = make_codec(name, block_size=64, scale_dtype="fp32")
            exchange = OuterExchange(topology, codec, entropy_coding=entropy_coding)
            result = exchange.launch(_vector(rank, numel), f"test {name}").wait()
            out[name, entropy_coding] = (result.average, result.bytes_sent, exchange.wire_bytes(numel))
            exchange.close()
    return out


def _deflated_size(payload: torch.Tensor) -> int:
    """Bytes of the deflated form: a 4-byte length per MiB piece, then each piece's zlib stream (level 1)."""
    raw = payload.numpy().tobytes()
    pieces = [raw[start : start + 2**20] for start in range(0, len(raw), 2**20)]
    return min(4 * len(pieces) + sum(len(zlib.compress(piece, 1)) for piece in pieces), len(raw))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [2, 3])
def test_entropy_coding_is_lossless_and_sends_what_deflate_makes_of_each_payload(workers):
    numel = 64 * 97 + 5
    results = run_on_processes(_exchange_with_and_without_entropy_coding, workers, numel)
    for name in CODECS:
        for rank, result in enumerate(results):
            plain, coded = result[name, False], result[name, True]
            assert torch.equal(plain[0], coded[0]), name  # lossless: the same average, bit for bit
            assert coded[1] <= coded[2] == plain[2] + 2 * (workers - 1) * 8  # at most raw payloads plus lengths
            # Independent count: what zlib makes of every encoded chunk this rank sends, and of the averaged chunk.
            codec = make_codec(name, block_size=64, scale_dtype="fp32")
            chunk_numel = -(-numel // (workers * codec.align)) * codec.align
            padded = torch.zeros(chunk_numel * workers)
            padded[:numel] = _vector(rank, numel)
            chunks = padded.chunk(workers)
            sent = sum(_deflated_size(codec.encode(c)) for j, c in enumerate(chunks) if j != rank)
            averaged_chunk = plain[0].new_zeros(chunk_numel * workers)
            averaged_chunk[:numel] = plain[0]
            mine = codec.encode(averaged_chunk.chunk(workers)[rank])
            expected = sent + (workers - 1) * _deflated_size(mine) + 2 * (workers - 1) * 8
            assert coded[1] == expected, (name, rank)
    fp4_plain, fp4_coded = results[0]["fp4", False][1], results[0]["fp4", True][1]
    assert fp4_coded < fp4_plain, (fp4_coded, fp4_plain)  # fp4 codes are compressible, even with these outliers


@pytest.mark.parametrize("numel", [4096, 7 * 2**20 + 384])  # one piece; 4 pieces, the last one partial
def test_deflate_round_trip_and_inflate_refuses_bytes_that_are_not_what_deflate_sent(numel):
    codec = make_codec("fp4", block_size=128)
    payload = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(0)))
    nbytes = payload.numel()
    packed = deflate_payload(payload)
    with ThreadPoolExecutor(2) as pool:
        assert torch.equal(deflate_payload(payload, pool), packed)  # threads change nothing in the bytes
        assert torch.equal(inflate_payload(packed, nbytes, 1, pool), payload)
    assert packed.numel() == _deflated_size(payload) < nbytes
    assert torch.equal(inflate_payload(packed, nbytes, worker=1), payload)
    assert torch.equal(inflate_payload(payload, nbytes, worker=1), payload)  # sent raw
    sizes = [min(2**20, nbytes - start) for start in range(0, nbytes, 2**20)]
    header = 4 * len(sizes)

    def framed(streams: list[bytes]) -> torch.Tensor:
        lengths = b"".join(len(stream).to_bytes(4, "little") for stream in streams)
        return torch.frombuffer(bytearray(lengths + b"".join(streams)), dtype=torch.uint8)

    first_length = int.from_bytes(bytes(packed[:4].tolist()), "little")
    broken = {
        "garbage": torch.randint(0, 256, (100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)),
        "truncated": packed[:-10],
        "junk after the streams": torch.cat([packed, torch.tensor([1, 2, 3], dtype=torch.uint8)]),
        "a stream's bytes flipped": torch.cat(
            [packed[: header + 20], 255 - packed[header + 20 : header + 40], packed[header + 40 :]]
        ),
        "lengths that do not add up": torch.cat(
            [torch.tensor(list((first_length + 1).to_bytes(4, "little")), dtype=torch.uint8), packed[4:]]
        ),
        "streams of more than their piece": framed([zlib.compress(bytes(size + 10), 1) for size in sizes]),
        "streams of less than their piece": framed([zlib.compress(bytes(size - 10), 1) for size in sizes]),
        "more bytes than the payload": torch.zeros(nbytes + 1, dtype=torch.uint8),
    }
    for case, received in broken.items():
        with pytest.raises(
            ValueError, match=f"worker 1 sent .* neither a {nbytes}-byte encoded payload nor its deflated"
        ):
            inflate_payload(received, nbytes, worker=1)
            pytest.fail(case)


def _train_with_entropy_coding(rank: int, world: int, entropy_coding: bool) -> dict:
    config = dict(inner_steps=4, num_fragments=2, sync_delay=1, compression="fp4", entropy_coding=entropy_coding)
    model, _, engine = train_engine(rank, config, steps=10)
    engine.close()
    local = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"global": engine.global_parameters(), "local": local, "stats": dict(engine.stats)}


@pytest.mark.timeout(180)
def test_streaming_fp4_with_entropy_coding_trains_bitwise_like_without_and_sends_fewer_bytes():
    plain = run_on_processes(_train_with_entropy_coding, 2, False)
    coded = run_on_processes(_train_with_entropy_coding, 2, True)
    for without, with_coding in zip(plain, coded):
        for kind in ("global", "local"):
            for name, value in without[kind].items():
                assert torch.equal(value, with_coding[kind][name]), (kind, name)
        assert with_coding["stats"]["outer_steps"] == without["stats"]["outer_steps"] > 0
        assert with_coding["stats"]["bytes_sent"] < 0.95 * without["stats"]["bytes_sent"]


def _clip_case(rank: int, world: int) -> torch.Tensor:
    topology = Topology.from_default_group()
    exchange = OuterExchange(topology, make_codec("none"), clip_factor=3.0)
    vector = torch.full((10,), [1.0, 1.2, 50.0][rank]) / 10**0.5  # norms 1, 1.2, 50
    result = exchange.launch(vector, "clip").wait()
    exchange.close()
    return result.average, result.clipped


@pytest.mark.timeout(120)
def test_robust_clip_scales_an_outlier_to_factor_times_median():
    results = run_on_processes(_clip_case, 3)
    norms = [1.0, 1.2, 50.0]
    bound = 3.0 * 1.2
    contributions = [torch.full((10,), min(n, bound)) / 10**0.5 for n in norms]
    expected = sum(contributions) / 3
    for average, _ in results:
        torch.testing.assert_close(average, expected)
    assert [clipped for _, clipped in results] == [False, False, True]


def test_robust_clip_names_every_outlier_alike_and_leaves_joiners_and_a_zero_median_alone():
    """What every member computes from the gathered norms: its own scale and every outlier, named."""
    from hf_diloco.core.exchange.exchange import clip_outliers

    norms = torch.tensor([1.0, 1.2, 50.0, -1.0])  # the last member joined during the round: not in the median
    scale, [(name, ratio)] = clip_outliers(norms, 2, 3.0)
    assert (name, ratio, scale) == ("worker 2", pytest.approx(50.0 / 1.2), pytest.approx(3.0 * 1.2 / 50.0))
    assert clip_outliers(norms, 0, 3.0) == (1.0, (("worker 2", ratio),))  # the others learn who, and keep theirs
    assert clip_outliers(norms, 2, 3.0, ("a", "b", "site-c", "d"))[1] == (("site-c", ratio),)
    assert clip_outliers(torch.tensor([0.0, 2.0]), 1, 3.0) == (1.0, ())  # a worker that moved nothing: no scale
    assert clip_outliers(torch.tensor([1.0, float("inf")]), 1, 3.0) == (1.0, ())  # skipped everywhere instead


def _clip_with_joiners(rank: int, world: int) -> list[tuple[torch.Tensor, bool, int | None]]:
    """Elastic membership with clipping: two contributors beside two joiners (norms 1, 1.2, then zeros), and three
    contributors (norms 1, 1.2, 50) beside one joiner."""
    topology = Topology.from_default_group()
    out = []
    for contributors, norms in ((2, [1.0, 1.2]), (3, [1.0, 1.2, 50.0])):
        exchange = OuterExchange(topology, make_codec("none"), clip_factor=3.0)
        contributes = rank < contributors
        vector = torch.full((10,), norms[rank] if contributes else 0.0) / 10**0.5
        joined = OuterGroup(torch.distributed.group.WORLD, rank, world, contributes=contributes)
        result = exchange.launch(vector, "clip with joiners", outer=joined).wait()
        out.append((result.average, result.clipped, result.contributors))
        exchange.close()
    return out


@pytest.mark.timeout(120)
def test_robust_clip_leaves_a_joining_workers_zeros_out_of_the_median():
    """Reference: the lower median of the contributors' norms only; with the joiners' zeros in it, the first case's
    median would be 0 and every contribution would be zeroed."""
    results = run_on_processes(_clip_with_joiners, 4)
    for case, (contributors, norms) in enumerate(((2, [1.0, 1.2]), (3, [1.0, 1.2, 50.0]))):
        bound = 3.0 * sorted(norms)[(len(norms) - 1) // 2]
        expected = sum(torch.full((10,), min(n, bound)) / 10**0.5 for n in norms) / contributors
        for rank, result in enumerate(results):
            average, clipped, counted = result[case]
            torch.testing.assert_close(average, expected)
            assert counted == contributors
            assert clipped == (rank < contributors and norms[rank] > bound), (case, rank)


def _nan_worker(rank: int, world: int, overlap: str = "streaming") -> dict:
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    engine = DiLoCo(model, optimizer, DiLoCoConfig(inner_steps=2, overlap=overlap))
    initial = {n: v.clone() for n, v in engine.global_parameters().items()}
    snapshots = {}
    for t in range(1, 7):
        if rank == 1 and t == 1:
            with torch.no_grad():
                next(model.parameters()).mul_(float("nan"))  # this worker diverged
        inner_step(model, optimizer, rank, t)
        engine.step()
        if t == 2:
            snapshots["after_skip"] = {n: v.clone() for n, v in engine.global_parameters().items()}
            snapshots["local_after_skip"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return {
        "initial": initial,
        **snapshots,
        "final": {n: v.clone() for n, v in engine.global_parameters().items()},
        "stats": dict(engine.stats),
    }


@pytest.mark.timeout(180)
def test_non_finite_pseudo_gradient_skips_the_round_on_every_worker():
    results = run_on_processes(_nan_worker, 2)
    for result in results:
        assert result["stats"]["skipped_nonfinite"] == 1
        assert result["stats"]["outer_steps"] == 2  # rounds at steps 4 and 6 went through
        for name, value in result["initial"].items():
            assert torch.equal(result["after_skip"][name], value)  # theta_g untouched by the poisoned round
            assert torch.equal(result["local_after_skip"][name], value)  # and every worker restarted from it
        assert all(torch.isfinite(v).all() for v in result["final"].values())
    assert results[1]["stats"]["inner_state_resets"] >= 1  # the diverged worker's Adam moments were dropped
    for name in results[0]["final"]:
        assert torch.equal(results[0]["final"][name], results[1]["final"][name])


@pytest.mark.timeout(180)
def test_eager_worker_recovers_from_its_own_non_finite_round():
    """Eager applies its own Δm at once: a NaN one must not poison its trajectory beyond the rounds it spoils."""
    results = run_on_processes(_nan_worker, 2, "eager")
    for result in results:
        # Round 1 (NaN from step 1) and round 2 (trained from NaN Adam moments, dropped when round 1 is skipped)
        # are skipped everywhere; round 3 trains again from the agreed theta_g and goes through.
        assert result["stats"]["skipped_nonfinite"] == 2
        assert result["stats"]["outer_steps"] == 1
        assert all(torch.isfinite(v).all() for v in result["final"].values())
        assert any(not torch.equal(result["final"][n], v) for n, v in result["initial"].items())
    for name in results[0]["final"]:
        assert torch.equal(results[0]["final"][name], results[1]["final"][name])


def _silent_peer(rank: int, world: int) -> dict:
    topology = Topology.from_default_group(timeout_seconds=4)
    if rank == 1:
        time.sleep(12)  # alive but never joins the outer sync
        os._exit(0)
    exchange = OuterExchange(topology, make_codec("none"), timeout_seconds=3)
    started = time.perf_counter()
    try:
        exchange.launch(torch.ones(10), "outer sync of fragment 0 with peers [0, 1]").wait()
    except OuterSyncError as error:
        return {"message": str(error), "seconds": time.perf_counter() - started}
    return {"message": "", "seconds": time.perf_counter() - started}


@pytest.mark.timeout(120)
def test_a_peer_that_stops_answering_gives_a_clear_error_not_a_hang():
    outcome = _first_outcome_of_two(_silent_peer_entry)
    assert "outer sync" in outcome["message"] and "peers [0, 1]" in outcome["message"], outcome
    assert "sync_timeout_seconds" in outcome["message"] or "failed" in outcome["message"]
    assert outcome["seconds"] < 15


def _first_outcome_of_two(target) -> dict:
    """`target(rank, port, queue)` on two spawned processes (each sets up its own groups); the first outcome either
    puts on the queue."""
    import torch.multiprocessing as mp

    from tests.dist_utils import free_port

    port, context = free_port(), mp.get_context("spawn")
    queue = context.SimpleQueue()
    processes = [context.Process(target=target, args=(rank, port, queue)) for rank in range(2)]
    for process in processes:
        process.start()
    outcome = queue.get()
    for process in processes:
        process.join(timeout=60)
    return outcome


def _silent_peer_entry(rank: int, port: int, queue) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    result = _silent_peer(rank, 2)
    queue.put(result)
    os._exit(0)  # the outer-sync thread may still be blocked in gloo: do not wait for it


def test_a_peer_lost_on_a_torchft_group_is_named_by_gloos_own_error():
    """On a group torch.distributed did not create (torchft's, which every elastic exchange and join runs on), in a
    process with a default group (every site launched by torchrun), torch's logging wrapper answers a failed collective
    with a ValueError of its own ("not initialized in the world group map"); the worker must see, and report to
    torchft, gloo's error that a peer was lost."""
    pytest.importorskip("torchft", reason="torchft's groups: pip install 'hf_diloco[elastic]'")
    outcome = _first_outcome_of_two(_lost_peer_site)
    assert outcome["unmasked"] == "RuntimeError", outcome
    assert outcome["raw"] == "ValueError", outcome  # torch's wrapper still masks it: the unmasking is still needed
    message = outcome["message"]
    assert "outer sync of fragment 0 failed: [" in message and "A peer worker has probably died" in message, message
    assert "world group map" not in message, message


def _lost_peer_site(rank: int, port: int, queue) -> None:
    """Site `rank` of two on a torchft gloo group: site 1 leaves at once; site 0 then runs a collective on it."""
    import datetime

    import torch.distributed as dist
    from torchft import ProcessGroupGloo

    from hf_diloco.core.exchange.pending import unmasked_collective_error
    from tests.dist_utils import free_port

    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False) if rank == 0 else None
    own = dist.TCPStore("127.0.0.1", free_port(), is_master=True, world_size=1)
    dist.init_process_group("gloo", store=own, rank=0, world_size=1)  # this site's default group, as under torchrun
    group = ProcessGroupGloo(timeout=datetime.timedelta(seconds=20))
    group.configure(f"127.0.0.1:{port}/lost-peer", f"site-{rank}", rank, 2)
    if rank == 1:
        os._exit(0)  # its connection closes
    pending = PendingExchange.run_inline(
        lambda: dist.all_reduce(torch.ones(4), group=group.parent), "outer sync of fragment 0", 20
    )
    try:
        pending.wait()
        queue.put({"message": "no error"})
    except OuterSyncError as error:
        cause = error.__cause__
        queue.put(
            {
                "message": str(error),
                "raw": type(cause).__name__,
                "unmasked": type(unmasked_collective_error(cause)).__name__,
            }
        )
    del store
    os._exit(0)


def _mismatched_starts(rank: int, world: int, cases: list[str]) -> list[str]:
    """Start an engine per case (rank 1 differs in what the case names); returns each start's error, "" if none."""
    messages = []
    for case in cases:
        kwargs, layers, model_settings, extra = {"inner_steps": 4}, 4, {}, ""
        if case == "config" and rank == 1:
            kwargs["inner_steps"] = 8
        if case == "compression" and rank == 1:
            kwargs["compression"] = "fp4"
        if case == "model" and rank == 1:
            layers = 2
        if case == "model_settings" and rank == 1:
            model_settings = {"hidden_act": "gelu"}  # same shapes, another model
        if case == "extra" and rank == 1:
            extra = "tokenizer 2"
        if case == "version" and rank == 1:
            exchange_module.WIRE_FORMAT += 1  # this process stands for a node with another hf_diloco version
        model = tiny_llama(64, layers, 64, heads=2, tie_word_embeddings=False, **model_settings)
        try:
            DiLoCo(model, None, DiLoCoConfig(**kwargs), extra_fingerprint=extra)
            messages.append("")
        except ValueError as error:
            messages.append(str(error))
        finally:
            if case == "version" and rank == 1:
                exchange_module.WIRE_FORMAT -= 1
    return messages


MISMATCHES = {
    "same": "",
    "config": "differ between ranks",
    "compression": "differ between ranks",
    "model": "different model shapes",
    "model_settings": "models with different configurations for pipeline stage 0",
    "extra": "The training script's fingerprint differs between ranks (ranks [1]",
    "version": f"different outer-exchange wire formats ([{exchange_module.WIRE_FORMAT}, {exchange_module.WIRE_FORMAT + 1}]",
}


@pytest.mark.timeout(300)
def test_settings_that_differ_between_workers_fail_at_start_on_every_rank():
    """Invariant 7: one launch, one start per case; every rank raises the same error (none when all agree)."""
    for messages in run_on_processes(_mismatched_starts, 2, list(MISMATCHES)):
        for (case, expected), message in zip(MISMATCHES.items(), messages):
            assert expected in message and bool(expected) == bool(message), (case, message)


def test_checkpoint_with_other_settings_is_refused():
    engine = DiLoCo(tiny_model(), None, DiLoCoConfig(inner_steps=4))
    state = engine.state_dict()
    other = DiLoCo(tiny_model(), None, DiLoCoConfig(inner_steps=8, compression="int8"))
    with pytest.raises(ValueError) as refused:
        other.load_state_dict(state)
    message = str(refused.value)
    assert 'compression: "none" in the checkpoint, "int8" in this run' in message
    assert "inner_steps: 4 in the checkpoint, 8 in this run" in message
    assert 'resume with the settings it was saved with (compression="none", inner_steps=4)' in message
    assert "sync_timeout" not in message, "a node-local field is no reason to refuse"
    # A state written before the fields were stored has only the hash: still refused, by it.
    del state["settings"]
    with pytest.raises(ValueError, match="different DiLoCo settings \\(fingerprint [0-9a-f]{16} != "):
        other.load_state_dict(state)
    DiLoCo(tiny_model(), None, DiLoCoConfig(inner_steps=4, sync_timeout_seconds=5)).load_state_dict(state)


def test_an_elastic_joiner_with_other_settings_is_refused_naming_them():
    from hf_diloco.core.membership.elastic import check_peer_settings

    running = DiLoCoConfig(inner_steps=4)
    state = {"fingerprint": running.fingerprint(), "settings": running.shared_settings()}  # what a peer serves
    with pytest.raises(ValueError) as refused:
        check_peer_settings(DiLoCoConfig(inner_steps=2), state)
    assert str(refused.value) == (
        "A live peer runs with other DiLoCo settings (inner_steps: 4 in the peer, 2 in this worker): start this worker "
        "with the running workers' DiLoCo config (inner_steps=4)."
    )
    check_peer_settings(DiLoCoConfig(inner_steps=4, sync_timeout_seconds=3), state)  # node-local: no reason

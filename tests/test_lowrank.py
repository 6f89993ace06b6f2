"""Low-rank (PowerSGD) compression with error feedback, the adaptive policy, and both on real gloo processes.

References are written here in plain torch (Householder QR instead of the implementation's Gram-Schmidt: the
approximation P^ P^T M does not depend on the orthonormal basis chosen for span(P)).
"""

from __future__ import annotations

import pytest
import torch

from hf_diloco import DiLoCoConfig
from hf_diloco.core.compression.adaptive import (
    CODEC_BITS,
    Choice,
    CompressionPolicy,
    Observation,
    WindowEnergyPolicy,
    policy_compressions,
)
from hf_diloco.core.compression.codecs import make_codec
from hf_diloco.core.compression.lowrank import LowRankCompressor, orthonormalize
from hf_diloco.core.exchange.exchange import OuterExchange
from hf_diloco.core.exchange.transport import ScheduleTag
from hf_diloco.core.layout.topology import Topology
from tests.dist_utils import run_on_processes
from tests.engine_common import ADAPTIVE_DENSE_SIGN, VOCAB, train_engine

SHAPES = [(12, 10), (10,), (6, 8), (3, 3)]  # (3, 3): rank 2 would not save bytes, so it is sent as it is
SEED = 7


def _identity_average(vector: torch.Tensor) -> tuple[torch.Tensor, None]:
    return vector.clone(), None


def _quantizing_average(name: str):
    """One worker's exchange through a codec: what arrives is decode(encode(v)); the rest is what it dropped."""
    codec = make_codec(name, block_size=16)

    def average(vector: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        padded = torch.zeros(-(-vector.numel() // 16) * 16)
        padded[: vector.numel()] = vector
        decoded = codec.decode(codec.encode(padded), padded.numel())[: vector.numel()]
        return decoded, vector - decoded

    return average


def _drifting_signal(rounds: int, seed: int = 0) -> list[torch.Tensor]:
    """Rank-3 matrices (a weak third direction) whose factors drift slowly, plus noise and a 1-D tensor."""
    generator = torch.Generator().manual_seed(seed)
    u, v = torch.randn(40, 3, generator=generator), torch.randn(30, 3, generator=generator)
    du, dv = torch.randn(40, 3, generator=generator), torch.randn(30, 3, generator=generator)
    bias = torch.randn(30, generator=generator)
    strengths = torch.tensor([1.0, 0.6, 0.3])
    out = []
    for t in range(rounds):
        drift = 0.01 * t
        matrix = (u + drift * du) @ torch.diag(strengths) @ (v + drift * dv).T
        matrix += 0.05 * torch.randn(40, 30, generator=generator)
        out.append(torch.cat([matrix.reshape(-1), bias + 0.1 * torch.randn(30, generator=generator)]))
    return out


def _relative_error_of_sums(error_feedback: bool, average, rounds: int = 80) -> list[float]:
    compressor = LowRankCompressor([(40, 30), (30,)], rank=2, seed=SEED, error_feedback=error_feedback)
    sent_total = torch.zeros(40 * 30 + 30)
    true_total = torch.zeros_like(sent_total)
    residual = torch.zeros_like(sent_total)
    errors = []
    for delta in _drifting_signal(rounds):
        result = compressor.run(delta + residual, average)
        if error_feedback:
            residual = result.residual
        sent_total += result.average
        true_total += delta
        errors.append(float((sent_total - true_total).norm() / true_total.norm()))
    return errors


def test_error_feedback_transmits_everything_over_time():
    with_feedback = _relative_error_of_sums(True, _identity_average)
    without = _relative_error_of_sums(False, _identity_average)
    # The residual stays bounded while the sums grow, so the relative error shrinks toward 0 (about 1/rounds).
    assert max(with_feedback[-10:]) < 0.03
    assert max(with_feedback[-10:]) < with_feedback[4] / 5
    assert min(without[-10:]) > 0.15  # the third direction and the noise are lost for good
    assert min(without[-10:]) > 0.7 * without[4]  # and the loss does not shrink


@pytest.mark.parametrize("codec", ["fp8", "fp4"])
def test_error_feedback_composes_with_quantizing_codecs(codec):
    errors = _relative_error_of_sums(True, _quantizing_average(codec))
    assert max(errors[-10:]) < 0.03
    assert max(errors[-10:]) < errors[4] / 5


def test_orthonormalize_gives_orthonormal_columns_spanning_the_input():
    matrix = torch.randn(30, 5, generator=torch.Generator().manual_seed(0))
    basis = orthonormalize(matrix)
    torch.testing.assert_close(basis.T @ basis, torch.eye(5), atol=1e-6, rtol=0)
    torch.testing.assert_close(basis @ (basis.T @ matrix), matrix, atol=1e-5, rtol=0)
    assert torch.equal(basis, orthonormalize(matrix.clone()))  # deterministic bits


def test_orthonormalize_zeroes_dependent_and_zero_columns():
    matrix = torch.randn(20, 2, generator=torch.Generator().manual_seed(1))
    matrix = torch.cat([matrix, matrix @ torch.tensor([[2.0], [-1.0]]), torch.zeros(20, 1)], dim=1)
    basis = orthonormalize(matrix)
    torch.testing.assert_close(basis[:, :2].T @ basis[:, :2], torch.eye(2), atol=1e-6, rtol=0)
    assert torch.equal(basis[:, 2:], torch.zeros(20, 2))


def test_matrices_that_would_not_shrink_go_to_the_rest_vector():
    compressor = LowRankCompressor(SHAPES, rank=2)
    assert [(m.rows, m.cols) for m in compressor.matrices] == [(12, 10), (6, 8)]
    assert compressor.rest_numel == 10 + 9
    assert compressor.vector_lengths() == [(12 + 6) * 2 + 19, (10 + 8) * 2]


def test_changing_rank_keeps_the_strongest_directions():
    compressor = LowRankCompressor([(16, 12)], rank=2, max_rank=4)
    basis = torch.linalg.qr(torch.randn(12, 2, generator=torch.Generator().manual_seed(2))).Q
    compressor.q = [basis * torch.tensor([0.1, 5.0])]  # the second column is the strong one
    compressor.set_rank(1)
    kept = compressor.q[0][:, 0] / compressor.q[0][:, 0].norm()
    assert abs(float(kept @ basis[:, 1])) == pytest.approx(1.0, abs=1e-5)
    compressor.set_rank(3)
    assert compressor.q[0].shape == (12, 3)
    torch.testing.assert_close(compressor.q[0][:, :1], kept[:, None] * 5.0, atol=1e-5, rtol=0)


def test_zero_round_does_not_stall_the_warm_start():
    compressor = LowRankCompressor([(16, 12)], rank=2)
    compressor.run(torch.zeros(16 * 12), _identity_average)
    assert torch.equal(compressor.q[0], torch.zeros(12, 2))
    signal = torch.randn(16 * 12, generator=torch.Generator().manual_seed(3))
    result = compressor.run(signal, _identity_average)
    assert float(result.average.norm()) > 0.3 * float(signal.norm())


def test_state_dict_resumes_the_warm_start_bitwise():
    signal = _drifting_signal(3)
    compressor = LowRankCompressor([(40, 30), (30,)], rank=2, max_rank=4, seed=SEED)
    compressor.run(signal[0], _identity_average)
    compressor.set_rank(3)
    compressor.run(signal[1], _identity_average)
    restored = LowRankCompressor([(40, 30), (30,)], rank=2, max_rank=4, seed=SEED)
    restored.load_state_dict(compressor.state_dict())
    expected = compressor.run(signal[2], _identity_average)
    actual = restored.run(signal[2], _identity_average)
    assert torch.equal(actual.average, expected.average) and torch.equal(actual.residual, expected.residual)


# --------------------------------------------------------------------------------------------- the adaptive policy


def _bytes_of(rank: int, codec: str) -> int:
    return (1000 + 800) * rank * CODEC_BITS[codec] // 8 + 256


def _observe(**overrides) -> Observation:
    values = dict(
        step=10,
        rank=16,
        compression="fp4",
        link_bytes_per_second=1e12,
        step_seconds=0.1,
        overlap_steps=10,
        captured_energy=None,
        bytes_of=_bytes_of,
    )
    values.update(overrides)
    return Observation(**values)


def _policy() -> WindowEnergyPolicy:
    return WindowEnergyPolicy(16, 1, ["fp4", "fp8", "bf16", "none"], energy_threshold=0.9)


def test_policy_slow_link_picks_fewer_bytes_than_fast_link():
    policy = _policy()
    fast = policy.choose(_observe(link_bytes_per_second=1e12))
    medium = policy.choose(_observe(link_bytes_per_second=2e4))  # 1 s window: 20 kB
    slow = policy.choose(_observe(link_bytes_per_second=2e3))  # 2 kB
    assert (fast.rank, fast.compression) == (16, "none")
    assert (medium.rank, medium.compression) == (16, "fp4")  # 14.6 kB fits; rank 16 fp8 (29 kB) does not
    assert (slow.rank, slow.compression) == (1, "fp4")  # only 1.2 kB fits
    assert _bytes_of(slow.rank, slow.compression) < _bytes_of(medium.rank, medium.compression)
    assert _bytes_of(medium.rank, medium.compression) < _bytes_of(fast.rank, fast.compression)


def test_policy_concentrated_spectrum_shrinks_the_rank():
    concentrated = [0.6, 0.93] + [0.93 + 0.004 * k for k in range(1, 15)]
    choice = _policy().choose(_observe(captured_energy=concentrated))
    assert (choice.rank, choice.compression) == (2, "none")
    spread = [0.5 * k / 16 for k in range(1, 17)]
    assert _policy().choose(_observe(captured_energy=spread)).rank == 16


def test_policy_grows_the_rank_when_the_current_one_captures_too_little():
    choice = _policy().choose(_observe(rank=4, captured_energy=[0.1, 0.2, 0.25, 0.3]))
    assert choice.rank == 8


def test_policy_falls_back_to_fewest_bytes_and_to_the_current_codec():
    blocking = _policy().choose(_observe(overlap_steps=0))
    assert (blocking.rank, blocking.compression) == (1, "fp4")
    unmeasured = _policy().choose(_observe(link_bytes_per_second=None, rank=8, compression="fp8"))
    assert (unmeasured.rank, unmeasured.compression) == (8, "fp8")


def test_policy_with_a_sign_floor_takes_one_bit_only_when_fp4_does_not_fit():
    policy = WindowEnergyPolicy(16, 16, policy_compressions("sign"), energy_threshold=0.9)
    assert policy.compressions == ["sign", "fp4", "fp8", "bf16", "none"]
    fits_fp4 = policy.choose(_observe(link_bytes_per_second=2e4))  # 1 s window: 20 kB; fp4 at rank 16 is 14.6 kB
    assert (fits_fp4.rank, fits_fp4.compression) == (16, "fp4")
    one_bit = policy.choose(_observe(link_bytes_per_second=5e3))  # 5 kB: rank-16 signs (3.9 kB) fit, fp4 does not
    assert (one_bit.rank, one_bit.compression) == (16, "sign")


def test_dense_candidates_win_when_they_fit_and_give_way_when_they_do_not():
    policy = WindowEnergyPolicy(16, 1, policy_compressions("sign"), energy_threshold=0.9, dense=True)
    dense_bytes = {"sign": 2_000, "fp4": 8_000, "fp8": 16_000, "bf16": 32_000, "none": 64_000}

    def bytes_of(rank: int, codec: str) -> int:
        return dense_bytes[codec] if rank == 0 else _bytes_of(rank, codec)

    fast = policy.choose(_observe(link_bytes_per_second=1e12, bytes_of=bytes_of))
    assert (fast.rank, fast.compression) == (0, "none") and "dense" in fast.reason
    # 10 kB window: dense fp4 (8 kB) beats every factorised setting that fits (rank 16 fp4 is 14.7 kB, too big).
    medium = policy.choose(_observe(link_bytes_per_second=1e4, bytes_of=bytes_of))
    assert (medium.rank, medium.compression) == (0, "fp4")
    # 3 kB: dense sign (2 kB, error 0.36) against rank 8 sign (2.1 kB, also missing half of a flat spectrum).
    slow = policy.choose(_observe(link_bytes_per_second=3e3, bytes_of=bytes_of))
    assert (slow.rank, slow.compression) == (0, "sign")
    # After a dense sync the rank ceiling starts from the largest rank again.
    again = policy.choose(_observe(rank=0, link_bytes_per_second=None, bytes_of=bytes_of))
    assert again.rank == 16
    # The largest rank captured only 80% (< 90%): the spectrum is too flat for low rank, dense only, even when a
    # factorised setting would have been estimated as more accurate than dense sign.
    flat = [0.05 * k for k in range(1, 17)]
    too_flat = policy.choose(_observe(captured_energy=flat, link_bytes_per_second=3e3, bytes_of=bytes_of))
    assert (too_flat.rank, too_flat.compression) == (0, "sign") and "dense only" in too_flat.reason
    steep = [0.5, 0.95] + [0.95 + 0.003 * k for k in range(1, 15)]
    assert policy.choose(_observe(captured_energy=steep, link_bytes_per_second=3e3, bytes_of=bytes_of)).rank == 2
    without = WindowEnergyPolicy(16, 1, policy_compressions("sign"), energy_threshold=0.9)
    assert without.choose(_observe(link_bytes_per_second=1e12, bytes_of=bytes_of)).rank == 16


def test_a_dense_round_averages_everything_and_keeps_the_warm_start():
    compressor = LowRankCompressor(SHAPES, rank=2, max_rank=4, seed=SEED)
    q_before = [q.clone() for q in compressor.q]
    compressor.set_rank(0)
    assert compressor.vector_lengths() == [compressor.numel]
    flat = torch.randn(compressor.numel, generator=torch.Generator().manual_seed(3))
    dropped = torch.full_like(flat, 0.25)
    result = compressor.run(flat, lambda vector: (vector * 2, dropped))
    assert torch.equal(result.average, flat * 2) and torch.equal(result.residual, dropped)
    assert all(torch.equal(q, before) for q, before in zip(compressor.q, q_before))
    compressor.set_rank(2)
    assert all(torch.equal(q, before) for q, before in zip(compressor.q, q_before))
    with pytest.raises(ValueError, match="rank must be in"):
        compressor.set_rank(-1)


def test_a_dense_round_measures_the_spectrum_locally():
    generator = torch.Generator().manual_seed(4)
    rank_two = torch.randn(12, 2, generator=generator) @ torch.randn(2, 10, generator=generator)
    compressor = LowRankCompressor([(12, 10)], rank=4, seed=SEED, track_energy=True)
    q_before = compressor.q[0].clone()
    compressor.set_rank(0)
    compressor.run(rank_two.reshape(-1), _identity_average)
    assert compressor.captured_energy[1] == pytest.approx(1.0, abs=1e-4)  # rank 2 holds all of a rank-2 matrix
    assert compressor.captured_energy[0] < 0.99
    assert torch.equal(compressor.q[0], q_before)


@pytest.mark.parametrize(
    "values, field_name",
    [
        ({"adaptive_dense": True}, "adaptive_dense"),
        ({"lowrank_rank": -1}, "lowrank_rank"),
        ({"lowrank_rank": 4, "lowrank_min_rank": 0}, "lowrank_min_rank"),
        ({"lowrank_rank": 4, "lowrank_min_rank": 8}, "lowrank_min_rank"),
        ({"adaptive_compression": True}, "adaptive_compression"),
        ({"lowrank_rank": 4, "adaptive_energy_threshold": 0.0}, "adaptive_energy_threshold"),
        ({"lowrank_rank": 4, "adaptive_energy_threshold": 1.5}, "adaptive_energy_threshold"),
        ({"adaptive_link_bytes_per_second": -1.0}, "adaptive_link_bytes_per_second"),
    ],
)
def test_config_rejects_bad_lowrank_values(values, field_name):
    with pytest.raises(ValueError, match=field_name):
        DiLoCoConfig(**values)


# --------------------------------------------------------------------------------------------- real processes


def _delta(worker: int, round_index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * worker + round_index)
    return torch.randn(sum(torch.Size(s).numel() for s in SHAPES), generator=generator)


class _RankDependentPolicy(CompressionPolicy):
    """Asks each rank for a different setting: only the outer group's first rank may be obeyed."""

    def choose(self, observation: Observation) -> Choice:
        import torch.distributed as dist

        return Choice(1 + dist.get_rank(), ["fp8", "bf16"][dist.get_rank()], f"rank {dist.get_rank()}")


def _exchange_rounds(rank: int, world: int, rounds: int, adaptive: bool) -> dict:
    exchange = OuterExchange(Topology.from_default_group(), make_codec("none"), keep_residual=True)
    compressor = LowRankCompressor(SHAPES, rank=2, seed=SEED)
    if adaptive:
        exchange.policy = _RankDependentPolicy()
        exchange.codec_factory = lambda name: make_codec(name, block_size=8)
    averages, residuals, sent = [], [], []
    residual = torch.zeros_like(_delta(rank, 0))
    for index in range(rounds):
        result = exchange.launch(_delta(rank, index) + residual, "test", compressor=compressor).wait()
        residual = result.residual
        averages.append(result.average)
        residuals.append(result.residual)
        sent.append(result.bytes_sent)
    exchange.close()
    return {"averages": averages, "residuals": residuals, "sent": sent, "choices": exchange.choices}


def _reference_rounds(workers: int, rounds: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Plain PowerSGD: P = mean M_i Q, P^ = qr(P), Q' = mean M_i^T P^, out = P^ Q'^T, e_i = M_i - P^ (M_i^T P^)^T."""
    generator = torch.Generator().manual_seed(SEED)
    q = {0: torch.randn(10, 2, generator=generator), 2: torch.randn(8, 2, generator=generator)}
    offsets = [0, 120, 130, 178]
    residuals = [torch.zeros(187) for _ in range(workers)]
    averages, all_residuals = [], []
    for index in range(rounds):
        inputs = [_delta(w, index) + residuals[w] for w in range(workers)]
        average = sum(inputs) / workers  # the rest: plain mean
        new_residuals = [torch.zeros(187) for _ in range(workers)]
        for slot, (rows, cols) in ((0, (12, 10)), (2, (6, 8))):
            start = offsets[slot]
            mats = [x[start : start + rows * cols].view(rows, cols) for x in inputs]
            p_hat = torch.linalg.qr(sum(m @ q[slot] for m in mats) / workers).Q
            q_parts = [m.T @ p_hat for m in mats]
            q[slot] = sum(q_parts) / workers
            average[start : start + rows * cols] = (p_hat @ q[slot].T).reshape(-1)
            for w in range(workers):
                new_residuals[w][start : start + rows * cols] = (mats[w] - p_hat @ q_parts[w].T).reshape(-1)
        residuals = new_residuals
        averages.append(average)
        all_residuals.append(residuals)
    return averages, all_residuals


def _wire_bytes(numel: int, workers: int, bytes_per_value: float, scale_bytes_per_block: int = 0, block: int = 1):
    padded = -(-numel // (workers * block)) * workers * block
    chunk = padded // workers
    return 2 * (workers - 1) * int(chunk * bytes_per_value + chunk // block * scale_bytes_per_block)


@pytest.mark.timeout(180)
def test_lowrank_exchange_matches_plain_powersgd_on_two_processes():
    rounds = 3
    results = run_on_processes(_exchange_rounds, 2, rounds, False)
    averages, residuals = _reference_rounds(2, rounds)
    for index in range(rounds):
        assert torch.equal(results[0]["averages"][index], results[1]["averages"][index])
        for worker in range(2):
            torch.testing.assert_close(results[worker]["averages"][index], averages[index], atol=1e-5, rtol=0)
            torch.testing.assert_close(
                results[worker]["residuals"][index], residuals[index][worker], atol=1e-5, rtol=0
            )
    # [P (12 + 6 rows) x rank 2 ++ rest (10 + 9)] then [Q (10 + 8 cols) x rank 2], fp32 with compression none.
    expected = _wire_bytes(18 * 2 + 19, 2, 4) + _wire_bytes(18 * 2, 2, 4)
    assert all(sent == expected for r in results for sent in r["sent"])


@pytest.mark.timeout(180)
def test_adaptive_choice_of_the_first_rank_is_used_everywhere():
    results = run_on_processes(_exchange_rounds, 2, 2, True)
    for index in range(2):
        assert torch.equal(results[0]["averages"][index], results[1]["averages"][index])
    for choices in (results[0]["choices"], results[1]["choices"]):
        assert [(c["rank"], c["compression"]) for c in choices] == [(1, "fp8"), (1, "fp8")]
    assert results[0]["choices"][0]["reason"] == "rank 0"
    # rank 1, fp8 with block 8 (1 byte per value + one fp32 scale per 8 values); the decider also sends 16 bytes.
    expected = _wire_bytes(18 + 19, 2, 1, 4, 8) + _wire_bytes(18, 2, 1, 4, 8)
    assert results[1]["sent"] == [expected, expected]
    assert results[0]["sent"] == [expected + 16, expected + 16]


class _PlanRecorder(CompressionPolicy):
    """Always rank 2 at fp32; records the bytes the exchange tells it that setting will send."""

    def __init__(self):
        self.planned: list[int] = []

    def choose(self, observation: Observation) -> Choice:
        self.planned.append(observation.bytes_of(2, "none"))
        return Choice(2, "none", "fixed")


def _planned_and_sent(rank: int, world: int, rounds: int) -> dict:
    exchange = OuterExchange(Topology.from_default_group(), make_codec("none"), entropy_coding=True)
    exchange.policy = _PlanRecorder()
    compressor = LowRankCompressor([(64, 32)], rank=2, seed=SEED)
    sent = []
    for index in range(rounds):
        matrix = torch.zeros(64, 32)
        matrix[index] = torch.randn(32, generator=torch.Generator().manual_seed(10 * rank + index))
        sent.append(exchange.launch(matrix.reshape(-1), "test", compressor=compressor).wait().bytes_sent)
    bound = sum(exchange.wire_bytes(n) for n in compressor.vector_lengths(2))
    exchange.close()
    return {"planned": exchange.policy.planned, "sent": sent, "bound": bound}


@pytest.mark.timeout(180)
def test_adaptive_plan_counts_what_entropy_coding_saved_last_time():
    """One non-zero row: P is mostly zeros and deflates well. The first plan is the raw bound, later ones what the
    previous exchange actually sent (rank 1 sends no decision bytes, so its plan equals its count exactly)."""
    results = run_on_processes(_planned_and_sent, 2, 3)
    for result in results:
        assert result["planned"][0] == result["bound"]
        assert result["sent"][0] < 0.75 * result["bound"]
    assert results[1]["planned"][1:] == results[1]["sent"][:-1]
    assert results[0]["planned"][1:] == [sent - 16 for sent in results[0]["sent"][:-1]]  # the decision broadcast


def _engine_run(rank: int, world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        case = dict(case)
        steps = case.pop("steps")
        model, _, engine = train_engine(rank, case, steps)
        engine.close()
        shapes = dict((name, tuple(p.shape)) for name, p in model.named_parameters())
        out.append(
            {
                "global": engine.global_parameters(),
                "stats": dict(engine.stats),
                "choices": engine.exchange.choices,
                "shapes": list(shapes.values()),
                "fragment_shapes": [[p.shape(shapes[p.name]) for p in pieces] for pieces in engine.fragment_pieces()],
            }
        )
    return out


def _rank2_round_bytes(shapes: list[tuple]) -> int:
    """Bytes one worker sends for one rank-2 fp32 round of these tensors: the schedule tag, the norm robust clipping
    gathers (one fp32), P and the rest, then Q (2 workers)."""
    rows = cols = rest = 0
    for shape in shapes:
        numel = torch.Size(shape).numel()
        if len(shape) >= 2 and (shape[0] + numel // shape[0]) * 2 < numel:
            rows, cols = rows + shape[0], cols + numel // shape[0]
        else:
            rest += numel
    return ScheduleTag.NBYTES + 4 + _wire_bytes(rows * 2 + rest, 2, 4) + _wire_bytes(cols * 2, 2, 4)


@pytest.mark.timeout(300)
def test_engine_lowrank_and_adaptive_on_two_workers():
    cases = [
        dict(inner_steps=2, steps=4, lowrank_rank=2, compression="none"),
        dict(
            inner_steps=2,
            steps=6,
            overlap="delayed",
            lowrank_rank=4,
            adaptive_compression=True,
            compression="fp4",
            compression_block_size=32,
            adaptive_link_bytes_per_second=1.0,  # a hopeless link: the cheapest setting every time
            entropy_coding=True,  # deflated P/Q factors: the decider's plan uses its measured deflate share
        ),
        # Row pieces of the embedding and head are factorised as matrices of their own.
        dict(inner_steps=2, steps=4, lowrank_rank=2, compression="none", num_fragments=2, fragment_pattern="balanced"),
        # Dense allowed and a link that takes anything: once the step time is known, every sync goes dense in fp32.
        dict(ADAPTIVE_DENSE_SIGN, inner_steps=2, steps=8, overlap="delayed", adaptive_link_bytes_per_second=1e15),
    ]
    results = run_on_processes(_engine_run, 2, cases)
    for index in range(len(cases)):
        first, second = results[0][index], results[1][index]
        for name, value in first["global"].items():
            assert torch.equal(value, second["global"][name]), name
    plain = results[0][0]
    assert plain["stats"]["bytes_sent"] == 2 * _rank2_round_bytes(plain["shapes"])
    assert plain["stats"]["lowrank_rank"] == 2
    pieces = results[0][2]
    assert pieces["fragment_shapes"][0][0] == (VOCAB // 2, 32)  # the first half of the embedding's rows
    for fragment, shapes in enumerate(pieces["fragment_shapes"]):
        syncs = pieces["stats"][f"fragment{fragment}_syncs"]
        assert pieces["stats"][f"fragment{fragment}_bytes_sent"] == syncs * _rank2_round_bytes(shapes) > 0
    adaptive = [r[1] for r in results]
    assert adaptive[0]["choices"] == [
        {**c, "reason": adaptive[0]["choices"][i]["reason"]} for i, c in enumerate(adaptive[1]["choices"])
    ]
    # Nothing fits a 1 byte/s link, so every sync takes the fewest bytes.
    assert [(c["rank"], c["compression"]) for c in adaptive[0]["choices"]] == [(1, "fp4")] * 3
    assert adaptive[0]["stats"]["lowrank_rank"] == 1 and adaptive[0]["stats"]["compression_bits"] == 4
    dense = results[0][3]
    assert [(c["rank"], c["compression"]) for c in dense["choices"]][1:] == [(0, "none")] * 3
    assert dense["stats"]["lowrank_rank"] == 0

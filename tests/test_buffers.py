"""The reused buffers of the pseudo-gradient and of the average: a buffer comes back only once nothing refers to it, in
the pool alone and in the engine on real gloo processes, whatever holds a round's sent vector or average (the exchange,
the delayed and eager modes, an observer, a checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_diloco import DiLoCo, DiLoCoConfig
from hf_diloco.core.layout.buffers import BufferPool
from hf_diloco.core.layout.shard import concatenated
from hf_diloco.core.rounds.fragment import _steps_in_pieces, optimizer_step
from tests.dist_utils import run_on_processes
from tests.engine_common import INNER_LR, inner_step, tiny_model


def test_a_buffer_comes_back_once_nothing_refers_to_it():
    pool = BufferPool(limit=4)
    first = pool.take(1000)
    storage = first.untyped_storage().data_ptr()
    holders = [first[10:20], first.cpu(), first.split(500)]  # a view, an alias (the same tensor), pieces
    del first
    while holders:
        assert pool.take(1000).untyped_storage().data_ptr() != storage  # something still refers to the first
        holders.pop()
    assert pool.take(1000).untyped_storage().data_ptr() == storage
    assert len(pool.tensors()) == 2  # the first buffer and the one made while it was held


def test_the_pool_keeps_at_most_its_limit_and_serves_shorter_requests_from_longer_buffers():
    pool = BufferPool(limit=2)
    a, b = pool.take(8), pool.take(8)
    c = pool.take(8)  # both kept buffers are in use: a fresh tensor the pool does not keep
    kept = {t.untyped_storage().data_ptr() for t in pool.tensors()}
    assert len(kept) == 2 and c.untyped_storage().data_ptr() not in kept
    del b
    d = pool.take(16)  # no free buffer is long enough: the free buffer of 8 (kept second) gives way to one of 16
    assert sorted(t.numel() for t in pool.tensors()) == [8, 16]
    longest = d.untyped_storage().data_ptr()
    del d
    e = pool.take(4)  # served from the free buffer of 16
    assert e.numel() == 4 and e.untyped_storage().data_ptr() == longest
    assert a.numel() == 8 and c.numel() == 8
    with pytest.raises(ValueError, match="at least 1"):
        BufferPool(limit=0)


def _rounds(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Train every case; observers keep each round's sent vector and average (`keep`) or only copies of them, and the
    values of each kept vector at its round are compared with what it holds at the end."""
    results = []
    for case in cases:
        case = dict(case)
        steps, keep = case.pop("steps"), case.pop("keep")
        model = tiny_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
        engine = DiLoCo(model, optimizer, DiLoCoConfig(**case))
        pool = {t.untyped_storage().data_ptr() for t in engine.buffers.tensors()}
        seen: list[dict] = []

        def observe(record, seen=seen, keep=keep, engine=engine):
            kept = {t.untyped_storage().data_ptr() for t in engine.buffers.tensors()}
            seen.append(
                {
                    "pooled": [t.untyped_storage().data_ptr() in kept for t in (record.sent, record.average)],
                    "kept": [record.sent, record.average] if keep else None,
                    "copies": [record.sent.clone(), record.average.clone()],
                }
            )

        engine.add_observer(observe)
        saved = None
        for t in range(1, steps + 1):
            inner_step(model, optimizer, rank, t)
            engine.step()
            if t == case["inner_steps"] + 1 and case.get("overlap") == "delayed":
                saved = engine.state_dict()  # holds a copy of the sent vector in flight
                saved_sent = saved["pending"][0]["sent"].clone()
        held_bytes = engine.stats["outer_state_bytes"]
        results.append(
            {
                "pooled": [round_["pooled"] for round_ in seen],
                "unchanged": [
                    [torch.equal(kept, copy) for kept, copy in zip(r["kept"], r["copies"])]
                    for r in seen
                    if r["kept"] is not None
                ],
                "saved_unchanged": None if saved is None else torch.equal(saved["pending"][0]["sent"], saved_sent),
                "buffers": len(engine.buffers.tensors()),
                "pool_at_start": len(pool),
                "held_bytes": held_bytes,
                "parameters": sum(p.numel() for p in model.parameters()),
            }
        )
        engine.close()
    return results


@pytest.mark.timeout(600)
def test_the_engine_reuses_a_round_buffer_only_when_nothing_holds_it():
    cases = [
        dict(inner_steps=2, steps=8, keep=False),  # plain DiLoCo: two buffers, reused every round
        dict(inner_steps=2, steps=8, keep=True),  # an observer holds every sent vector and average: never reused
        dict(inner_steps=2, steps=8, keep=False, overlap="delayed"),  # a round in flight, and a checkpoint of it
        dict(inner_steps=2, steps=8, keep=False, overlap="eager"),
    ]
    results = run_on_processes(_rounds, 2, cases, timeout_seconds=300)
    for plain, held, delayed, eager in results:
        assert plain["pool_at_start"] == 0
        assert plain["pooled"] == [[True, True]] * 4 and plain["buffers"] == 2
        # θg and the outer momentum (8 bytes per parameter), and the reused pseudo-gradient and average buffers (8).
        assert plain["held_bytes"] == 16 * plain["parameters"]
        assert held["unchanged"] == [[True, True]] * 4
        # Its limit, 2P + 2: the third and fourth rounds' vectors are fresh tensors.
        assert held["pooled"] == [[True, True]] * 2 + [[False, False]] * 2 and held["buffers"] == 4
        assert delayed["saved_unchanged"] is True
        assert delayed["pooled"] == [[True, True]] * 3 and eager["pooled"] == [[True, True]] * 3
        assert delayed["buffers"] == eager["buffers"] == 4  # the round in flight and the one being made


def test_subtracting_while_reading_gives_the_bits_of_converting_then_subtracting():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(3000, generator=generator)
    parts = [values[:1000].to(torch.bfloat16), values[1000:2000], values[2000:].to(torch.float64) * (1 + 1e-9)]
    start = torch.randn(3000, generator=generator)
    # Under the bf16 part the start is what θm started from: rounded to bf16 (round to nearest even) and back.
    bf16_start = start[:1000].to(torch.bfloat16).to(torch.float32)
    assert not torch.equal(bf16_start, start[:1000])
    expected = torch.cat([bf16_start, start[1000:]]) - torch.cat([part.to(torch.float32) for part in parts])
    out = torch.empty(3000)
    assert concatenated(parts, out, subtracted_from=start) is out
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(concatenated(parts), torch.cat([part.to(torch.float32) for part in parts]))
    with pytest.raises(ValueError, match="contiguous fp32 CPU vector of 3000 values"):
        concatenated(parts, torch.empty(2999))


class _CopiesInFlight:
    """`shard.HostTransfers` as an accelerator runs it, emulated on the CPU: a copy only lands at `wait()`; until
    then its host buffer holds NaN (what a `torch.empty` buffer read too early may hold, arXiv 2407.01614)."""

    outstanding = 0

    def __init__(self) -> None:
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(self, host: torch.Tensor, part: torch.Tensor) -> None:
        host.fill_(float("nan"))
        self._copies.append((host, part))
        _CopiesInFlight.outstanding += 1

    def wait(self) -> None:
        for host, part in self._copies:
            host.copy_(part)
        _CopiesInFlight.outstanding -= len(self._copies)
        self._copies.clear()


def _copies_in_flight(monkeypatch, window: int) -> None:
    """Read every part as if it lived on an accelerator: through staging buffers and `_CopiesInFlight`."""
    from hf_diloco.core.layout import shard

    monkeypatch.setattr(shard, "needs_staging", lambda part: True)
    monkeypatch.setattr(shard, "HostTransfers", _CopiesInFlight)
    monkeypatch.setattr(shard, "STAGING_WINDOW", window)


def test_staged_reads_wait_for_their_copies_and_give_the_bits_of_direct_reads(monkeypatch):
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(5000, generator=generator)
    parts = [values[:1700].to(torch.bfloat16), values[1700:4000], values[4000:].to(torch.float64) * (1 + 1e-9)]
    start = torch.randn(5000, generator=generator)
    direct = [concatenated(parts, subtracted_from=start), concatenated(parts)]
    _copies_in_flight(monkeypatch, window=600)  # several windows, parts sliced across them
    staged = [concatenated(parts, subtracted_from=start), concatenated(parts)]
    for ours, reference in zip(staged, direct):
        assert torch.equal(ours.view(torch.int32), reference.view(torch.int32))
    assert _CopiesInFlight.outstanding == 0


def _ordered_rounds(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case twice: read as it is on the CPU, then with every read going through copies that land only when
    waited for; each exchange records whether a copy was still in flight and whether its vector was finite."""
    from hf_diloco.core.exchange.exchange import OuterExchange

    results = []
    for staged in (False, True):
        with pytest.MonkeyPatch.context() as monkeypatch:
            handed: list[tuple[int, bool]] = []
            if staged:
                _copies_in_flight(monkeypatch, window=1000)
                launch = OuterExchange.launch

                def checked(self, vector, *args, handed=handed, launch=launch, **kwargs):
                    handed.append((_CopiesInFlight.outstanding, bool(torch.isfinite(vector).all())))
                    return launch(self, vector, *args, **kwargs)

                monkeypatch.setattr(OuterExchange, "launch", checked)
            for case in cases:
                case = dict(case)
                steps, dtype = case.pop("steps"), case.pop("dtype")
                model = tiny_model().to(dtype)
                optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
                engine = DiLoCo(model, optimizer, DiLoCoConfig(**case))
                for t in range(1, steps + 1):
                    inner_step(model, optimizer, rank, t)
                    engine.step()
                engine.close()
                results.append({"staged": staged, "global": engine.global_parameters(), "handed": list(handed)})
                handed.clear()
    return results


def test_no_vector_reaches_the_exchange_before_the_copies_that_made_it_have_landed():
    """Invariant 6 with asynchronous reads: on real gloo processes, the pseudo-gradients read through copies that land
    only at their wait are handed to the exchange complete (no copy in flight, no NaN of a buffer read too early),
    and θg is bitwise that of the direct reads."""
    cases = [
        dict(inner_steps=4, num_fragments=2, sync_delay=1, steps=9, dtype=torch.float32),
        dict(inner_steps=4, overlap="eager", steps=9, dtype=torch.bfloat16),
    ]
    for rank_results in run_on_processes(_ordered_rounds, 2, cases, timeout_seconds=300):
        direct, staged = rank_results[: len(cases)], rank_results[len(cases) :]
        for plain, ours in zip(direct, staged):
            assert ours["handed"] and all(in_flight == 0 and finite for in_flight, finite in ours["handed"])
            for name, value in plain["global"].items():
                assert torch.equal(ours["global"][name], value), name


@pytest.mark.parametrize("numel", [1, 7, 4099, 1_000_003])
@pytest.mark.parametrize(("lr", "momentum", "nesterov"), [(0.7, 0.9, True), (1.0, 0.9, False), (0.5, 0.0, False)])
def test_the_pieced_outer_step_is_torch_sgd_bit_for_bit(numel, lr, momentum, nesterov):
    generator = torch.Generator().manual_seed(numel)
    start = torch.randn(numel, generator=generator)
    gradients = [
        torch.randn(numel, generator=generator) * 10.0 ** torch.randint(-8, 3, (numel,), generator=generator)
        for _ in range(4)
    ]
    pieced, plain = start.clone(), start.clone()
    mine = torch.optim.SGD([pieced], lr=lr, momentum=momentum, nesterov=nesterov)
    reference = torch.optim.SGD([plain], lr=lr, momentum=momentum, nesterov=nesterov, foreach=False)
    assert _steps_in_pieces(mine, pieced, gradients[0])
    for gradient in gradients:
        optimizer_step(mine, pieced, gradient)
        plain.grad = gradient
        reference.step()
        assert torch.equal(pieced.view(torch.int32), plain.view(torch.int32))
    assert len(mine.state) == len(reference.state) == (1 if momentum else 0)
    if momentum:
        buffers = mine.state[pieced]["momentum_buffer"], reference.state[plain]["momentum_buffer"]
        assert torch.equal(buffers[0].view(torch.int32), buffers[1].view(torch.int32))


def test_other_optimizers_and_settings_step_as_themselves():
    tensor, gradient = torch.zeros(8), torch.ones(8)
    assert not _steps_in_pieces(torch.optim.SGD([tensor], lr=0.1, weight_decay=0.1), tensor, gradient)
    assert not _steps_in_pieces(torch.optim.Adam([tensor], lr=0.1), tensor, gradient)
    assert not _steps_in_pieces(torch.optim.SGD([tensor], lr=0.1), tensor, gradient.double())
    assert not _steps_in_pieces(torch.optim.SGD([tensor], lr=torch.tensor(0.1)), tensor, gradient)
    assert _steps_in_pieces(torch.optim.SGD([tensor], lr=1), tensor, gradient)
    optimizer = torch.optim.SGD([tensor], lr=0.1)
    optimizer.register_step_post_hook(lambda *args: None)
    assert not _steps_in_pieces(optimizer, tensor, gradient)
    optimizer_step(torch.optim.SGD([tensor], lr=0.5, weight_decay=0.5), tensor, gradient)
    assert torch.equal(tensor, torch.full((8,), -0.5))


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU lane)")


@pytest.mark.gpu
@requires_cuda
def test_gpu_reads_go_through_pinned_buffers_with_one_synchronisation(monkeypatch):
    """GPU lane. CUDA parts are copied asynchronously into pinned host buffers and waited for once per window, and the
    bits are those of a blocking copy of each part."""
    from hf_diloco.core.layout import shard

    waits = []
    wait = shard.HostTransfers.wait
    monkeypatch.setattr(shard.HostTransfers, "wait", lambda self: waits.append(1) or wait(self))
    generator = torch.Generator().manual_seed(2)
    values = torch.randn(300_000, generator=generator)
    host_parts = [values[:100_000].to(torch.bfloat16), values[100_000:]]
    parts = [part.cuda() for part in host_parts]
    start = torch.randn(300_000, generator=generator)
    ours = concatenated(parts, subtracted_from=start)
    assert torch.equal(ours, concatenated(host_parts, subtracted_from=start))
    assert torch.equal(concatenated(parts), concatenated(host_parts))
    assert len(waits) == 2  # one per read, not one per part
    pools = [pool for (dtype, pinned), pool in shard._staging_pools.items() if pinned]
    assert pools and all(buffer.is_pinned() for pool in pools for buffer in pool.tensors())


@pytest.mark.gpu
@requires_cuda
def test_gpu_writes_land_in_the_parameters_without_a_gpu_temporary():
    """GPU lane. Writing θg into bf16 CUDA parameters copies straight into them (no GPU temporary of a piece: the
    peak allocation does not rise by a piece's bytes) and the copies have landed when the write returns."""
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False)).cuda().to(torch.bfloat16)
    engine = DiLoCo(model, None, DiLoCoConfig(inner_steps=2))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    engine.load_global_weights()
    assert torch.cuda.current_stream().query()  # nothing of the write is still queued
    assert torch.cuda.max_memory_allocated() - before < 1 << 20  # the piece is 32 MiB in bf16
    assert torch.equal(model[0].weight.cpu(), engine.global_parameters()["0.weight"].to(torch.bfloat16))


@pytest.mark.parametrize(
    "case",
    [
        dict(inner_steps=4, sync_delay=1),  # streaming's τ: applied one step after the launch, not a launch step
        dict(inner_steps=4, num_fragments=2, sync_delay=1),
        dict(inner_steps=4, overlap="delayed"),
    ],
)
def test_the_outer_state_figure_is_current_after_every_step(case):
    """The engine counts `outer_state_bytes` only at a step where an exchange was launched or applied or a round
    ended; after every step it must equal a count made then (one worker: the exchange is local)."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    engine = DiLoCo(model, optimizer, DiLoCoConfig(**case))
    figures = []
    for t in range(1, 14):
        inner_step(model, optimizer, 0, t)
        engine.step()
        reported = engine.stats["outer_state_bytes"]
        engine._count_outer_state()  # counting now, whatever the step did
        figures.append(reported)
        assert reported == engine.stats["outer_state_bytes"], (t, figures)
    assert len(set(figures)) > 1  # the figure did move with the exchanges
    engine.close()


def test_the_outer_state_rises_at_the_first_round_as_its_documentation_says():
    """`diloco/outer_state_bytes` of plain DiLoCo steps up 4x between two logs: before the first round the engine
    holds theta_g alone, and the first round allocates the outer momentum and the two buffers the rounds reuse. The
    metric's documentation (the `EngineStats` docstring, and docs/design.md) says so with these figures."""
    from hf_diloco.core.rounds.stats import EngineStats

    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    engine = DiLoCo(model, optimizer, DiLoCoConfig(inner_steps=4))
    parameters = sum(p.numel() for p in model.parameters())
    figures = []
    for t in range(1, 10):
        inner_step(model, optimizer, 0, t)
        engine.step()
        figures.append(engine.stats["outer_state_bytes"] / parameters)
    engine.close()
    assert figures == [4.0] * 3 + [16.0] * 6
    said = "from 4 to 16 bytes per parameter at the first round"
    assert said in " ".join(EngineStats.__doc__.split())
    assert said in " ".join((Path(__file__).parents[1] / "docs" / "design.md").read_text().split())

"""The reused buffers of the pseudo-gradient and of the average: a buffer comes back only once nothing refers to it, in
the pool alone and in the engine on real gloo processes, whatever holds a round's sent vector or average (the exchange,
the delayed and eager modes, an observer, a checkpoint)."""

from __future__ import annotations

import pytest
import torch

from hf_diloco import DiLoCo, DiLoCoConfig
from hf_diloco.core.buffers import BufferPool
from hf_diloco.core.fragment import _steps_in_pieces, optimizer_step
from hf_diloco.core.shard import concatenated
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
    expected = start - torch.cat([part.to(torch.float32) for part in parts])
    out = torch.empty(3000)
    assert concatenated(parts, out, subtracted_from=start) is out
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(concatenated(parts), torch.cat([part.to(torch.float32) for part in parts]))
    with pytest.raises(ValueError, match="contiguous fp32 CPU vector of 3000 values"):
        concatenated(parts, torch.empty(2999))


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

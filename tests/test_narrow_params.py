"""Parameters narrower than fp32: the pseudo-gradient is measured from the rounded global copy θm started from."""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hf_diloco import DiLoCo, DiLoCoConfig
from hf_diloco.core.layout.shard import rounded_to_parts
from tests.engine_common import INNER_LR, inner_step, tiny_model


def _outer_gradients() -> tuple[list[torch.Tensor], object]:
    """Every pseudo-gradient the outer SGD steps on (its parameter's .grad, copied), and the hook's handle."""
    seen: list[torch.Tensor] = []

    def record(optimizer, args, kwargs) -> None:
        if isinstance(optimizer, torch.optim.SGD):
            seen.append(optimizer.param_groups[0]["params"][0].grad.detach().clone())

    return seen, register_optimizer_step_pre_hook(record)


def test_bf16_pseudo_gradient_is_measured_from_the_rounded_global_copy():
    model = tiny_model().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    engine = DiLoCo(model, optimizer, DiLoCoConfig(inner_steps=2))
    names = engine.fragment_names()[0]
    params = dict(model.named_parameters())
    deltas, handle = _outer_gradients()
    expected = []
    try:
        for t in range(1, 7):
            if t == 3:  # from round 2 on the inner steps do not move θm
                optimizer.param_groups[0]["lr"] = 0.0
            inner_step(model, optimizer, 0, t)
            if t % 2 == 0:
                glob = engine.global_parameters()
                # Independent reference: θg rounded to bf16 (what θm was written from), back in fp32, minus θm.
                start = torch.cat([glob[name].reshape(-1).to(torch.bfloat16).float() for name in names])
                moved = torch.cat([params[name].detach().reshape(-1).float() for name in names])
                expected.append(start - moved)
                fp32_start = torch.cat([glob[name].reshape(-1) for name in names])
                if t >= 4:  # θg has left the bf16 grid after an outer step: the old Δ held its rounding residue
                    assert not torch.equal(fp32_start - moved, torch.zeros_like(moved))
            engine.step()
    finally:
        handle.remove()
    engine.close()
    assert len(deltas) == 3
    for ours, reference in zip(deltas, expected):
        assert torch.equal(ours, reference)
    assert deltas[0].abs().sum() > 0
    assert torch.equal(deltas[1], torch.zeros_like(deltas[1])) and torch.equal(deltas[2], deltas[1])


def test_rounding_the_start_touches_only_narrower_parts():
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(300, generator=generator)
    parts = [torch.zeros(100, dtype=torch.bfloat16), torch.zeros(100), torch.zeros(100, dtype=torch.float16)]
    rounded = rounded_to_parts(start, parts)
    assert torch.equal(rounded[:100], start[:100].to(torch.bfloat16).float())
    assert torch.equal(rounded[100:200], start[100:200])
    assert torch.equal(rounded[200:], start[200:].to(torch.float16).float())
    assert not torch.equal(rounded, start)
    assert rounded_to_parts(start, [torch.zeros(300)]) is start  # fp32 parameters: the very vector, unchanged

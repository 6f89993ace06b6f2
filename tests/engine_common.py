"""Shared pieces of the engine tests: a tiny HF model, per-worker data, and an independent reference loop.

The reference simulates M workers in one process with plain torch and implements the update rules of docs/design.md
directly (its own fragment assignment, its own Nesterov arithmetic); it never calls hf_diloco.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ, BATCH, LAYERS = 64, 8, 2, 4
INNER_LR = 3e-3


# 1 bit per value with error feedback, on tiny blocks.
SIGN_EF = dict(compression="sign", compression_block_size=32, error_feedback=True)
TOPK_EF = dict(compression="topk", error_feedback=True, exchange_pattern="all_gather")
# Adaptive compression that may send a fragment whole (rank 0), with SIGN_EF as the floor.
ADAPTIVE_DENSE_SIGN = dict(SIGN_EF, lowrank_rank=4, adaptive_compression=True, adaptive_dense=True)


def tiny_llama(
    vocab: int, layers: int, max_positions: int, heads: int = 4, kv_heads: int = 2, seed: int = 0, **config_kwargs
) -> LlamaForCausalLM:
    """A randomly initialised Llama with hidden size 32 (the tiny model every distributed test trains); any other
    `LlamaConfig` setting, these defaults included, comes from `config_kwargs`."""
    torch.manual_seed(seed)
    values = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
    )
    values.update(config_kwargs)
    return LlamaForCausalLM(LlamaConfig(**values))


def tiny_model(seed: int = 0, layers: int = LAYERS) -> LlamaForCausalLM:
    return tiny_llama(VOCAB, layers, 64, heads=2, seed=seed, tie_word_embeddings=False)


def batch_for(worker: int, step: int, tokens: int = VOCAB) -> dict[str, torch.Tensor]:
    """Random ids below `tokens`: with fewer than VOCAB, every worker's data shares that structure."""
    generator = torch.Generator().manual_seed(1000 * worker + step)
    ids = torch.randint(0, tokens, (BATCH, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids}


def inner_step(model, optimizer, worker: int, step: int, tokens: int = VOCAB) -> float:
    loss = model(**batch_for(worker, step, tokens)).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def train_engine(worker: int, config: dict, steps: int):
    """A tiny model, AdamW and a DiLoCo engine (config: DiLoCoConfig fields) after `steps` inner steps (not closed)."""
    from hf_diloco import DiLoCo, DiLoCoConfig

    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    engine = DiLoCo(model, optimizer, DiLoCoConfig(**config))
    for t in range(1, steps + 1):
        inner_step(model, optimizer, worker, t)
        engine.step()
    return model, optimizer, engine


def cpu_trainer_args(output_dir, **overrides) -> dict:
    """The TrainingArguments every trainer test shares (CPU, log every step, no saving, no reporting, seed 0)."""
    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    values.update(overrides)
    return values


Unit = tuple[str, int, int]  # (parameter name, first row, end row): what the reference syncs as one piece


def reference_units(shapes: dict[str, tuple], num_fragments: int, pattern: str, layers: int = LAYERS) -> dict:
    """Unit -> fragment, written from docs/design.md (`balanced` included), independently of hf_diloco."""
    units: dict[Unit, int] = {}
    fill = [0] * num_fragments
    blocks: dict[int, list[str]] = {}
    for name, shape in shapes.items():
        match = re.search(r"layers\.(\d+)\.", name)
        rows = shape[0] if shape else 1
        if match:
            blocks.setdefault(int(match.group(1)), []).append(name)
        elif pattern == "balanced" and len(shape) >= 2 and rows >= num_fragments:
            for k in range(num_fragments):  # a matrix outside the layers: P row pieces, piece k in fragment k
                first, end = k * rows // num_fragments, (k + 1) * rows // num_fragments
                units[(name, first, end)] = k
                fill[k] += (end - first) * torch.Size(shape[1:]).numel()
        else:
            units[(name, 0, rows)] = 0
            fill[0] += torch.Size(shape).numel()
    for block in sorted(blocks):
        if pattern == "balanced":  # to the smallest fragment so far, the first of equals
            owner = fill.index(min(fill))
            fill[owner] += sum(torch.Size(shapes[n]).numel() for n in blocks[block])
        else:
            owner = block % num_fragments if pattern == "strided" else block * num_fragments // layers
        for name in blocks[block]:
            units[(name, 0, shapes[name][0] if shapes[name] else 1)] = owner
    return units


def reference_run(
    workers: int,
    steps: int,
    inner_steps: int,
    num_fragments: int = 1,
    pattern: str = "strided",
    sync_delay: int = 0,
    alpha: float = 0.5,
    outer_lr: float = 0.7,
    momentum: float = 0.9,
    overlap: str = "streaming",
    eager_estimate: str = "own_share",
    tokens: int = VOCAB,
    lossy: Callable[[torch.Tensor], torch.Tensor] | None = None,
    outer_lr_factor: Callable[[int], float] | None = None,
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Plain-torch simulation of M workers; returns (local params per worker, global params).

    `lossy`: an elementwise codec's round trip (e.g. to bf16 and back) with error feedback: every worker sends
    lossy(Δm + its residual) and keeps what that dropped; the mean of what was sent is sent through `lossy` again.
    Only for rounds (no tail at the end: a run of whole rounds).
    `outer_lr_factor`: the outer learning rate of a fragment's k-th outer step (k from 0) is outer_lr x factor(k).
    """
    models = [tiny_model() for _ in range(workers)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=INNER_LR) for m in models]
    params = [dict(m.named_parameters()) for m in models]
    frag = reference_units({n: tuple(p.shape) for n, p in params[0].items()}, num_fragments, pattern)
    names = list(frag)  # units, each synced as one tensor
    glob = {u: rows_of(params[0], u).detach().clone().float() for u in names}
    buf: dict[Unit, torch.Tensor] = {}
    in_flight: dict[int, tuple[int, dict[Unit, torch.Tensor]]] = {}  # fragment -> (apply step, mean delta)
    own_sent: dict[int, list[dict[Unit, torch.Tensor]]] = {}
    anchor = [{n: glob[n].clone() for n in names} for _ in range(workers)]

    eager_buf: list[dict[Unit, torch.Tensor]] = [{} for _ in range(workers)]  # each worker's own outer momentum
    residual: list[dict[Unit, torch.Tensor]] = [{} for _ in range(workers)]  # with `lossy`: what was not sent yet
    own_weight: dict[int, list[dict[Unit, float]]] = {}  # fitted eager: per worker and unit, the w of the last launch

    def fitted_weight(own: torch.Tensor, mean: torch.Tensor) -> float:
        """Least squares: the multiple of `own` closest to `mean`, kept within [1/M, 1]."""
        energy = float((own * own).sum())
        return min(1.0, max(1.0 / workers, float((own * mean).sum()) / energy if energy > 0 else 0.0))

    steps_taken: dict[tuple[int, int], int] = {}  # (which outer optimizer, fragment) -> outer steps so far

    def outer_update(
        values: dict[str, torch.Tensor], mean_delta: dict[str, torch.Tensor], momentum_of=buf, fragment: int = 0
    ) -> None:
        key = (id(momentum_of), fragment)
        lr = outer_lr * (outer_lr_factor(steps_taken.get(key, 0)) if outer_lr_factor else 1.0)
        steps_taken[key] = steps_taken.get(key, 0) + 1
        for n, g in mean_delta.items():
            b = momentum_of.get(n)
            b = g.clone() if b is None else momentum * b + g
            momentum_of[n] = b
            step_dir = g + momentum * b if momentum > 0 else g
            values[n] = values[n] - lr * step_dir

    def set_local(worker: int, n: Unit, value: torch.Tensor) -> None:
        with torch.no_grad():
            rows_of(params[worker], n).copy_(value)

    def apply_streaming(fragment: int, tau: int) -> None:
        _, mean_delta = in_flight.pop(fragment)
        outer_update(glob, mean_delta, fragment=fragment)
        for w in range(workers):
            for n in mean_delta:
                local = rows_of(params[w], n).detach()
                set_local(w, n, glob[n] if tau == 0 else alpha * local + (1 - alpha) * glob[n])

    for t in range(1, steps + 1):
        for w in range(workers):
            inner_step(models[w], optimizers[w], w, t, tokens)
        for fragment in [p for p, (at, _) in in_flight.items() if at == t and overlap == "streaming"]:
            apply_streaming(fragment, sync_delay)
        for p in range(num_fragments):
            if t % inner_steps != ((p + 1) * inner_steps // num_fragments) % inner_steps:
                continue
            frag_names = [n for n in names if frag[n] == p]
            base = anchor if overlap == "eager" else [glob] * workers
            sent = [{n: base[w][n] - rows_of(params[w], n).detach() for n in frag_names} for w in range(workers)]
            mean = {n: sum(s[n] for s in sent) / workers for n in frag_names}
            if lossy is not None:
                for w in range(workers):
                    for n in frag_names:
                        sent[w][n] = sent[w][n] + residual[w].get(n, 0)
                        residual[w][n] = sent[w][n] - lossy(sent[w][n])
                mean = {n: lossy(sum(lossy(s[n]) for s in sent) / workers) for n in frag_names}
            if overlap == "streaming":
                in_flight[p] = (t + sync_delay, mean)
                if sync_delay == 0:
                    apply_streaming(p, 0)
                continue
            previous = in_flight.pop(p, None)
            in_flight[p] = (t + inner_steps, mean)
            if previous is not None:
                outer_update(glob, previous[1], fragment=p)
            for w in range(workers):
                if overlap == "delayed":
                    for n in frag_names:
                        set_local(w, n, glob[n])
                    continue
                # Kale et al.: own contribution fresh, the others' one round stale, fed to this worker's own
                # outer optimizer; its trajectory starts from the global model and its momentum.
                if previous is None:
                    estimate = {n: sent[w][n] / workers for n in frag_names}
                    own_weight.setdefault(p, [{} for _ in range(workers)])[w] = {n: 1.0 / workers for n in frag_names}
                    for n in frag_names:
                        anchor[w][n] = glob[n].clone()
                        if n in buf:
                            eager_buf[w][n] = buf[n].clone()
                elif eager_estimate == "fitted":
                    # w·Δm^r stands in for round r; what avg^{r-1} adds to last round's w·Δm^{r-1} comes now.
                    weight = {n: fitted_weight(own_sent[p][w][n], previous[1][n]) for n in frag_names}
                    applied = own_weight[p][w]
                    estimate = {
                        n: previous[1][n] - applied[n] * own_sent[p][w][n] + weight[n] * sent[w][n] for n in frag_names
                    }
                    own_weight[p][w] = weight
                else:
                    others = {n: previous[1][n] - own_sent[p][w][n] / workers for n in frag_names}
                    estimate = {n: sent[w][n] / workers + others[n] for n in frag_names}
                outer_update(anchor[w], estimate, eager_buf[w], fragment=p)
                for n in frag_names:
                    set_local(w, n, anchor[w][n])
            own_sent[p] = sent

    def has_tail(p: int) -> bool:  # inner steps since fragment p's last launch (or since the start)
        launch_step = ((p + 1) * inner_steps // num_fragments) % inner_steps
        last_launch = max((t for t in range(1, steps + 1) if t % inner_steps == launch_step), default=0)
        return steps > last_launch

    def tail_deltas(base: list[dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
        out = {}
        for p in filter(has_tail, range(num_fragments)):
            frag_names = [n for n in names if frag[n] == p]
            out[p] = {
                n: sum(base[w][n] - rows_of(params[w], n).detach() for w in range(workers)) / workers
                for n in frag_names
            }
        return out

    tails = {} if overlap == "streaming" else tail_deltas(anchor if overlap == "eager" else [glob] * workers)
    for fragment in sorted(in_flight, key=lambda p: in_flight[p][0]):
        if overlap == "streaming":
            apply_streaming(fragment, 0)
        else:
            _, mean = in_flight.pop(fragment)
            outer_update(glob, mean, fragment=fragment)
            for w in range(workers):
                for n in mean:
                    set_local(w, n, glob[n])
    if overlap == "streaming":
        tails = tail_deltas([glob] * workers)
    for mean in tails.values():  # the final sync: plain average of the tail, no outer optimizer
        for n, d in mean.items():
            glob[n] = glob[n] - d
            for w in range(workers):
                set_local(w, n, glob[n])
    pieces = {name: [glob[u] for u in sorted(names) if u[0] == name] for name in params[0]}
    whole = {name: parts[0] if len(parts) == 1 else torch.cat(parts) for name, parts in pieces.items()}
    return [{n: p.detach().clone() for n, p in ps.items()} for ps in params], whole


def rows_of(tensors: dict[str, torch.Tensor], unit: Unit) -> torch.Tensor:
    tensor = tensors[unit[0]]
    return tensor if tensor.dim() == 0 else tensor[unit[1] : unit[2]]


def assert_resumed_bitwise(full: dict, resumed: dict, checkpoint_step: int, steps: int) -> None:
    """A trainer run resumed at `checkpoint_step` ends where the uninterrupted one did, bitwise: θg (`global`), the
    model (`model`) and the losses (`losses`, step -> loss) of the steps it ran itself."""
    for name, value in full["global"].items():
        assert torch.equal(resumed["global"][name], value), name
    for name, value in full["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    # The resumed history starts with the checkpoint's (rank 0's steps); the steps it ran itself must match.
    ran = {step: loss for step, loss in resumed["losses"].items() if step > checkpoint_step}
    assert ran == {step: loss for step, loss in full["losses"].items() if step > checkpoint_step}
    assert len(ran) == steps - checkpoint_step


PACED_STEP_SECONDS = 0.04


def pace(began: float, slowed: bool) -> float:
    """Sleep until the step that began at `began` (a `time.perf_counter()`) has lasted PACED_STEP_SECONDS, twice that
    when `slowed`: steps of a fixed length whatever the machine's load (the tiny model's step is far shorter), so a
    slowed worker runs at exactly half speed. Returns the time it ends (the next step's beginning)."""
    import time

    target = PACED_STEP_SECONDS * (2 if slowed else 1)
    time.sleep(max(0.0, target - (time.perf_counter() - began)))
    return time.perf_counter()

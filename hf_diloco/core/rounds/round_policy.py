"""When a worker's round ends: after H inner steps (`round_policy: steps`), or after as many as its speed allows so that
every worker reaches the exchange together (`round_policy: balanced`).

`balanced` is DyLU (Asynchronous Local-SGD, Liu et al. 2024, arXiv 2401.09135): worker w runs
h_w = round(v_w / v_max x H) inner steps per round, v_w its measured speed (steps per second), so the fastest worker
keeps H and a worker at half speed runs H/2. Each round every rank times its inner steps (the time between two
`engine.step()` calls: the forward, backward and optimizer step, not the engine); at the round's end the ranks
all-gather the median (one tensor of world-size floats on the gloo control group, once per round, never per step),
take per worker the slowest of its ranks, and every rank computes the next round's plan from the same floats, so the
plan is the same everywhere. The first round, before anything is measured, is H steps everywhere.

The average of a round is weighted by the inner steps each worker trained in it: each worker sends
(M w_m / Σ w) Δm, so the exchange's mean is Σ w_m Δm / Σ w. Every worker trains the same tokens per step (the batch
settings are part of what the workers agree on at start-up), so steps are tokens. The weights of a launch follow from
the plans, which every worker holds, so they cost no collective; `close()` gathers each worker's tail once.

Under elastic membership (`elastic.py`) the workers of an exchange are whoever is present, so nothing can be
computed from plans: each worker knows its own plan only, and the exchange weighs (`exchange.OuterGroup.weight`):
one all-gather of (contributes, steps since the fragment's last launch, median step time) per member replaces the
contributor count, each worker scales its Δ by C w_m / Σ w, and the round's last exchange tells every member the
fastest member's step time, from which each plans its own next round. A worker that joins runs H steps in its first
round (nothing of it is measured yet) and is planned from then on; at `close()` every worker syncs the same
fragments (`tail_scales`), weighing its own tail (0 where it has none).

Fragment p of P launches at local step (p + 1) h_w // P of a round (the order and spacing of Streaming DiLoCo as
fractions of each worker's round); with τ > 0, h_w >= P (τ + 1) keeps a fragment's exchange applied before the next
one launches. The time inside `engine.step()` (exchanges, waiting for peers, the outer step) over a round's wall
time is `diloco/wait_fraction`, under both policies.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from ..layout.fragments import fragments_launched_at, steps_since_launch
from ..layout.topology import Topology, gather_rows
from ..settings.config import DiLoCoConfig


class RoundClock:
    """Times each inner step outside the engine (compute) and inside it (exchanges, waiting, outer steps).

    `seconds` is an exponential average of the compute time of one step (what the adaptive compression policy reads);
    `wait_fraction` is the engine's share of the last completed round's wall time.
    """

    def __init__(self) -> None:
        self.seconds: float | None = None
        self.wait_fraction: float | None = None
        self.compute_samples: list[float] = []
        self.engine_seconds = 0.0
        self._began: float | None = None
        self._ended: float | None = None

    def step_begins(self) -> None:
        now = time.perf_counter()
        if self._ended is not None:
            elapsed = now - self._ended
            self.seconds = elapsed if self.seconds is None else 0.9 * self.seconds + 0.1 * elapsed
            self.compute_samples.append(elapsed)
        self._began = now

    def step_ends(self, round_ended: bool) -> None:
        now = time.perf_counter()
        if self._began is not None:
            self.engine_seconds += now - self._began
        self._ended = now
        if round_ended:
            wall = self.engine_seconds + sum(self.compute_samples)
            self.wait_fraction = self.engine_seconds / wall if wall > 0 else 0.0
            self.compute_samples, self.engine_seconds = [], 0.0

    def median_step_seconds(self) -> float:
        """The median compute time of this round's steps so far (0.0 before any): an evaluation or a save between two
        steps does not make a worker look slow."""
        return statistics.median(self.compute_samples) if self.compute_samples else 0.0


class _RoundPolicy:
    """What both policies share: ending a round when it is due, weighing a launch, the `diloco/*` scalars."""

    balanced = False

    def end_round_if_due(self, step: int, clock: RoundClock) -> bool:
        if not self.round_ends(step):
            return False
        self.end_round(step, clock)
        return True

    def weigh(self, delta: torch.Tensor, fragment: int) -> float:
        """Multiply `delta` in place by `launch_scale(fragment)`; returns the scale."""
        scale = self.launch_scale(fragment)
        if scale != 1.0:
            delta.mul_(scale)
        return scale

    def metrics(self, step: int, clock: RoundClock) -> dict[str, float]:
        logs = {"diloco/outer_rounds": float(self.outer_rounds(step))}
        if clock.wait_fraction is not None:
            logs["diloco/wait_fraction"] = clock.wait_fraction
        return logs


class StepRounds(_RoundPolicy):
    """`round_policy: steps`: every worker runs H inner steps per round; fragment p launches after step t when
    t % H == ((p + 1) H / P) % H (`fragments.py`)."""

    def __init__(self, inner_steps: int, num_fragments: int):
        self.inner_steps, self.num_fragments = inner_steps, num_fragments

    def launches(self, step: int) -> list[int]:
        return fragments_launched_at(step, self.inner_steps, self.num_fragments)

    def round_ends(self, step: int) -> bool:
        return step % self.inner_steps == 0

    def end_round(self, step: int, clock: RoundClock) -> None:
        pass

    def outer_rounds(self, step: int) -> int:
        return step // self.inner_steps

    def schedule_position(self, step: int) -> tuple[int, str]:
        """Where every worker launches the same exchange: after the same inner step."""
        return step, "inner step"

    def global_step(self, step: int) -> int:
        return step

    def steps_since_launch(self, fragment: int, step: int) -> int:
        return steps_since_launch(fragment, step, self.inner_steps, self.num_fragments)

    def launch_scale(self, fragment: int) -> float:
        return 1.0

    def tail_scales(self, step: int) -> list[float | None]:
        """`close()`: per fragment, None where it has no tail (every worker has the same steps), else 1.0."""
        return [1.0 if self.steps_since_launch(p, step) > 0 else None for p in range(self.num_fragments)]

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass


def launch_step(fragment: int, round_steps: int, num_fragments: int) -> int:
    """The local step of a round of `round_steps` steps after which fragment p launches: (p + 1) h // P."""
    return (fragment + 1) * round_steps // num_fragments


def plan_round_steps(step_seconds: Sequence[float], inner_steps: int, fewest: int) -> list[int] | None:
    """DyLU: h_w = round(v_w / v_max x H) with v = 1 / step seconds, kept in [fewest, H]; None when a worker has no
    measurement yet (the plan then stays as it is)."""
    if not step_seconds or min(step_seconds) <= 0:
        return None
    fastest = min(step_seconds)
    return [min(inner_steps, max(fewest, round(fastest / seconds * inner_steps))) for seconds in step_seconds]


class BalancedRounds(_RoundPolicy):
    """`round_policy: balanced` (see the module docstring).

    Args:
        inner_steps: H, the fastest worker's round.
        num_fragments: P.
        sync_delay: τ (with τ > 0 a round has at least P (τ + 1) steps).
        topology: this rank's groups (the plan is agreed on its control group).
        weighs_in_exchange: elastic membership: the exchange weighs the average and reports the fastest member's step
            time (`observe_fastest`); this worker plans only its own rounds.
    """

    balanced = True

    def __init__(
        self,
        inner_steps: int,
        num_fragments: int,
        sync_delay: int,
        topology: Topology,
        weighs_in_exchange: bool = False,
    ):
        self.inner_steps, self.num_fragments = inner_steps, num_fragments
        self.weighs_in_exchange = weighs_in_exchange
        self.fastest_seconds = 0.0  # elastic: the fastest member's step time at the last exchange (0: unknown)
        self.launch_weights = [0] * num_fragments  # the steps each fragment's latest launch covered
        self.fewest = num_fragments * (sync_delay + 1)
        self.topology = topology
        workers = topology.num_workers
        self.plan = [inner_steps] * workers  # this round's steps per worker
        self.previous_plan: list[int] | None = None
        self.round_start = 0  # the inner step after which this round began
        self.rounds = 0
        self.last_launch = [0] * num_fragments  # the inner step of each fragment's last launch
        self.completed_steps: int | None = None  # this worker's steps in the last completed round
        self.steps_done = [0] * workers  # every worker's inner steps at the end of the last completed round

    @property
    def round_steps(self) -> int:
        return self.plan[self.topology.worker_index]

    def launches(self, step: int) -> list[int]:
        """The fragments due after `step` (recorded as launched there: the tail and the weights count from it)."""
        local = step - self.round_start
        due = [p for p in range(self.num_fragments) if launch_step(p, self.round_steps, self.num_fragments) == local]
        for fragment in due:
            self.launch_weights[fragment] = step - self.last_launch[fragment]
            self.last_launch[fragment] = step
        return due

    def round_ends(self, step: int) -> bool:
        return step - self.round_start == self.round_steps

    def end_round(self, step: int, clock: RoundClock) -> None:
        """Agree on the next round's plan from every rank's median step time, and start the next round."""
        plan = self._next_plan(clock.median_step_seconds())
        self.completed_steps = self.round_steps
        self.steps_done = [done + steps for done, steps in zip(self.steps_done, self.plan)]
        self.previous_plan = self.plan
        if plan is not None:
            self.plan = plan
        self.round_start = step
        self.rounds += 1

    def outer_rounds(self, step: int) -> int:
        return self.rounds

    def schedule_position(self, step: int) -> tuple[int, str]:
        """Where every worker launches the same exchange: in the same outer round (after different step counts)."""
        return self.rounds, "outer round"

    def global_step(self, step: int) -> int:
        """rounds x H + (local step) x H // h: the fastest worker's steps, H x rounds at every round's end."""
        return self.rounds * self.inner_steps + (step - self.round_start) * self.inner_steps // self.round_steps

    def steps_since_launch(self, fragment: int, step: int) -> int:
        return step - self.last_launch[fragment]

    def launch_scale(self, fragment: int) -> float:
        """M w_m / Σ w for this worker's launch of `fragment` in the current round, w the steps each worker trained
        since the fragment's last launch (from the plans every worker holds); 1.0 where the exchange weighs."""
        if self.weighs_in_exchange:
            return 1.0
        steps = [self._steps_covered(worker, fragment) for worker in range(len(self.plan))]
        return len(steps) * steps[self.topology.worker_index] / sum(steps)

    def tail_scales(self, step: int) -> list[float | None]:
        """`close()`: M w_m / Σ w per fragment from every worker's steps since the fragment's last launch (one small
        all-gather of P numbers per rank; None where no worker trained it since: no worker syncs it).

        Where the exchange weighs (elastic) nobody knows the others' tails, so the rule must give every worker the
        same fragments without asking: at a round's end (where a loop ending at `outer_rounds` stops, on every
        worker at once) every fragment but the last, whose launch ended the round, so no worker has a tail of it;
        elsewhere every fragment, each worker weighing its own tail (0 where it has none); at step 0, none."""
        if self.weighs_in_exchange:
            if step == 0:
                return [None] * self.num_fragments
            at_round_end = step == self.round_start
            return [None if at_round_end and p == self.num_fragments - 1 else 1.0 for p in range(self.num_fragments)]
        tails = [self.steps_since_launch(p, step) for p in range(self.num_fragments)]
        mine = torch.tensor(tails, dtype=torch.float64)
        everyone = gather_rows(mine, self.topology.control_group)
        per_worker = self._per_worker(everyone)
        total = per_worker.sum(dim=0)
        index = self.topology.worker_index
        workers = per_worker.shape[0]
        return [float(workers * per_worker[index, p] / total[p]) if total[p] > 0 else None for p in range(len(tails))]

    def observe_fastest(self, seconds: float | None) -> None:
        """Elastic: an exchange's fastest member's step time (the round's last one plans the next round)."""
        if seconds:
            self.fastest_seconds = seconds

    def joined(self, step: int, fragment: int | None, rounds: int) -> None:
        """Elastic: this worker took a live peer's state at inner step `step`, in the exchange of `fragment` (None:
        between exchanges) of the job's round `rounds` (the peer's completed rounds). Its own round restarts at H
        steps, placed so that it is at that fragment's launch; the last fragment's launch ends the round, so this
        worker starts the next one there. The others' plans, which it does not know, are not its concern."""
        self.plan, self.previous_plan, self.completed_steps = [self.inner_steps], None, None
        at = 0 if fragment is None else launch_step(fragment, self.inner_steps, self.num_fragments)
        if at == self.inner_steps:
            at, rounds = 0, rounds + 1
        self.round_start, self.rounds = step - at, rounds
        self.last_launch = [step] * self.num_fragments  # it trained nothing of its own before the join
        self.fastest_seconds = 0.0

    def metrics(self, step: int, clock: RoundClock) -> dict[str, float]:
        """Also `round_steps`: this worker's steps in the last completed round (the current round's before any)."""
        steps = self.round_steps if self.completed_steps is None else self.completed_steps
        return {**super().metrics(step, clock), "diloco/round_steps": float(steps)}

    def state_dict(self) -> dict:
        return {
            "plan": list(self.plan),
            "previous_plan": None if self.previous_plan is None else list(self.previous_plan),
            "round_start": self.round_start,
            "rounds": self.rounds,
            "last_launch": list(self.last_launch),
            "completed_steps": self.completed_steps,
            "steps_done": list(self.steps_done),
        }

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            raise ValueError(
                "This DiLoCo checkpoint was written with round_policy 'steps' and holds no balanced-round plan: resume "
                "it with round_policy: steps."
            )
        self.plan = [int(steps) for steps in state["plan"]]
        previous = state["previous_plan"]
        self.previous_plan = None if previous is None else [int(steps) for steps in previous]
        self.round_start, self.rounds = int(state["round_start"]), int(state["rounds"])
        self.last_launch = [int(step) for step in state["last_launch"]]
        self.completed_steps = state["completed_steps"]
        self.steps_done = [int(steps) for steps in state["steps_done"]]

    # ------------------------------------------------------------------------------------------- internals

    def _steps_covered(self, worker: int, fragment: int) -> int:
        """Steps `worker` trained since its launch of `fragment` in the previous round (all of them in the first)."""
        now = launch_step(fragment, self.plan[worker], self.num_fragments)
        if self.previous_plan is None:
            return now
        before = self.previous_plan[worker]
        return before - launch_step(fragment, before, self.num_fragments) + now

    def _next_plan(self, mine: float) -> list[int] | None:
        if self.weighs_in_exchange:  # this worker's own steps, against the fastest member of the round's last exchange
            planned = plan_round_steps([self.fastest_seconds, mine], self.inner_steps, self.fewest)
            return None if planned is None else [planned[1]]
        return plan_round_steps(self._gather_step_seconds(mine), self.inner_steps, self.fewest)

    def _gather_step_seconds(self, mine: float) -> list[float]:
        everyone = gather_rows(torch.tensor([mine], dtype=torch.float64), self.topology.control_group)
        return [float(value) for value in self._per_worker(everyone)[:, 0]]

    def _per_worker(self, by_rank: torch.Tensor) -> torch.Tensor:
        """Rows by rank (the control group's order, every rank of the job) -> rows by worker, combining a worker's
        ranks (the slowest rank sets a worker's speed)."""
        layout = self.topology.layout
        if by_rank.shape[0] == 1:
            return by_rank
        rows = [by_rank[layout.worker_ranks(worker)].max(dim=0).values for worker in range(layout.num_workers)]
        return torch.stack(rows)


RoundPolicy = StepRounds | BalancedRounds  # what `make_round_policy` returns


def make_round_policy(config: DiLoCoConfig, topology: Topology, elastic: bool = False) -> RoundPolicy:
    """The config's `round_policy` over these workers (`elastic`: the steps travel in the exchange)."""
    if config.round_policy == "balanced":
        return BalancedRounds(
            config.inner_steps, config.num_fragments, config.sync_delay, topology, weighs_in_exchange=elastic
        )
    return StepRounds(config.inner_steps, config.num_fragments)

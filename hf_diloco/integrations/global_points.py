"""Global points: the moments every rank must reach together, bounded in time, naming who is missing.

The Trainer glue meets all ranks at a few points (the start of training, each checkpoint save, the end). There a
stalled, stopped or crashed peer, or one running with other settings, would otherwise leave the others waiting for
the default group's timeout (30 minutes) and then fail with gloo's bare "Timed out waiting". Here every such point
is a `torch.distributed.monitored_barrier` on a gloo group of all ranks with the user's bound: global rank 0 names
the ranks that did not arrive, the others say that rank 0 did not confirm.

`check_ranks_agree` exchanges the settings that must be equal on every rank once at start (JSON, never pickles) and
names the settings and the ranks that differ.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ..core.membership.agreement import gather_values

__all__ = [
    "PeerTimeoutError",
    "SettingsMismatchError",
    "check_ranks_agree",
    "fingerprint",
    "global_point_group",
    "wait_for_all_ranks",
]

# A value longer than this (as JSON) is exchanged as its fingerprint only.
_LONGEST_EXCHANGED_VALUE = 4096
_SHOWN_CHARACTERS = 80
_MISSING_RANKS_RE = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


class PeerTimeoutError(RuntimeError):
    """A rank did not reach a global point within the bound."""


class SettingsMismatchError(ValueError):
    """Settings that every rank must share differ between ranks."""


def global_point_group(timeout_seconds: float) -> dist.ProcessGroup | None:
    """A gloo group of all ranks for the global points (every rank must call this, in the same order); `None` when
    the job is not distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds))


def wait_for_all_ranks(
    group: dist.ProcessGroup | None, point: str, timeout_seconds: float, bound: str = "sync_timeout_seconds"
) -> None:
    """
    Return once every rank of `group` has reached `point`; raise `PeerTimeoutError` after `timeout_seconds` otherwise.

    Args:
        group (`ProcessGroup` or `None`): a gloo group of all ranks (`global_point_group`); `None` returns at once.
        point (`str`): what the ranks meet for, for the message (e.g. "saving checkpoint-8").
        timeout_seconds (`float`): the bound.
        bound (`str`, *optional*): the name of the setting the bound comes from, for the message.

    Raises:
        `PeerTimeoutError`: on global rank 0 naming the ranks that did not arrive; on the others saying rank 0 did
            not confirm (its own error names the missing ranks).
    """
    if group is None:
        return
    try:
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=timeout_seconds), wait_all_ranks=True)
    except RuntimeError as error:
        raise PeerTimeoutError(_describe_timeout(group, point, timeout_seconds, bound, str(error))) from error


def check_ranks_agree(
    settings: Mapping[str, Any],
    group: dist.ProcessGroup | None,
    timeout_seconds: float,
    point: str = "the start of training",
    bound: str = "sync_timeout_seconds",
) -> None:
    """
    Check at `point` that every rank of `group` holds the same `settings`, with one all-gather.

    Args:
        settings (`Mapping[str, Any]`): name -> a JSON-serialisable value (anything else is compared as `str`). A
            large value (a tokenizer, a dataset) is best given as its `fingerprint`.
        group (`ProcessGroup` or `None`): a gloo group of all ranks; `None` returns at once.
        timeout_seconds (`float`): the bound for the exchange (see `wait_for_all_ranks`).
        point (`str`, *optional*): where the check runs, for the message.
        bound (`str`, *optional*): the name of the setting the bound comes from, for the message.

    Raises:
        `SettingsMismatchError`: on every rank, naming each setting that differs and the ranks that disagree with
            rank 0 (with their values, or the keys that differ inside a mapping).
        `PeerTimeoutError`: when a rank does not arrive within the bound.
    """
    if group is None:
        return
    mine = {name: _exchanged_value(value) for name, value in settings.items()}
    wait_for_all_ranks(group, point, timeout_seconds, bound)
    try:
        everyone = gather_values(mine, group)
    except RuntimeError as error:
        raise PeerTimeoutError(
            f"Exchanging the settings that must agree at {point} failed ({error}); a peer stopped or crashed "
            "after arriving there: check the other ranks' logs."
        ) from error
    names = sorted(set().union(*everyone))
    differences = [
        _describe_difference(name, [values.get(name, "<not set>") for values in everyone]) for name in names
    ]
    differences = [text for text in differences if text]
    if differences:
        listed = "\n".join(f"  - {text}" for text in differences)
        raise SettingsMismatchError(
            f"Settings that every rank must share differ between ranks (checked at {point}, before any work):\n"
            f"{listed}\nEvery node must run the same config, command line and DILOCO_* variables (and the same "
            "model, tokenizer and data); fix the odd ranks and relaunch."
        )


def fingerprint(value: Any) -> str:
    """A short stable hash of a JSON-serialisable value (anything else hashed by `str`)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _exchanged_value(value: Any) -> Any:
    canonical = json.loads(json.dumps(value, sort_keys=True, default=str))
    if len(json.dumps(canonical)) > _LONGEST_EXCHANGED_VALUE:
        return f"sha256:{fingerprint(canonical)}"
    return canonical


def _describe_difference(name: str, values: list[Any]) -> str | None:
    odd = [rank for rank, value in enumerate(values) if value != values[0]]
    if not odd:
        return None
    first_odd = values[odd[0]]
    if isinstance(values[0], dict) and isinstance(first_odd, dict):
        keys = sorted(k for k in set(values[0]) | set(first_odd) if values[0].get(k) != first_odd.get(k))
        shown = "; ".join(
            f"{k}: rank 0 {_show(values[0].get(k, '<not set>'))}, rank {odd[0]} {_show(first_odd.get(k, '<not set>'))}"
            for k in keys[:5]
        )
        more = f" (and {len(keys) - 5} more)" if len(keys) > 5 else ""
        return f"{name}: ranks {odd} differ from rank 0 in {shown}{more}"
    by_value: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(_show(value), []).append(rank)
    shown = "; ".join(f"{_ranks(ranks)}: {value}" for value, ranks in by_value.items())
    return f"{name}: ranks {odd} disagree with rank 0 ({shown})"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= _SHOWN_CHARACTERS else f"{text[: _SHOWN_CHARACTERS - 3]}..."


def _describe_timeout(group: dist.ProcessGroup, point: str, timeout_seconds: float, bound: str, raw: str) -> str:
    rank = dist.get_rank(group)
    within = f"within {bound}={timeout_seconds:g} s"
    advice = (
        "A rank that stalls (a stopped process, a hung disk), crashed, or runs with other settings (another "
        f"max_steps or save/eval schedule) never gets there. Check that rank's log; raise {bound} if it is only slow."
    )
    match = _MISSING_RANKS_RE.search(raw)
    if rank == 0 and match:
        missing = [int(r) for r in match.group(1).replace(" ", "").split(",") if r]
        return f"Rank(s) {missing} did not reach {point} {within}; rank 0 stops here. {advice}"
    if rank == 0:
        return f"Waiting for all ranks at {point} failed on rank 0 ({raw.strip()}). {advice}"
    return (
        f"Rank {rank} reached {point}, but rank 0 did not confirm that every rank arrived {within}: rank 0, or a rank "
        f"it waits for, is missing (rank 0's error names it). {advice} Gloo said: {raw.strip().splitlines()[0]}"
    )

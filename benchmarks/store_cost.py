"""What a store job costs at scale, on paper: M sites of a 7B model through one bucket, per site and round.

    python -m benchmarks.store_cost                          # 8 sites, Llama 2 7B, sign_link and slow_link
    python -m benchmarks.store_cost --ranks 8 --out /tmp/c   # sites of 8 ranks; OUT.json and OUT.md

For each shipped config (its codec, block size, scale dtype and H, read from `configs/NAME.yaml`, and the store's
settings at their defaults, which those configs leave unset) it prints, with the formula next to every number:

- **bytes per round per site**: the payload a site writes (E, its ranks' shares of the fragment, each padded to whole
  codec blocks and sized by the codec's own `encoded_nbytes`: exact, and nothing of 7B allocated) and reads
  ((M - 1) x E: each rank its own share of every other site's contribution), and the objects around them;
- **requests per round per site**, from what `hf_diloco/core/store/` issues for one regular round (docs/design.md,
  "What it costs"): every rank puts its share; the leader puts the record and the heartbeat, polls (one manifest get
  and `max_staleness` + 1 lists a poll, every grace / 4 seconds, between 0.05 and 1 s) and reads each contribution's
  record once; every rank gets the round's manifest, every contribution's record and the other sites' shares;
- **the store's size bound** (docs/design.md, "Cleanup"): `snapshot_every` + `max_staleness` + 1 rounds of every
  site's contribution beyond the slowest live site, and two snapshots (fp32 θg, and the fp32 outer momentum where
  `outer_momentum` > 0).

A round's wall time comes from llm-foundry's published 7B step time on 8 H100s (`hf_diloco.core.settings.projection.
STEP_TIMES`), one site per 8 GPUs: the link a site needs to move its round's bytes within one round follows.
`--polls` overrides the number of polls per round (default: the closing site's, grace / interval + 1, every site
arriving at once); `benchmarks.store_link` measures the requests of small rounds against these formulas.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from benchmarks.common import command_line

CONFIGS = ("sign_link", "slow_link")
# Llama 2 7B (benchmarks.memory's "7B").
LLAMA_7B = dict(hidden=4096, intermediate=11008, layers=32, vocab=32000, tied=False)
SEAL_BYTES = 9 + 4 + 32  # MAGIC, the header's length, its HMAC (hf_diloco.core.store.sealing)
SHA = "0" * 64
# The identifying fields of an object as `hf_diloco.core.store.board` writes them, at typical lengths: a 16-digit job
# id, a 7-character site name, a 12-digit incarnation, round numbers of 4 digits.
NAMED = {"job": "0" * 16, "fragment": 0, "base": 1000, "site": "site-00", "incarnation": "0" * 12}


def llama_parameters(hidden: int, intermediate: int, layers: int, vocab: int, tied: bool) -> list[tuple[str, int]]:
    """(name, elements) of every trainable tensor of a Llama (full attention heads), in the model's order."""
    params = [("model.embed_tokens.weight", vocab * hidden)]
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        params += [(prefix + f"self_attn.{p}_proj.weight", hidden * hidden) for p in "qkvo"]
        params += [(prefix + f"mlp.{p}_proj.weight", hidden * intermediate) for p in ("gate", "up", "down")]
        params += [(prefix + "input_layernorm.weight", hidden), (prefix + "post_attention_layernorm.weight", hidden)]
    params.append(("model.norm.weight", hidden))
    if not tied:
        params.append(("lm_head.weight", vocab * hidden))
    return params


def config_settings(name: str) -> dict:
    """The DiLoCoConfig of a shipped config (its `diloco:` section over the defaults)."""
    from hf_diloco import DiLoCoConfig
    from hf_diloco.job.config_file import read_config

    section = read_config(name, check_keys=False).section("diloco")
    return vars(DiLoCoConfig(**section))


def even_shares(params: list[tuple[str, int]], ranks: int) -> list[list[tuple[str, int, int]]]:
    """The fragment's values cut into `ranks` runs of nearly equal length, as segments (name, start, length): the
    share of each rank of a site (a sharded site's real cut follows rows; its sizes differ by less than a row)."""
    total = sum(numel for _, numel in params)
    bounds = [total * r // ranks for r in range(ranks + 1)]
    shares: list[list[tuple[str, int, int]]] = [[] for _ in range(ranks)]
    offset = 0
    for name, numel in params:
        for rank in range(ranks):
            low, high = max(bounds[rank], offset), min(bounds[rank + 1], offset + numel)
            if low < high:
                shares[rank].append((name, low - offset, high - low))
        offset += numel
    return shares


def sealed_bytes(header: dict, payload_bytes: int = 0) -> int:
    """The size of a sealed object (`sealing.seal`) with this header and a payload of `payload_bytes`."""
    full = {**header, "payload_bytes": payload_bytes, "payload_sha256": SHA}
    return SEAL_BYTES + len(json.dumps(full, sort_keys=True, separators=(",", ":"))) + payload_bytes


def share_header(share: list[tuple[str, int, int]], codec: str) -> dict:
    # "encrypted": the values of a job with a secret are encrypted (sealing.seal), and a store job has one
    return {
        **NAMED,
        "kind": "shard",
        "shard": 0,
        "segments": [list(s) for s in share],
        "codec": codec,
        "encrypted": True,
    }


def contribution(staleness: bool = False) -> dict:
    entry = {"site": NAMED["site"], "incarnation": NAMED["incarnation"], "base": NAMED["base"], "tokens": 98304.0,
             "record": SHA, "final": False, "norm": 1.2345678901234567}  # fmt: skip
    return {**entry, "staleness": 0, "weight": 0.12345678901234567, "clip": 1.0} if staleness else entry


def record_header() -> dict:
    return {**NAMED, "kind": "record", "contribution": {**contribution(), "record": ""}}


def record_payload(shares: list[list[tuple[str, int, int]]]) -> bytes:
    listed = [{"sha256": SHA, "segments": [list(s) for s in share]} for share in shares]
    return json.dumps({"shares": listed}, separators=(",", ":")).encode()


def manifest_header(entries: int) -> dict:
    return {"kind": "manifest", "fragment": 0, "round": NAMED["base"] + 1, "closed_by": NAMED["site"],
            "quorum_met": True, "waited_seconds": 12.345, "entries": [contribution(True)] * entries,
            "job": NAMED["job"]}  # fmt: skip


def heartbeat_header() -> dict:
    return {"kind": "heartbeat", "job": NAMED["job"], "site": NAMED["site"], "incarnation": NAMED["incarnation"],
            "applied": {"0": NAMED["base"]}, "time": 1234567890.1234567}  # fmt: skip


def cost(settings: dict, params: list[tuple[str, int]], sites: int, ranks: int, polls: int | None) -> dict:
    """Every figure of one config (see the module docstring), each with its formula."""
    from hf_diloco.core.compression.codecs import make_codec
    from hf_diloco.core.settings.projection import STEP_TIMES
    from hf_diloco.core.store.settle import padded_numel

    codec = make_codec(settings["compression"], settings["compression_block_size"],
                       settings["compression_scale_dtype"], settings["topk_density"])  # fmt: skip
    n = sum(numel for _, numel in params)
    shares = even_shares(params, ranks)
    payloads = [codec.encoded_nbytes(padded_numel(sum(s[2] for s in share), codec.align)) for share in shares]
    e = sum(payloads)
    share_objects = sum(sealed_bytes(share_header(share, codec.name), size) for share, size in zip(shares, payloads))
    record = sealed_bytes(record_header(), len(record_payload(shares)))
    heartbeat, manifest = sealed_bytes(heartbeat_header()), sealed_bytes(manifest_header(sites))
    m, s = sites, settings["max_staleness"]
    interval = min(1.0, max(0.05, settings["grace_seconds"] / 4))
    p = polls if polls is not None else math.ceil(settings["grace_seconds"] / interval) + 1
    step_params, gpus, batch_tokens, tokens_per_second = STEP_TIMES["7B"]
    round_seconds = settings["inner_steps"] * batch_tokens / tokens_per_second
    up = share_objects + record + heartbeat + manifest / m
    down = (m - 1) * share_objects + (p + 1 + ranks) * manifest + ranks * m * record
    puts = ranks + 2 + 1 / m
    gets = p + 1 + ranks + ranks * m + ranks * (m - 1)
    lists = (p - 1) * (s + 1)
    contributions = settings["snapshot_every"] + s + 1
    momentum = settings["outer_momentum"] > 0
    snapshot = n * (8 if momentum else 4)
    size = contributions * m * (share_objects + record) + 2 * snapshot + contributions * manifest
    return {
        "codec": f"{codec.name}, block {settings['compression_block_size']}, {settings['compression_scale_dtype']} "
        f"scales",
        "H": settings["inner_steps"],
        "parameters": n,
        "payload_per_site": e,
        "bits_per_value": 8 * e / n,
        "up_bytes": up,
        "down_bytes": down,
        "polls": p,
        "poll_interval": interval,
        "puts": puts,
        "gets": gets,
        "lists": lists,
        "round_seconds": round_seconds,
        "link_mbit_down_in_a_round": 8 * down / round_seconds / 1e6,
        "link_mbit_up_then_down_in_a_round": 8 * (up + down) / round_seconds / 1e6,
        "requests_per_second": (puts + gets + lists) / round_seconds,
        "store_rounds": contributions,
        "snapshot_up_per_site_round": snapshot / settings["snapshot_every"] / m,
        "join_down_bytes": snapshot + settings["snapshot_every"] * (m * share_objects + manifest),
        "snapshot_bytes": snapshot,
        "store_bytes": size,
        "store": {key: settings[key] for key in ("quorum", "grace_seconds", "max_staleness", "snapshot_every")},
        "formulas": {
            "payload_per_site": f"E = sum over {ranks} rank(s) of codec.encoded_nbytes(share padded to {codec.align})",
            "up_bytes": "E + R share headers + record + heartbeat + manifest / M (one site closes each round)",
            "down_bytes": "(M - 1) x (E + R share headers) + (P + 1 + R) x manifest + R x M x record",
            "puts": "R shares + record + heartbeat + 1/M manifest",
            "gets": "P manifest polls + 1 catch-up + R x (1 manifest + M records + (M - 1) shares)",
            "lists": "(P - 1) x (max_staleness + 1)",
            "polls": f"P = ceil(grace / interval) + 1, interval = min(1, max(0.05, grace / 4)) = {interval:g} s",
            "round_seconds": f"H x {batch_tokens:,} tokens / {tokens_per_second:,} tokens/s (7B, {gpus} H100s)",
            "link": "8 x down / round; 8 x (up + down) / round (a site reads once the round is decided)",
            "store_bytes": "(snapshot_every + max_staleness + 1) x M x (E + headers + record) + 2 x snapshot "
            "+ manifests",
            "snapshot_bytes": f"{8 if momentum else 4} B x N (fp32 θg{' and momentum' if momentum else ''})",
            "snapshot_up": "snapshot / snapshot_every / M (the site that closes a snapshot round writes it)",
            "join": "snapshot + snapshot_every x (M contributions + manifest): the rounds replayed after it",
        },
    }


def table(results: dict[str, dict], sites: int, ranks: int) -> str:
    names = list(results)
    first = results[names[0]]
    rows = [
        ("codec, H", lambda r: f"{r['codec']}, H = {r['H']}"),
        ("payload E per site and round (exact)", lambda r: f"{r['payload_per_site']:,} B ({r['bits_per_value']:.3f} bits/value)"),
        ("bytes up per site and round", lambda r: f"{r['up_bytes']:,.0f} B ({gb(r['up_bytes'])})"),
        ("bytes down per site and round", lambda r: f"{r['down_bytes']:,.0f} B ({gb(r['down_bytes'])})"),
        ("polls by the leader per round (P)", lambda r: f"{r['polls']} (every {r['poll_interval']:g} s)"),
        ("puts per site and round", lambda r: f"{r['puts']:.3g}"),
        ("gets per site and round", lambda r: f"{r['gets']:.3g}"),
        ("lists per site and round", lambda r: f"{r['lists']:.3g}"),
        ("round at llm-foundry's 7B step time, s", lambda r: f"{r['round_seconds']:.0f}"),
        ("link to move a round's bytes within a round: down / up then down",
         lambda r: f"{r['link_mbit_down_in_a_round']:.0f} / {r['link_mbit_up_then_down_in_a_round']:.0f} Mbit/s"),
        ("requests per second, per site", lambda r: f"{r['requests_per_second']:.2f}"),
        ("snapshot (one)", lambda r: f"{r['snapshot_bytes']:,} B ({gb(r['snapshot_bytes'])})"),
        ("snapshot writes, per site and round on average", lambda r: gb(r["snapshot_up_per_site_round"])),
        ("a joiner reads: a snapshot and up to snapshot_every rounds", lambda r: gb(r["join_down_bytes"])),
        ("store size bound", lambda r: f"{r['store_bytes']:,.0f} B ({gb(r['store_bytes'])}): {r['store_rounds']} rounds x {sites} sites + 2 snapshots"),
    ]  # fmt: skip
    lines = ["| | " + " | ".join(f"`{name}`" for name in names) + " | formula |", "|---" * (len(names) + 2) + "|"]
    keys = ["codec", "payload_per_site", "up_bytes", "down_bytes", "polls", "puts", "gets", "lists", "round_seconds",
            "link", "requests", "snapshot_bytes", "snapshot_up", "join", "store_bytes"]  # fmt: skip
    for (label, cell), key in zip(rows, keys):
        formula = first["formulas"].get(key, "")
        lines.append(f"| {label} | " + " | ".join(cell(results[name]) for name in names) + f" | {formula} |")
    store = first["store"]
    return "\n".join(lines) + (
        f"\n\n{sites} sites of Llama 2 7B ({first['parameters']:,} parameters, one fragment), each of R = {ranks} "
        f"rank(s); M = {sites} contributing sites per round; the store's settings at their defaults (quorum "
        f"{store['quorum']}, grace {store['grace_seconds']:g} s, max_staleness {store['max_staleness']}, snapshot_every "
        f"{store['snapshot_every']}). A store share is the codec's payload as encoded: `slow_link`'s entropy_coding is not "
        "part of a store exchange (refused with exchange: store).\n"
    )


def gb(value: float) -> str:
    return f"{value / 1e9:.3f} GB" if value >= 1e8 else f"{value / 1e6:.3f} MB" if value >= 1e5 else f"{value:,.0f} B"


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--sites", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=1, help="Ranks per site (S x D), each writing its own share.")
    parser.add_argument("--polls", type=int, default=None, help="The leader's polls per round (default: see above).")
    parser.add_argument(
        "--model", default=json.dumps(LLAMA_7B), help="JSON: hidden, intermediate, layers, vocab, tied"
    )
    parser.add_argument("--out", default=None, help="Writes OUT.json and OUT.md.")
    args = parser.parse_args(argv)
    if args.sites < 1 or args.ranks < 1:
        parser.error("--sites and --ranks must be at least 1")
    params = llama_parameters(**json.loads(args.model))
    results = {name: cost(config_settings(name), params, args.sites, args.ranks, args.polls) for name in args.configs}
    text = table(results, args.sites, args.ranks)
    print(text)
    report = {"command": command_line("store_cost", argv), "settings": vars(args), "results": results, "table": text}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(text)
    return report


if __name__ == "__main__":
    main()

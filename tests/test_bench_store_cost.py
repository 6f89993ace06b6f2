"""`benchmarks.store_cost`: the cost of 8 sites of a 7B model through a store, on paper. Its payloads against the
codecs' formats worked out by hand, its request counts against the formulas, its size bound against the rule."""

from __future__ import annotations

import json
import math

from benchmarks import store_cost

# Llama 2 7B: two 32000 x 4096 matrices (untied), 32 layers of 4 attention and 3 MLP matrices and 2 norms, a norm.
N = 2 * 32000 * 4096 + 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 4096


def test_seven_b_payloads_requests_and_size_bound(tmp_path, capsys):
    out = tmp_path / "cost"
    report = store_cost.main(["--out", str(out)])
    sign, fp4 = report["results"]["sign_link"], report["results"]["slow_link"]
    assert sign["parameters"] == fp4["parameters"] == N == 6_738_415_616
    # sign: one bit per value and a bf16 scale per 512 values; fp4: 4 bits and a bf16 scale per 128 (N divides both).
    assert sign["payload_per_site"] == N // 8 + 2 * math.ceil(N / 512) == 868_623_888
    assert fp4["payload_per_site"] == N // 2 + 2 * math.ceil(N / 128) == 3_474_495_552
    for row in (sign, fp4):
        e = row["payload_per_site"]
        assert e < row["up_bytes"] < e + 100_000  # the share, plus headers, a record, a heartbeat: kilobytes
        assert 7 * e < row["down_bytes"] < 7 * e + 400_000  # the 7 other sites' shares, 8 records, 13 manifests
        # The defaults both configs keep: grace 10 s, polled every second, max_staleness 2, snapshot_every 10.
        assert row["polls"] == 11 and row["lists"] == 10 * 3
        assert row["puts"] == 1 + 2 + 1 / 8 and row["gets"] == 11 + 1 + 1 + 8 + 7
        assert row["snapshot_bytes"] == 4 * N  # outer_momentum 0: θg alone
        assert row["store_rounds"] == 10 + 2 + 1
        assert 13 * 8 * e + 8 * N < row["store_bytes"] < 13 * 8 * e + 8 * N + 10_000_000
        assert math.isclose(row["round_seconds"], 120 * 98_304 / 85_144)
    assert json.loads(out.with_suffix(".json").read_text())["results"]["sign_link"] == json.loads(json.dumps(sign))
    table = out.with_suffix(".md").read_text()
    assert "| payload E per site and round (exact) | 868,623,888 B" in table and table in capsys.readouterr().out


def test_ranks_split_the_payload_and_multiply_the_share_requests():
    report = store_cost.main(["--ranks", "8", "--sites", "4", "--polls", "3", "--configs", "slow_link"])
    row = report["results"]["slow_link"]
    # 8 shares of N / 8 values each (N / 8 is a multiple of 128): the same payload as one rank's.
    assert row["payload_per_site"] == N // 2 + 2 * (N // 128)
    assert row["puts"] == 8 + 2 + 1 / 4
    assert row["gets"] == 3 + 1 + 8 * (1 + 4 + 3) and row["lists"] == 2 * 3


def test_even_shares_cover_every_value_once():
    params = store_cost.llama_parameters(hidden=8, intermediate=16, layers=2, vocab=10, tied=True)
    shares = store_cost.even_shares(params, 3)
    total = sum(numel for _, numel in params)
    lengths = [sum(length for _, _, length in share) for share in shares]
    assert sum(lengths) == total and max(lengths) - min(lengths) <= 1
    covered = {}
    for share in shares:
        for name, start, length in share:
            covered.setdefault(name, []).append((start, length))
    for name, numel in params:
        ranges = sorted(covered[name])
        assert ranges[0][0] == 0 and sum(length for _, length in ranges) == numel


def test_the_objects_around_a_payload_are_the_size_the_paper_counts(tmp_path):
    """A record, a manifest, a heartbeat and a share as the store's own board writes them (a real folder store):
    within a few bytes of what `store_cost` counts for them (numbers of other lengths: a time, a norm)."""
    from hf_diloco import open_store
    from hf_diloco.core.store.board import RoundBoard
    from hf_diloco.core.store.manifest import Contribution, Manifest, weigh
    from hf_diloco.core.store.objects import BoundedStore
    from hf_diloco.core.store.sealing import JobKeys

    store = BoundedStore(open_store(f"file://{tmp_path}/store"), 10.0)
    named = store_cost.NAMED
    board = RoundBoard(store, JobKeys(b"secret"), named["site"], named["incarnation"], 0, 1)
    board.job_id = named["job"]
    share = [("model.embed_tokens.weight", 0, 320), ("model.norm.weight", 0, 32)]
    payload = bytes(100)
    board.put_share(0, named["base"], payload, [list(s) for s in share], "fp4")
    shares = [{"sha256": store_cost.SHA, "segments": [list(s) for s in share]}]
    board.put_record(0, named["base"], 98304.0, shares, final=False, norm=1.2345678901234567)
    board.beat({0: named["base"]})
    contributions = [Contribution(named["site"], named["incarnation"], named["base"], 98304.0, store_cost.SHA,
                                  norm=1.2345678901234567) for _ in range(3)]  # fmt: skip
    board.decide(Manifest(0, named["base"] + 1, named["site"], weigh(contributions, named["base"] + 1, 2),
                          waited_seconds=12.345))  # fmt: skip
    sizes = {
        path.name.rsplit("-", 1)[0]: path.stat().st_size for path in (tmp_path / "store").rglob("*") if path.is_file()
    }
    expected = {
        "s0000": store_cost.sealed_bytes(store_cost.share_header(share, "fp4"), len(payload)),
        "record": store_cost.sealed_bytes(store_cost.record_header(), len(store_cost.record_payload([share]))),
        named["site"]: store_cost.sealed_bytes(store_cost.heartbeat_header()),
        f"{named['base'] + 1:08d}": store_cost.sealed_bytes(store_cost.manifest_header(3)),
    }
    for name, size in expected.items():
        found = next(value for key, value in sizes.items() if key.endswith(name))
        assert abs(found - size) <= 16, (name, found, size)

"""The store exchange's parts on a real folder store: sealed objects and what a reader refuses, the safetensors
snapshots, a round's weights, the closing rule, one decision per round whoever races, and every store call bounded.
The sites themselves, as processes against a real S3 server, are in tests/test_store_sites.py."""

from __future__ import annotations

import json
import struct
import threading
import time

import pytest
import torch

from hf_diloco.backends.object_store import ObstoreStore, open_store
from hf_diloco.core.store.board import RoundBoard
from hf_diloco.core.store.manifest import ClosingRule, Contribution, Manifest, weigh
from hf_diloco.core.store.names import StoreNames, check_site_name
from hf_diloco.core.store.objects import BoundedStore, StoreUnreachableError, check_create_if_absent
from hf_diloco.core.store.sealing import MAGIC, JobKeys, UntrustedObject, open_header, seal, unseal
from hf_diloco.core.store.tensors import from_safetensors, to_safetensors

KEYS = JobKeys(b"the job's secret")


def test_a_sealed_object_opens_only_as_what_it_is_with_the_job_s_secret():
    payload = bytes(range(200))
    sealed = seal(KEYS, {"kind": "shard", "job": "j1", "fragment": 0, "base": 3, "site": "a"}, payload)
    header, body = unseal(KEYS, sealed, {"kind": "shard", "job": "j1", "base": 3}, len(payload), "obj")
    assert bytes(body) == payload and header["site"] == "a"
    cases = {
        "forged": (JobKeys(b"another secret"), sealed, {}, "not signed with this job's secret"),
        "truncated": (KEYS, sealed[:-5], {}, "holds 195 payload bytes where its header states 200"),
        "cut in its header": (KEYS, sealed[:20], {}, "truncated"),
        "replayed from another round": (KEYS, sealed, {"base": 4}, "a replay from another round"),
        "of another job": (KEYS, sealed, {"job": "j2"}, "job 'j1' where this one is 'j2'"),
        "altered": (KEYS, sealed[:-1] + bytes([sealed[-1] ^ 1]), {}, "does not match its signed hash"),
        "not an object": (KEYS, b"GARBAGE" * 10, {}, "not a store object of hf_diloco"),
    }
    for name, (keys, data, expect, message) in cases.items():
        with pytest.raises(UntrustedObject, match=message):
            unseal(keys, data, expect, None, f"object {name}")


def test_a_header_that_claims_a_huge_payload_is_refused_before_anything_is_allocated():
    """A signed header stating 10^12 payload bytes (a share of 10^12 values would be that much) is refused by its
    length alone: the reader expects exactly its share's encoded size."""
    head = {"kind": "shard", "job": "j", "numel": 10**12, "payload_bytes": 10**12, "payload_sha256": "0" * 64}
    text = json.dumps(head).encode()
    prefix = MAGIC + struct.pack("<I", len(text)) + text
    forged_length = prefix + KEYS.mac(prefix)  # signed by a member, but lying about its size
    with pytest.raises(UntrustedObject, match="states a payload of 1000000000000 bytes where 4096 are expected"):
        unseal(KEYS, forged_length, {"kind": "shard"}, 4096, "huge")
    huge_header = MAGIC + struct.pack("<I", 1 << 30) + b"{}"
    with pytest.raises(UntrustedObject, match="no header, or a header over"):
        open_header(KEYS, huge_header, {}, "huge header")


def test_no_secret_is_refused_unless_the_insecure_mode_is_named():
    with pytest.raises(ValueError, match="exchange 'store' needs the job's secret.*insecure_no_secret: true"):
        JobKeys(None)
    insecure = JobKeys(None, insecure=True)
    assert not insecure.authenticated and KEYS.authenticated


def test_snapshots_are_safetensors_files_read_with_bounds():
    from safetensors.torch import load

    tensors = {"theta_g": torch.randn(7, 3), "momentum_buffer": torch.randn(21), "count": torch.arange(5)}
    data = to_safetensors(tensors, {"round": "4"})
    loaded = load(data)  # the library opens what the core wrote without it
    assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)
    read, metadata = from_safetensors(data, {"theta_g": 21})
    assert torch.equal(read["theta_g"], tensors["theta_g"]) and metadata == {"round": "4"}
    with pytest.raises(ValueError, match="missing or has another size"):
        from_safetensors(data, {"theta_g": 22})
    with pytest.raises(ValueError, match="byte range"):
        from_safetensors(data[:-4])
    with pytest.raises(ValueError, match="a header of"):
        from_safetensors(struct.pack("<Q", 10**12) + b"{}")


def _contribution(site: str, base: int, tokens: float = 100.0, norm: float = 1.0) -> Contribution:
    return Contribution(site, "0" * 12, base, tokens, "0" * 64, norm=norm)


def test_a_round_weighs_contributions_by_tokens_over_one_plus_staleness():
    """Round 5: a fresh contribution (base 4) of 300 tokens, one a round late (base 3) of 200, one three rounds late
    (beyond max_staleness 2: left out). Weights 300 : 200 / 2, in site order."""
    entries = weigh([_contribution("b", 3, 200), _contribution("a", 4, 300), _contribution("c", 1, 900)], 5, 2)
    assert [(e.contribution.site, e.staleness) for e in entries] == [("a", 0), ("b", 1)]
    assert [e.weight for e in entries] == pytest.approx([300 / 400, 100 / 400])
    assert sum(e.weight for e in entries) == pytest.approx(1.0)


def test_a_round_s_weights_are_the_same_bits_whatever_order_the_contributions_came_in():
    """tokens / (1 + staleness) are thirds and fifths: their total's rounding depends on the order it is summed in
    (here the arrival order c, d, e, a, b and the site order differ in the last bit), so weigh sums in the entries' own
    order, the manifest's, and a replay summing them as written gets the same bits."""
    arrived = [_contribution("c", 4, 200), _contribution("d", 6, 200), _contribution("e", 6, 96),
               _contribution("a", 8, 512), _contribution("b", 6, 512)]  # fmt: skip
    orders = [arrived, arrived[::-1], sorted(arrived, key=lambda c: c.site)]
    weights = [[e.weight for e in weigh(order, 9, 4)] for order in orders]
    assert weights[0] == weights[1] == weights[2]
    raw = [e.contribution.tokens / (1 + e.staleness) for e in weigh(arrived, 9, 4)]
    assert weights[0] == [value / sum(raw) for value in raw]


def test_robust_clipping_scales_a_far_larger_contribution_down_to_the_factor_times_the_lower_median():
    entries = weigh([_contribution("a", 0, norm=1.0), _contribution("b", 0, norm=30.0)], 1, 2, clip_factor=3.0)
    assert [e.clip for e in entries] == pytest.approx([1.0, 3.0 / 30.0])
    assert [e.weight for e in entries] == pytest.approx([0.5, 0.5 * 0.1])
    alone = weigh([_contribution("b", 0, norm=30.0)], 1, 2, clip_factor=3.0)
    assert alone[0].clip == 1.0  # nothing to compare one contribution with


def test_a_round_closes_after_its_quorum_and_grace_or_at_its_deadline():
    rule = ClosingRule(quorum=2, grace_seconds=5.0, deadline_seconds=60.0)
    assert not rule.due(sites_in=1, quorum_seconds=None, waited_seconds=10.0)
    assert not rule.due(sites_in=2, quorum_seconds=4.9, waited_seconds=10.0)
    assert rule.due(sites_in=2, quorum_seconds=5.0, waited_seconds=10.0)
    assert rule.due(sites_in=1, quorum_seconds=None, waited_seconds=60.0)
    assert not rule.due(sites_in=0, quorum_seconds=None, waited_seconds=600.0)
    adaptive = ClosingRule(quorum=2, grace_seconds=5.0, deadline_seconds=60.0, adaptive=True)
    for lateness in (0.4, 0.6, 0.5, 0.7):
        adaptive.observe(lateness)
    assert 0.5 <= adaptive.grace() < 1.5  # 1.5 x the 90th percentile of how late the others came
    adaptive.observe(30.0)
    assert adaptive.grace() == 5.0  # never above grace_seconds


def test_site_names_are_checked_and_names_of_objects_carry_a_tag_only_the_job_computes(tmp_path):
    check_site_name("site-a.eu_1")
    with pytest.raises(ValueError, match="cannot name a site"):
        check_site_name("../etc")
    names = StoreNames(KEYS)
    record = names.record(0, 3, "a", "0" * 12)
    assert names.parse_record(record) == (0, 3, "a", "0" * 12)
    stranger = StoreNames(JobKeys(b"guessed")).record(0, 3, "a", "0" * 12)
    assert names.parse_record(stranger) is None
    assert names.manifest(0, 7) != StoreNames(JobKeys(b"guessed")).manifest(0, 7)


def _board(store, site: str, job: str = "j1") -> RoundBoard:
    board = RoundBoard(BoundedStore(store, 5.0), KEYS, site, "0" * 12, 0, 1)
    board.job_id = job
    return board


def test_two_sites_racing_to_close_a_round_leave_exactly_one_manifest_and_both_apply_it(tmp_path):
    store = open_store(f"file://{tmp_path}/job")
    check_create_if_absent(store, "probe")
    boards = [_board(store, "a"), _board(store, "b")]
    for round_ in range(1, 21):
        proposals = [Manifest(0, round_, board.site, weigh([_contribution(board.site, round_ - 1)], round_, 2))
                     for board in boards]  # fmt: skip
        decided: dict[str, Manifest] = {}
        start = threading.Barrier(2)
        threads = [threading.Thread(target=_close_at_once, args=(*pair, start, decided))
                   for pair in zip(boards, proposals)]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert decided["a"] == decided["b"], round_
        assert decided["a"].closed_by in ("a", "b")
        assert [key for key in store.list("f0/m/") if f"/{round_:08d}-" in key] == [
            StoreNames(KEYS).manifest(0, round_)
        ]


def _close_at_once(board: RoundBoard, proposal: Manifest, start: threading.Barrier, decided: dict) -> None:
    start.wait()
    decided[board.site] = board.decide(proposal)


def test_an_object_a_stranger_puts_in_the_store_is_ignored_and_named(tmp_path, caplog):
    store = open_store(f"file://{tmp_path}/job")
    board = _board(store, "a")
    share = board.put_share(0, 0, b"\0" * 8, [["w", 0, 2]], "none")
    board.put_record(0, 0, 10.0, [{"sha256": share, "segments": [["w", 0, 2]]}], final=False, norm=1.0)
    names = StoreNames(KEYS)
    stranger = StoreNames(JobKeys(b"guessed")).record(0, 0, "evil", "1" * 12)
    store.put(stranger, seal(JobKeys(b"guessed"), {"kind": "record"}))
    forged_name = names.record(0, 0, "evil2", "2" * 12)  # a name a member gave away, but no seal of the job's
    store.put(forged_name, b"HFDLSEAL1 anything")
    replayed = names.record(0, 0, "c", "3" * 12)  # the job's seal, copied from another job's record
    other = _board(store, "c", job="another job")
    store.put(
        replayed, seal(KEYS, {**other._of(0, 0), "kind": "record", "contribution": _contribution("c", 0).as_dict()})
    )
    with caplog.at_level("WARNING"):
        found = board.contributions(0, range(0, 1), final=False)
    assert [c.site for c in found] == ["a"]
    assert sorted(board.ignored) == sorted([stranger, forged_name, replayed])
    for key in (stranger, forged_name, replayed):
        assert f"ignored the store object {key}" in caplog.text


class FlakyStore:
    """A real folder store that fails every call while `down` (a store that does not answer)."""

    def __init__(self, store: ObstoreStore):
        self.store, self.url, self.down = store, store.url, False

    def __getattr__(self, name):
        call = getattr(self.store, name)

        def flaky(*args, **kwargs):
            if self.down:
                raise ConnectionError("connection refused")
            return call(*args, **kwargs)

        return flaky


def test_a_store_down_longer_than_the_bound_stops_the_call_naming_the_store_and_back_within_it_goes_on(tmp_path):
    flaky = FlakyStore(open_store(f"file://{tmp_path}/job"))
    bounded = BoundedStore(flaky, timeout_seconds=1.0)
    flaky.down = True
    started = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=f"The store file://{tmp_path}/job did not answer for 1 s"):
        bounded.put("a", b"x")
    assert time.monotonic() - started < 3.0
    bounded = BoundedStore(flaky, timeout_seconds=10.0)
    threading.Timer(0.8, lambda: setattr(flaky, "down", False)).start()
    assert bounded.put("a", b"x") and bounded.get("a") == b"x"


def test_entropy_coding_with_a_store_is_refused_naming_it():
    """A store share is written as its codec encodes it (its length checked against the codec's before it is read):
    `entropy_coding` would be a setting that silently does nothing, so it is refused."""
    from hf_diloco import DiLoCoConfig

    store = {"exchange": "store", "store_url": "file:///tmp/job", "site": "site-a", "compression": "fp4"}
    DiLoCoConfig(**store)
    with pytest.raises(ValueError, match=r"not supported: entropy_coding \(a share is stored as its codec encodes"):
        DiLoCoConfig(**store, entropy_coding=True)


def test_a_store_that_accepts_a_second_create_is_refused(tmp_path):
    class Overwriting:
        url = "s3://no-conditional-writes/job"

        def put(self, key, data, create_only=False):
            return True

        def delete(self, keys):
            pass

    with pytest.raises(ValueError, match="does not refuse a second write of one name"):
        check_create_if_absent(Overwriting(), "probe")


def _store_engine(tmp_path, site: str, width: int = 16, **settings):
    from torch import nn

    from hf_diloco import DiLoCo, DiLoCoConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4))
    config = DiLoCoConfig(exchange="store", store_url=f"file://{tmp_path}/job", site=site, **settings)
    return DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), config, store=open_store(config.store_url))


def test_a_site_with_other_settings_or_another_model_is_refused_naming_them_before_it_writes(tmp_path, monkeypatch):
    """Two sites in turn (real engines on a folder store): the first writes the job; a second with another H, or a
    wider layer, is refused naming the field or the parameter, and writes nothing into the store."""
    monkeypatch.setenv("HF_DILOCO_JOB_SECRET", "a secret")
    _store_engine(tmp_path, "a", inner_steps=4, compression="int8").close()
    before = sorted(path.name for path in (tmp_path / "job").rglob("*"))
    with pytest.raises(ValueError, match=r"The store job at file://.*/job runs with other DiLoCo settings \(inner_steps: "
                                         r"4 in the job, 8 in this site"):  # fmt: skip
        _store_engine(tmp_path, "b", inner_steps=8, compression="int8")
    with pytest.raises(ValueError, match=r"trains another model than this site: parameter 0\.bias has shape "
                                         r"\(16,\) in the job.s model and \(32,\) here"):  # fmt: skip
        _store_engine(tmp_path, "c", width=32, inner_steps=4, compression="int8")
    after = sorted(path.name for path in (tmp_path / "job").rglob("*") if not path.name.startswith("create-if-absent"))
    assert [name for name in after if name not in before and not name.startswith(("b-", "c-"))] == []


def test_a_store_job_without_a_secret_or_a_site_is_refused_before_any_work(tmp_path, monkeypatch):
    from hf_diloco import DiLoCoConfig
    from hf_diloco.core.diloco import check_store_given

    monkeypatch.delenv("HF_DILOCO_JOB_SECRET", raising=False)
    monkeypatch.delenv("HF_DILOCO_JOB_SECRET_FILE", raising=False)
    config = DiLoCoConfig(exchange="store", store_url=f"file://{tmp_path}/job", site="a")
    with pytest.raises(ValueError, match="exchange 'store' needs the job's secret"):
        check_store_given(config, None, None, opening=True)
    check_store_given(DiLoCoConfig(exchange="store", store_url="file:///x", site="a", insecure_no_secret=True), None,
                      None, opening=True)  # fmt: skip
    monkeypatch.setenv("HF_DILOCO_JOB_SECRET", "a secret")
    with pytest.raises(ValueError, match="exchange 'store' needs site: this site's name"):
        check_store_given(DiLoCoConfig(exchange="store", store_url="file:///x"), None, None, opening=True)
    with pytest.raises(ValueError, match=r"exchange 'store' needs store_url"):
        DiLoCoConfig(exchange="store", site="a")


def test_the_model_s_values_are_encrypted_in_the_store_and_only_the_job_reads_them(tmp_path):
    """A share's payload in the store is not its values (a reader without the secret learns nothing of them); the
    job's reader gets them back exactly; without a secret nothing is encrypted (insecure_no_secret)."""
    store = open_store(f"file://{tmp_path}/job")
    board = _board(store, "a")
    values = torch.arange(1024, dtype=torch.float32).numpy().tobytes()
    sha = board.put_share(0, 0, values, [["w", 0, 1024]], "none")
    key = StoreNames(KEYS).shard(0, 0, "a", "0" * 12, 0)
    stored = store.get(key)
    assert values not in stored and values[:64] not in stored
    contribution = Contribution("a", "0" * 12, 0, 1.0, "")
    read = board.fetch_share(0, contribution, 0, {"sha256": sha}, len(values))
    assert bytes(read) == values
    insecure = JobKeys(None, insecure=True)
    assert values in seal(insecure, {"kind": "shard"}, values, encrypt_as=key)


def test_shares_by_parameter_and_range_cover_a_fragment_once_whatever_the_site_s_shape():
    """A fragment of three pieces (a whole matrix, a bias, rows 2-5 of another matrix) cut for one rank and for each
    rank of a 2-rank DDP site (contiguous halves of the flat vector padded to whole codec blocks, so not at a
    parameter's edge): each 2-rank share overlaps the one-rank share exactly where its values are, and the two together
    hold every value once."""
    from types import SimpleNamespace

    from torch import nn

    from hf_diloco.core.layout.fragments import Piece
    from hf_diloco.core.layout.shard import ReplicatedValues, Worker
    from hf_diloco.core.layout.topology import RankLayout, Topology
    from hf_diloco.core.store.segments import covered, overlaps, share_segments

    params = {
        "w": nn.Parameter(torch.zeros(6, 5)),
        "b": nn.Parameter(torch.zeros(7)),
        "v": nn.Parameter(torch.zeros(8, 3)),
    }
    pieces = [Piece("w", 0, 6), Piece("b", 0, 7), Piece("v", 2, 6)]
    sizes = (30, 7, 12)

    def segments(ranks: int, rank: int) -> list:
        worker = Worker(Topology(RankLayout(ranks, 1, ranks), rank, {}), count_bytes=lambda sent: None)
        values = ReplicatedValues(pieces, params, granularity=8 * ranks, worker=worker)
        return share_segments(SimpleNamespace(pieces=pieces, sizes=sizes, values=values))

    whole = segments(1, 0)
    assert whole == [("w", 0, 30), ("b", 0, 7), ("v", 6, 12)]  # rows 2-5 of v: its elements 6..17
    halves = [segments(2, 0), segments(2, 1)]
    # 49 values padded to 64 (whole blocks of 8 for each of 2 ranks): rank 0 holds [0, 32), rank 1 [32, 49).
    assert halves[0] == [("w", 0, 30), ("b", 0, 2)] and halves[1] == [("b", 2, 5), ("v", 6, 12)]
    assert covered(whole, halves) and covered(halves[1], [whole])
    assert overlaps(whole, halves[1]) == [(32, 0, 5), (37, 5, 12)]
    assert overlaps(halves[0], halves[1]) == []

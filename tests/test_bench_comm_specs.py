"""`benchmarks.common` method specs: DiLoCoConfig overrides, the inner learning rate (DDP's too), workers; a
`benchmarks.comm` run that hands DDP over to DiLoCo; and `--seed`, which sets the held-out files, the order and the
shards as well as the initialization."""

import json
import sys

import pytest
import torch

from benchmarks import comm, common


def test_learning_rate_is_a_run_setting_for_ddp_and_diloco():
    assert common.parse_method("ddp:lr=0.003@2") == ("ddp", None, 2)
    assert common.run_overrides("ddp:lr=0.003@2") == {"lr": 0.003}
    name, fields, workers = common.parse_method("diloco_h50:outer_lr=0.5,lr=0.001")
    assert (name, workers) == ("diloco_h50", None)
    assert fields == {"inner_steps": 50, "outer_lr": 0.5}
    assert common.run_overrides("diloco_h50:outer_lr=0.5,lr=0.001") == {"lr": 0.001}
    assert common.run_overrides("diloco_h50:outer_lr=0.5@2") == {}


@pytest.mark.parametrize("spec", ["ddp:outer_lr=0.5", "diloco:not_a_field=1", "no_such_method"])
def test_unknown_settings_are_refused(spec):
    with pytest.raises(ValueError):
        common.parse_method(spec)


def test_ddp_steps_is_a_run_setting_of_diloco_methods_only():
    name, fields, workers = common.parse_method("diloco_h50:outer_lr=0.5,ddp_steps=300@2")
    assert (name, fields, workers) == ("diloco_h50", {"inner_steps": 50, "outer_lr": 0.5}, 2)
    assert common.run_overrides("diloco_h50:outer_lr=0.5,ddp_steps=300@2") == {"ddp_steps": 300}


@pytest.mark.timeout(300)
def test_ddp_steps_train_as_ddp_then_hand_over_to_diloco(tmp_path):
    """A DiLoCo run whose every step is a DDP warm-up step ends exactly where DDP does (two workers: the gradient
    sum is exact in any order), with DDP's bytes; a shorter warm-up adds its all-reduces to DiLoCo's own bytes."""
    tiny = '{"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64}'
    common = ["--steps", "6", "--warmup", "2", "--train_files", "20", "--vocab_size", "256", "--model", tiny]
    methods = [
        "ddp@2",
        "diloco:inner_steps=3,outer_lr=1.0,outer_momentum=0.0,ddp_steps=6@2",
        "diloco:inner_steps=3,outer_lr=1.0,outer_momentum=0.0,ddp_steps=3@2",
        "diloco:inner_steps=3,outer_lr=1.0,outer_momentum=0.0@2",
    ]
    results = comm.main([*common, "--out", str(tmp_path / "warm"), "--methods", *methods])
    ddp, all_warm, half_warm, plain = results
    assert all_warm["eval_loss"] == ddp["eval_loss"]
    assert all_warm["bytes_sent"] == pytest.approx(ddp["bytes_sent"], rel=1e-3)
    per_ddp_step = ddp["bytes_sent"] / 6
    assert half_warm["bytes_sent"] == pytest.approx(3 * per_ddp_step + plain["bytes_sent"] / 2, rel=1e-3)
    assert half_warm["eval_loss"] != plain["eval_loss"]


def test_every_method_is_checked_before_any_run_starts(tmp_path, capsys):
    """A spec the engine would refuse stops the benchmark before the first method trains (and before data is built)."""
    with pytest.raises(SystemExit):
        comm.main(["--methods", "ddp", "streaming_fp4:inner_steps=4", "--out", str(tmp_path / "never")])
    assert "sync_delay (1) must be smaller than inner_steps / num_fragments" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_report_is_written_without_matplotlib(tmp_path, monkeypatch, capsys):
    """Without matplotlib the report skips the plot, saying so, and keeps the results (a long run must not be lost)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    args = comm.build_parser().parse_args(["--out", str(tmp_path / "run")])
    ddp = {"method": "ddp@2", "workers": 2, "bytes_per_token": 8.0, "peak_bytes_per_sync": 64, "eval_loss": 4.0}
    comm.write_report([ddp], args, None)
    assert json.loads((tmp_path / "run.json").read_text())["results"] == [ddp]
    assert (tmp_path / "run.md").exists() and not (tmp_path / "run.png").exists()
    assert "matplotlib is not installed: no " in capsys.readouterr().out


def test_the_inner_optimizer_is_a_run_setting_checked_before_any_run():
    assert common.run_overrides("diloco_h50:inner=muon,outer_lr=1.0@2") == {"inner": "muon"}
    assert common.parse_method("ddp:inner=muon@2") == ("ddp", None, 2)
    with pytest.raises(ValueError, match="inner='sgd': choose adamw or muon"):
        common.parse_method("ddp:inner=sgd@2")


def test_the_benchmarks_muon_takes_the_block_matrices_and_adamw_the_rest():
    """`inner=muon` is the front-ends' `inner_optimizer: muon`: Muon for each 2-D weight of the block stack, AdamW (the
    benchmarks' betas, weight decay 0.1 on every parameter) for embeddings, norms and head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = common.inner_optimizer(model, "muon", 0.002)
    names = {id(param): name for name, param in model.named_parameters()}
    muon_group, *adamw_groups = optimizer.param_groups  # Muon's group first (MuonWithAdamW)
    muon = [names[id(p)] for p in muon_group["params"]]
    adamw = [names[id(p)] for group in adamw_groups for p in group["params"]]
    expected_muon = [n for n, p in model.named_parameters() if n.startswith("model.layers.") and p.dim() == 2]
    assert muon == expected_muon and len(muon) == 2 * 7
    assert "ns_steps" in muon_group and all("betas" in group for group in adamw_groups)
    assert sorted(adamw) == sorted(n for n in names.values() if n not in expected_muon)
    assert all(group["weight_decay"] == 0.1 for group in optimizer.param_groups if group["params"])
    assert all(group["betas"] == (0.9, 0.95) for group in adamw_groups)
    plain = common.inner_optimizer(model, "adamw", 0.002)
    assert isinstance(plain, torch.optim.AdamW) and plain.defaults["weight_decay"] == 0.1


def _deals(seed: int, world: int, steps: int, batch: int = 1) -> list[list[int]]:
    """Each rank's block indices over `steps` batches of 10 blocks numbered 0 ... 9."""
    numbered = torch.arange(10).unsqueeze(1)
    ranks = [common.ShardBatches(numbered, seed, rank, world, batch) for rank in range(world)]
    return [[int(i) for step in range(steps) for i in shard(step).flatten()] for shard in ranks]


def test_the_seed_sets_the_order_and_deals_every_block_of_an_epoch_once():
    one, again, other = _deals(1, 2, 5), _deals(1, 2, 5), _deals(2, 2, 5)  # one epoch: 5 blocks per worker
    assert one == again and one != other
    for deal in (one, other):
        assert sorted(deal[0] + deal[1]) == list(range(10))  # disjoint shards, every block dealt
    two_epochs = _deals(1, 2, 5, batch=2)
    assert [deal[:5] for deal in two_epochs] == one and two_epochs[0][5:] != one[0]  # each epoch a new order
    assert sorted(two_epochs[0][5:] + two_epochs[1][5:]) == list(range(10))
    assert _deals(1, 1, 10)[0] != list(range(10))  # one worker too reads a seeded order


def _train_each(rank: int, world: int, runs: list[tuple[int, str]], args) -> list[dict]:
    """The benchmarks' training run of DDP for each (seed, data folder) of `runs`, one after the other."""
    results = []
    for seed, folder in runs:
        args.seed = seed
        results.append(common.train_worker(rank, world, "ddp", args, folder))
    return results


@pytest.mark.timeout(120)
def test_a_seed_repeats_its_run_and_another_seed_changes_the_data_and_the_run(tmp_path):
    """`--seed` picks the held-out files (so the tokenizer and blocks), the order and the shards: a real DDP run of
    2 workers on seed 1 twice repeats itself to the bit, one on seed 2 trains and evaluates on other data."""
    runs, data = [], {}
    for name, seed in (("first", 1), ("again", 1), ("other", 2)):
        (tmp_path / name).mkdir()
        data[name] = common.prepare_data(tmp_path / name, 64, train_files=8, vocab_size=256, seed=seed)
        runs.append((seed, str(tmp_path / name)))
    assert all(torch.equal(data["first"][split], data["again"][split]) for split in ("train", "eval"))
    assert not torch.equal(data["first"]["eval"][:1], data["other"]["eval"][:1])
    tiny = '{"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64}'
    args = common.run_settings(["--steps", "3", "--warmup", "1", "--log_every", "1", "--model", tiny])
    first, again, other = zip(*common.run_on_workers(_train_each, 2, runs, args, timeout_seconds=100))
    assert [r["train_curve"] for r in first] == [r["train_curve"] for r in again]
    assert first[0]["eval_loss"] == again[0]["eval_loss"] != other[0]["eval_loss"]
    assert first[0]["train_curve"] != first[1]["train_curve"]  # the two workers read different shards
    assert first[0]["train_curve"][0] != other[0]["train_curve"][0]

"""`benchmarks.common` method specs: DiLoCoConfig overrides, the inner learning rate (DDP's too), workers; and a
`benchmarks.comm` run that hands DDP over to DiLoCo."""

import json
import sys

import pytest

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
    import torch
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

"""DiLoCoPlugin: DILOCO_* / YAML / argument precedence and errors (one process), and the raw Accelerate loop of
examples/accelerate_loop.py on 2 torchrun processes against an independent plain-torch DiLoCo reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from examples.accelerate_loop import build_model, random_token_rows
from hf_diloco import DiLoCoConfig, DiLoCoPlugin
from hf_diloco.publish.model_card import has_diloco_tag
from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------ configuration


def test_fields_come_from_arguments_then_env_then_yaml_then_defaults(tmp_path):
    config = tmp_path / "diloco.yaml"
    config.write_text("diloco:\n  inner_steps: 20\n  outer_lr: 0.5\n  compression: bf16\n  num_fragments: 2\n")
    env = {
        "DILOCO_INNER_STEPS": "40",
        "DILOCO_OUTER_LR": "0.25",
        "DILOCO_OUTER_NESTEROV": "false",
        "DILOCO_ERROR_FEEDBACK": "YES",
        "DILOCO_GLOBAL_COPY_DEVICE": " cpu ",
        "OTHER": "ignored",
    }
    plugin = DiLoCoPlugin.from_yaml(config, outer_lr=0.125, environ=env)
    assert (plugin.inner_steps, plugin.outer_lr, plugin.compression, plugin.num_fragments) == (40, 0.125, "bf16", 2)
    assert plugin.outer_nesterov is False and plugin.error_feedback is True and plugin.global_copy_device == "cpu"
    assert plugin.outer_momentum == 0.9 and plugin.sync_delay == 0  # defaults
    assert plugin.sources["outer_lr"] == "argument" and plugin.sources["inner_steps"] == "DILOCO_INNER_STEPS"
    assert plugin.sources["compression"] == str(config) and plugin.sources["sync_delay"] == "default"
    assert isinstance(plugin, DiLoCoConfig)
    assert plugin.diloco_config() == DiLoCoConfig(
        inner_steps=40, outer_lr=0.125, outer_nesterov=False, error_feedback=True, compression="bf16", num_fragments=2
    )


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("DILOCO_INNER_STEPS", "12")
    monkeypatch.setenv("DILOCO_NUM_FRAGMENTS", "3")
    plugin = DiLoCoPlugin(sync_delay=1)
    assert (plugin.inner_steps, plugin.num_fragments, plugin.sync_delay) == (12, 3, 1)


@pytest.mark.parametrize(
    ("variable", "value", "field"),
    [
        ("DILOCO_INNER_STEPS", "ten", "inner_steps"),
        ("DILOCO_INNER_STEPS", "2.5", "inner_steps"),
        ("DILOCO_OUTER_LR", "fast", "outer_lr"),
        ("DILOCO_OUTER_NESTEROV", "maybe", "outer_nesterov"),
        ("DILOCO_SYNC_TIMEOUT_SECONDS", "", "sync_timeout_seconds"),
    ],
)
def test_unparsable_value_names_variable_and_field(variable, value, field):
    with pytest.raises(ValueError) as error:
        DiLoCoPlugin(environ={variable: value})
    assert variable in str(error.value) and field in str(error.value)


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"DILOCO_INNER_STEPS": "0"}, "inner_steps"),
        ({"DILOCO_COMPRESSION": "int3"}, "compression"),
        ({"DILOCO_OUTER_MOMENTUM": "1.0"}, "outer_momentum"),
        ({"DILOCO_INNER_STEPS": "10", "DILOCO_NUM_FRAGMENTS": "3"}, "num_fragments"),
    ],
)
def test_invalid_value_names_field_and_where_it_came_from(env, field):
    with pytest.raises(ValueError) as error:
        DiLoCoPlugin(environ=env)
    message = str(error.value)
    assert field in message and f"{field} from DILOCO_{field.upper()}" in message


def test_unknown_variable_and_unknown_argument_are_refused():
    with pytest.raises(ValueError, match="DILOCO_INNER_STEP'.*DILOCO_INNER_STEPS"):
        DiLoCoPlugin(environ={"DILOCO_INNER_STEP": "10"})
    with pytest.raises(TypeError, match="inner_step"):
        DiLoCoPlugin(inner_step=10, environ={})


def test_explicit_argument_overrides_a_bad_environment_value_only_if_it_parses():
    # An explicit argument wins, but a malformed variable is still an error: it signals a broken launch config.
    with pytest.raises(ValueError, match="DILOCO_INNER_STEPS"):
        DiLoCoPlugin(inner_steps=8, environ={"DILOCO_INNER_STEPS": "x"})
    assert DiLoCoPlugin(inner_steps=8, environ={"DILOCO_INNER_STEPS": "0"}).inner_steps == 8


@pytest.mark.timeout(120)
def test_engine_steps_once_per_real_inner_step_with_gradient_accumulation():
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    plugin = DiLoCoPlugin(inner_steps=2, outer_lr=1.0, outer_momentum=0.0, environ={})
    model = build_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(random_token_rows(16), batch_size=2)
    model, optimizer, loader = plugin.prepare(accelerator, model, optimizer, loader)
    for batch in loader:  # 8 micro-batches = 4 inner steps = 2 outer syncs
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
    assert plugin.inner_step == 4 and plugin.engine.stats["outer_steps"] == 2
    assert 0 < plugin.metrics()["diloco/compute_utilization"] <= 1
    # One worker, outer SGD with lr 1 and no momentum: theta_g follows the model exactly.
    for name, param in model.named_parameters():
        assert torch.equal(plugin.global_parameters()[name], param.detach()), name
    plugin.close()


def test_a_step_the_scaler_skipped_still_steps_the_engine():
    """Each worker's GradScaler skips its own steps; the schedule must count them all to stay in step with the others."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True)
    plugin = DiLoCoPlugin(inner_steps=2, outer_lr=1.0, outer_momentum=0.0, environ={})
    model = build_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(random_token_rows(8), batch_size=2)
    model, optimizer, loader = plugin.prepare(accelerator, model, optimizer, loader)
    for index, batch in enumerate(loader):  # 4 inner steps, the second reported as skipped by the scaler
        accelerator.backward(model(**batch).loss)
        optimizer._is_overflow = index == 1  # what `step_was_skipped` reads; a GradScaler sets it in `step()`
        optimizer.step()
        optimizer.zero_grad()
    assert plugin.inner_step == 4 and plugin.engine.stats["outer_steps"] == 2
    plugin.close()


def _loop_of_epochs(epochs: int, caplog) -> list[str]:
    """A raw loop that decides its epochs itself (no `max_steps` to `prepare`): 4 inner steps per epoch, H = 2, outer
    momentum 0.9 (it remembers about 10 rounds). Returns the warnings the plugin logged, start to `close()`."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    caplog.clear()
    plugin = DiLoCoPlugin(inner_steps=2, outer_momentum=0.9, environ={})
    model = build_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(random_token_rows(8), batch_size=2)
    model, optimizer, loader = plugin.prepare(Accelerator(cpu=True), model, optimizer, loader)
    for _ in range(epochs):
        for batch in loader:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    plugin.close()
    assert plugin.outer_rounds == 2 * epochs
    return [record.getMessage() for record in caplog.records if "remembers about" in record.getMessage()]


@pytest.mark.timeout(120)
def test_outer_momentum_warning_counts_the_rounds_of_the_whole_run(caplog):
    """12 epochs of 2 rounds are 24 rounds, more than twice what the momentum remembers: no warning. One epoch of 2
    rounds is warned about, with the run's count, once the run has ended (the plugin cannot know it before)."""
    with caplog.at_level("WARNING"):
        long_run = _loop_of_epochs(12, caplog)
        short_run = _loop_of_epochs(1, caplog)
    assert long_run == []
    assert len(short_run) == 1 and "this run has only 2 (4 inner steps / inner_steps=2)" in short_run[0]


# ------------------------------------------------------------------------------------------------ 2-process loop

H, STEPS, SAVE_AT, BATCH, LR, WORKERS = 4, 10, 6, 2, 3e-3, 2


def _reference() -> dict[str, torch.Tensor]:
    """Plain-torch DiLoCo over 2 simulated workers (AdamW inside, Nesterov SGD outside, lr 0.7, momentum 0.9).

    Accelerate's sharded loader hands batch i of the unshuffled loader to process i % 2, so worker w's step t reads
    batch 2 (t - 1) + w."""
    rows = random_token_rows(1024)
    models = [build_model(0) for _ in range(WORKERS)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    glob = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    momentum: dict[str, torch.Tensor] = {}
    for t in range(1, STEPS + 1):
        for w, (model, optimizer) in enumerate(zip(models, optimizers)):
            start = (2 * (t - 1) + w) * BATCH
            batch = {k: torch.stack([r[k] for r in rows[start : start + BATCH]]) for k in ("input_ids", "labels")}
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if t % H:
            continue
        params = [dict(m.named_parameters()) for m in models]
        for name in glob:
            delta = sum(glob[name] - p[name].detach() for p in params) / WORKERS
            momentum[name] = delta if name not in momentum else 0.9 * momentum[name] + delta
            glob[name] = glob[name] - 0.7 * (delta + 0.9 * momentum[name])
            with torch.no_grad():
                for p in params:
                    p[name].copy_(glob[name])
    if STEPS % H:  # close(): the steps after the last round join theta_g as a plain average
        params = [dict(m.named_parameters()) for m in models]
        glob = {name: sum(p[name].detach() for p in params) / WORKERS for name in glob}
    return glob


@pytest.fixture(scope="module")
def torchrun_loop(tmp_path_factory):
    out = tmp_path_factory.mktemp("plugin_loop")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DILOCO_INNER_STEPS=str(H))
    command = [
        str(Path(sys.executable).parent / "torchrun"),
        "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(REPO / "tests" / "scripts" / "plugin_loop.py"), str(out), str(SAVE_AT),
        "--use_cpu", "--max_steps", str(STEPS), "--batch_size", str(BATCH), "--learning_rate", str(LR),
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (out / "stderr.txt").write_text(result.stderr)
    return out, [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.timeout(450)
def test_start_up_line_without_max_steps_counts_one_epoch_and_says_so(torchrun_loop):
    """`prepare` without `max_steps` (the loop decides how many epochs it runs): 8 rows over 2 processes in
    batches of 2."""
    stderr = (torchrun_loop[0] / "stderr.txt").read_text()
    assert "in 2 steps per epoch of the first dataloader (pass max_steps to prepare for the whole run)" in stderr


@pytest.mark.timeout(450)
def test_two_process_loop_matches_reference_and_ranks_agree(torchrun_loop):
    out, ranks = torchrun_loop
    reference = _reference()
    initial = dict(build_model(0).named_parameters())
    for rank in ranks:
        run = rank["full"]
        assert run["inner_step"] == STEPS and run["stats"]["outer_steps"] == STEPS // H
        assert run["stats"]["final_syncs"] == 1
        for name, value in reference.items():
            assert torch.equal(run["global"][name], ranks[0]["full"]["global"][name]), name
            torch.testing.assert_close(run["global"][name], value, atol=1e-6, rtol=0)
            assert not torch.equal(value, initial[name].detach()), f"{name} did not train"
            # plugin.close() leaves the model holding theta_g.
            assert torch.equal(run["local"][name], run["global"][name]), name
        numel = sum(v.numel() for v in reference.values())
        per_sync = 2 * (WORKERS - 1) * 4 * -(-numel // WORKERS)  # all_to_all + all_gather of fp32 halves
        per_sync += (WORKERS - 1) * (24 + 4)  # the schedule tag every worker checks first, the norm clipping gathers
        assert run["stats"]["bytes_sent"] == (STEPS // H + 1) * per_sync  # the rounds and the final tail sync


@pytest.mark.timeout(450)
def test_resume_from_accelerate_save_state_is_bitwise(torchrun_loop):
    """accelerator.save_state at step 6 (mid-round: the workers' parameters differ from theta_g) and load_state in a
    new loop continue exactly as the uninterrupted run, on both ranks."""
    out, ranks = torchrun_loop
    for rank_index, rank in enumerate(ranks):
        state = torch.load(out / "full" / f"state-{SAVE_AT}" / f"diloco_state_rank{rank_index}.pt", weights_only=True)
        assert state["engine"]["inner_step"] == SAVE_AT
        assert not torch.equal(state["engine"]["local"][0], state["engine"]["global"][0])
        for name, value in rank["full"]["global"].items():
            assert torch.equal(rank["resumed"]["global"][name], value), name
            assert torch.equal(rank["resumed"]["local"][name], rank["full"]["local"][name]), name
    local_at_save = [
        torch.load(out / "full" / f"state-{SAVE_AT}" / f"diloco_state_rank{r}.pt")["engine"]["local"][0]
        for r in range(2)
    ]
    assert not torch.equal(*local_at_save), "the two workers must have read different shards"


@pytest.mark.timeout(450)
def test_saved_global_model_loads_and_has_card(torchrun_loop):
    out, ranks = torchrun_loop
    model = AutoModelForCausalLM.from_pretrained(out / "full" / "final")
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), ranks[0]["full"]["global"][name]), name
    assert has_diloco_tag(out / "full" / "final" / "README.md")


@pytest.mark.timeout(450)
def test_shuffled_loader_gets_the_seedable_sampler(torchrun_loop):
    """On 2 processes a shuffled loader would have Accelerate broadcast its random state across workers every epoch;
    the plugin gives it the seedable sampler instead (one seed, agreed at start-up), whatever the accelerator's
    dataloader configuration says."""
    _, ranks = torchrun_loop
    for rank in ranks:
        assert rank["shuffled_default"] is None
        assert rank["shuffled_seedable"] is None


# ------------------------------------------------------------------------------------------------ no transformers


@pytest.mark.timeout(300)
def test_accelerate_path_never_imports_transformers(tmp_path):
    """`from hf_diloco import DiLoCoPlugin` and a plugin loop (DDP inside a worker of 2 processes, save_state and
    load_state) in processes where `import transformers` fails: they train, save and never ask for it."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [
        str(Path(sys.executable).parent / "torchrun"),
        "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(REPO / "tests" / "scripts" / "plugin_without_transformers.py"), str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=250)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for rank in range(2):
        assert (
            f"rank {rank}: inner_step=6 outer_steps=3 ddp=DistributedDataParallel saved=True "
            "transformers_imported=False blocked=[]"
        ) in result.stdout, result.stdout[-3000:]

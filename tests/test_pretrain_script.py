"""The main job end to end: `scripts/pretrain.py` (a thin wrapper of `hf-diloco pretrain`) on 1 process and on 2
processes (torchrun, gloo); re-running a finished, crashed, refused or incompatible output folder; bad input refused
before any work; inputs that differ between ranks and a stalled peer at the job's own global points; every shipped
config parses."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from hf_diloco.cli.pretrain_arguments import parse_command_line
from hf_diloco.job.config_file import shipped_config_names, shipped_config_text
from tests.cpu_limit import CpuLimit, children_with_environment, cpu_limit_available
from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "pretrain.py"
README = ROOT / "README.md"
PER_RANK_SCRIPT = ROOT / "tests" / "scripts" / "pretrain_per_rank.py"
STEPS = 8
SECRET_TOKEN = "hf_ddpBaselineSecretToken"


def _small_config(tmp_path: Path, trainer: str = "diloco") -> Path:
    config = yaml.safe_load(shipped_config_text(f"tiny_{trainer}"))
    config["data"].update(max_train_samples=12, max_eval_samples=2, block_size=64)
    config["tokenizer"]["vocab_size"] = 512
    config["model"]["config"].update(hidden_size=32, num_hidden_layers=2, intermediate_size=64)
    config["training"].update(
        max_steps=STEPS, logging_steps=2, eval_steps=4, save_steps=4, per_device_train_batch_size=2, warmup_steps=0
    )
    if trainer == "diloco":
        config["diloco"].update(inner_steps=4)
    path = tmp_path / f"{trainer}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("DILOCO_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(ROOT)
    return {**env, **(extra or {})}


def _start(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    # A session of its own, so that on a timeout the launch is ended as a whole, never left behind.
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=_environment(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(process: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun puts each rank in a process group of its own: SIGTERM lets it end them before it exits.
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _run(
    command: list[str], timeout: int = 420, expect_success: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    result = _finish(_start(command, env), timeout)
    if expect_success:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def _run_together(commands: list[tuple[list[str], dict[str, str]]], timeout: int = 300) -> list[tuple[int, str]]:
    """Run several (command, extra environment) pairs, at most four at a time; each one's exit status and stderr."""
    results = []
    for start in range(0, len(commands), 4):
        processes = [_start(command, env) for command, env in commands[start : start + 4]]
        results += [(result.returncode, result.stderr) for result in (_finish(p, timeout) for p in processes)]
    return results


def hold_output_folder_in_a_process(folder: Path) -> subprocess.Popen:
    """A real process holding `folder`'s output-folder lock until its stdin closes (or it is killed)."""
    code = (
        "import sys; from hf_diloco.integrations.output_lock import acquire_output_folder; "
        "acquire_output_folder(sys.argv[1]); print('held', flush=True); sys.stdin.readline()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=_environment(),
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


def _snapshot(folder: Path) -> dict[Path, tuple[int, int]]:
    return {path: (path.stat().st_size, path.stat().st_mtime_ns) for path in folder.rglob("*") if path.is_file()}


def _torchrun(processes: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
        "--master_port", str(free_port()),
    ]  # fmt: skip


def _check_output_folder(output_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    ids = tokenizer("def main():\n    return 0\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 256
    metrics = json.loads((output_dir / "all_results.json").read_text())
    assert metrics["eval_loss"] < 7.0  # log(512) = 6.24 at random; a few steps already move below ~6.3
    if "eval_tokens" in metrics:  # scored by the shipped evaluate module (not for the pipelined/DDP-free paths)
        # eval_loss is the Trainer's mean of batch means (padded and gathered across ranks), the perplexity exp of
        # the NLL per scored token: equal up to the last uneven batch, which moves them apart by ~1e-4 on 2 ranks.
        assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-3)
        assert metrics["eval_tokens"] > 0


def _assert_card_quotes_all_results(output_dir: Path) -> None:
    """The card's results section lists every figure of all_results.json; its model-index, the evaluation's."""
    results = json.loads((output_dir / "all_results.json").read_text())
    card = (output_dir / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    [index] = front["model-index"]
    quoted = {metric["name"]: metric["value"] for metric in index["results"][0]["metrics"]}
    assert quoted == {k: v for k, v in results.items() if k.startswith("eval_") and not _timing(k)}
    section = card.split("## Evaluation results")[1].split("##")[0]
    assert "after training" in section
    table = dict(re.findall(r"^\| (\w+) \| ([\d.,e+-]+) \|$", section, flags=re.M))
    assert set(table) == set(results)
    for key, text in table.items():
        assert float(text.replace(",", "")) == pytest.approx(results[key], rel=1e-5), key


def _timing(key: str) -> bool:
    return key.endswith(("_runtime", "_samples_per_second", "_steps_per_second"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One worker; in its folder a first start on a 3-line corpus was refused, after it had trained a tokenizer."""
    out = tmp_path_factory.mktemp("pretrain_1")
    output_dir = out / "out1"
    corpus = out / "three_lines.txt"
    corpus.write_text("def f():\n    return 1\nprint(f())\n")
    refused = yaml.safe_load(_small_config(out).read_text())
    refused["data"] = {"path": "text", "data_files": {"train": str(corpus), "validation": str(corpus)}}
    (out / "refused.yaml").write_text(yaml.safe_dump(refused))
    start = [sys.executable, str(SCRIPT), "--output_dir", str(output_dir), "--config"]
    first = _run([*start, str(out / "refused.yaml")], expect_success=False)
    assert first.returncode != 0 and "Use more data" in first.stderr, first.stderr[-3000:]
    shutil.copytree(output_dir / "tokenizer", out / "refused_tokenizer")
    result = _run([*start, str(_small_config(out))])
    return output_dir, result


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """2 workers, 2 fragments with one step of delay (tau > 0: `close()` changes theta_g after the last evaluation
    during training), with command-line overrides of the training, DiLoCo and config sections; rounds by speed
    (`round_policy: balanced`, whose plan here stays H = 4: P (tau + 1) = 4 is the shortest round)."""
    out = tmp_path_factory.mktemp("pretrain_2")
    output_dir = out / "out2"
    overrides = ["--use_cpu", "--num_fragments", "2", "--sync_delay", "1", "--data.block_size", "32"]
    overrides += ["--round_policy", "balanced"]
    # DILOCO_* variables sit between the command line and the config's diloco: section.
    variables = {"DILOCO_NUM_FRAGMENTS": "4", "DILOCO_OUTER_LR": "0.25"}
    result = _run(
        _torchrun(2) + [str(SCRIPT), "--config", str(_small_config(out)), "--output_dir", str(output_dir), *overrides],
        env=variables,
    )
    return output_dir, result


@pytest.mark.timeout(480)
def test_pretrain_single_process(one_process):
    output_dir, result = one_process
    _check_output_folder(output_dir)
    _assert_card_quotes_all_results(output_dir)
    assert (output_dir / "checkpoint-4" / "diloco_state_rank0.pt").is_file()
    assert "DiLoCo run: 1 worker x 1 data-parallel rank x 1 pipeline stage = 1 process; H=4" in result.stderr
    assert "tau=0, overlap=none (each exchange blocks)" in result.stderr  # streaming with tau = 0 hides nothing
    # TensorBoard by default where it is installed (the plots extra), and a line saying where the logs are.
    assert f"Logs: TensorBoard in {output_dir}/runs" in result.stderr
    assert list((output_dir / "runs").rglob("events.out.tfevents.*"))
    # The refused first start's tokenizer (3 lines of text) was provisional: this run trained its own, and kept it.
    refused = json.loads((output_dir.parent / "refused_tokenizer" / "hf_diloco_tokenizer.json").read_text())
    kept = json.loads((output_dir / "tokenizer" / "hf_diloco_tokenizer.json").read_text())
    assert refused["provisional"] and "provisional" not in kept
    assert kept["fingerprint"] != refused["fingerprint"]
    assert "stopped before training; training this run's tokenizer again" in result.stderr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(output_dir / "tokenizer")
    assert len(tokenizer) == 512 > len(AutoTokenizer.from_pretrained(output_dir.parent / "refused_tokenizer"))


@pytest.mark.timeout(480)
def test_pretrain_two_processes_and_command_line_overrides(two_processes):
    output_dir, result = two_processes
    _check_output_folder(output_dir)
    _assert_card_quotes_all_results(output_dir)
    state = json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    logged = [entry for entry in state["log_history"] if "diloco/bytes_sent" in entry]
    assert logged and logged[-1]["diloco/bytes_sent"] > 0  # two workers really exchanged
    assert {"diloco/outer_steps", "diloco/sync_wait_seconds", "diloco/pseudo_grad_norm"} <= set(logged[-1])
    saved = torch.load(output_dir / f"checkpoint-{STEPS}" / "diloco_state_rank1.pt", weights_only=True)
    assert len(saved["engine"]["global"]) == 2  # the --num_fragments override reached the engine
    # The --data.block_size override reached the data: 32 tokens per row, 8 x 2 x 2 rows seen.
    assert logged[-1]["num_input_tokens_seen"] == STEPS * 2 * 32
    # The last evaluation during training (step 8) was taken before close() merged the in-flight fragment.
    during = [e["eval_loss"] for e in state["log_history"] if "eval_loss" in e and e["step"] == STEPS]
    final = json.loads((output_dir / "all_results.json").read_text())["eval_loss"]
    assert during and during[-1] != final
    assert (
        f"Final model: eval_loss {final:.4f} (all_results.json, the card), after the last outer sync" in result.stderr
    )
    summary = "DiLoCo run: 2 workers x 1 data-parallel rank x 1 pipeline stage = 2 processes; H=4, P=2, tau=1"
    assert result.stderr.count(summary) == 1, "one start-up line, on the main process only"
    args = torch.load(output_dir / "training_args.bin", weights_only=False)
    # --num_fragments over DILOCO_NUM_FRAGMENTS; DILOCO_OUTER_LR over the config's 0.5; the config's momentum.
    assert (args.num_fragments, args.outer_lr, args.outer_momentum) == (2, 0.25, 0.5)
    assert args.round_policy == "balanced"
    steps = json.loads((output_dir / f"checkpoint-{STEPS}" / "diloco_worker_steps.json").read_text())
    assert steps == {"inner_steps_per_worker": [STEPS, STEPS]}
    # Progress bars on the main process only: one tokenization bar per split, not one per split and rank.
    assert result.stderr.count("Tokenizing:   0%") == 2


@pytest.mark.timeout(480)
def test_checkpoints_store_each_piece_of_state_once(two_processes):
    """Each rank's inner optimizer and grad scaler live in its DiLoCo state file only; the LR schedule in scheduler.pt."""
    output_dir, _ = two_processes
    checkpoint = output_dir / f"checkpoint-{STEPS}"
    names = {path.name for path in checkpoint.iterdir()}
    assert "optimizer.pt" not in names and "scaler.pt" not in names
    assert {"scheduler.pt", "diloco_state_rank0.pt", "diloco_state_rank1.pt"} <= names


@pytest.mark.timeout(300)
def test_pretrain_ddp_baseline_writes_no_hub_token(tmp_path):
    output_dir = tmp_path / "ddp"
    config = _small_config(tmp_path, "ddp")
    _run(
        [
            sys.executable,
            str(SCRIPT),
            "--config",
            str(config),
            "--output_dir",
            str(output_dir),
            "--hub_token",
            SECRET_TOKEN,
        ]
    )
    _check_output_folder(output_dir)
    written = [path for path in output_dir.rglob("*") if path.is_file()]
    assert any(path.name == "training_args.bin" for path in written)
    assert not [path for path in written if SECRET_TOKEN.encode() in path.read_bytes()]


@pytest.mark.timeout(300)
def test_rerun_of_a_finished_folder_leaves_it_and_names_the_ways_out(one_process, tmp_path):
    output_dir, _ = one_process
    before = _snapshot(output_dir)
    result = _run(
        [sys.executable, str(SCRIPT), "--config", str(_small_config(tmp_path)), "--output_dir", str(output_dir)]
    )
    assert "already holds a finished run" in result.stderr
    assert "--output_dir" in result.stderr and "--auto_resume false" in result.stderr
    assert _snapshot(output_dir) == before  # the tokenizer too: loaded, never retrained or rewritten


@pytest.mark.timeout(300)
def test_a_crash_after_the_final_checkpoint_saves_the_final_model_without_training(one_process, tmp_path):
    """The job stopped after writing its last checkpoint, before saving the final model: a re-run saves that
    checkpoint's model with its evaluation and card, and trains nothing."""
    output_dir = tmp_path / "crashed"
    shutil.copytree(one_process[0], output_dir)
    for name in ("model.safetensors", "all_results.json", "README.md"):
        (output_dir / name).unlink()
    tokenizer = _snapshot(output_dir / "tokenizer")
    result = _run(
        [sys.executable, str(SCRIPT), "--config", str(_small_config(tmp_path)), "--output_dir", str(output_dir)]
    )
    assert f"holds a finished run without its final model: saving checkpoint-{STEPS}'s model" in result.stderr
    last = output_dir / f"checkpoint-{STEPS}"
    assert (output_dir / "model.safetensors").read_bytes() == (last / "model.safetensors").read_bytes()
    _assert_card_quotes_all_results(output_dir)
    assert not (output_dir / f"checkpoint-{STEPS + 4}").exists()
    assert _snapshot(output_dir / "tokenizer") == tokenizer


def test_a_damaged_final_model_is_reported_never_overwritten(one_process, tmp_path):
    """A finished run whose final model.safetensors is truncated: the main job's check before it saves the final
    model again names the file and the way out; an absent or intact file passes."""
    from hf_diloco.integrations.atomic_checkpoints import CheckpointError, refuse_a_damaged_final_model

    output_dir = tmp_path / "damaged"
    shutil.copytree(one_process[0], output_dir)
    last = output_dir / f"checkpoint-{STEPS}"
    refuse_a_damaged_final_model(output_dir, last)  # intact
    with open(output_dir / "model.safetensors", "r+b") as handle:
        handle.truncate(100)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not the final model of this finished run "
                       r"\(100 bytes, the checkpoint's \d+\).*Nothing was written.*move that file aside"):  # fmt: skip
        refuse_a_damaged_final_model(output_dir, last)
    assert (output_dir / "model.safetensors").stat().st_size == 100  # left for the user
    (output_dir / "model.safetensors").unlink()
    refuse_a_damaged_final_model(output_dir, last)  # absent: the final save may write it


@pytest.mark.timeout(480)
def test_checkpoints_of_which_none_verifies_stop_the_run_and_auto_resume_false_keeps_them(one_process, tmp_path):
    """A folder whose checkpoints are all refused: the run stops before any work and changes nothing; with
    `auto_resume: "false"` (a string, in the YAML) it starts over and moves the refused checkpoints aside."""
    output_dir = tmp_path / "refused"
    shutil.copytree(one_process[0], output_dir)
    for step in (4, STEPS):
        with open(output_dir / f"checkpoint-{step}" / "model.safetensors", "r+b") as handle:
            handle.truncate(100)
    refused = {step: (output_dir / f"checkpoint-{step}" / "model.safetensors").read_bytes() for step in (4, STEPS)}
    before = _snapshot(output_dir)
    command = [sys.executable, str(SCRIPT), "--output_dir", str(output_dir)]
    result = _run([*command, "--config", str(_small_config(tmp_path))], expect_success=False)
    assert result.returncode != 0
    assert "holds checkpoints from an earlier run, but none of them can be resumed from" in result.stderr
    assert "Nothing was trained, deleted or overwritten" in result.stderr and "--auto_resume false" in result.stderr
    assert _snapshot(output_dir) == before
    start_over = tmp_path / "start_over.yaml"
    start_over.write_text(_small_config(tmp_path).read_text() + "auto_resume: 'false'\n")
    _run([*command, "--config", str(start_over)])
    for step, weights in refused.items():
        assert (output_dir / f"refused-checkpoint-{step}" / "model.safetensors").read_bytes() == weights
    assert json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())["global_step"] == STEPS


@pytest.mark.timeout(480)
def test_bad_input_is_refused_by_the_command_before_any_work(one_process, tmp_path):
    """Each case fails with a message that names the input and the fix, before the run's tokenizer is fixed (or, in
    an existing folder, before anything in it changes)."""
    config = _small_config(tmp_path)
    files = {"syntax": "trainer: diloco\ndiloco:\n  inner_steps: [4\n", "empty": "# nothing\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    (tmp_path / "flase.yaml").write_text(config.read_text() + "auto_resume: flase\n")
    existing = tmp_path / "existing"
    shutil.copytree(one_process[0], existing)

    def _file(name: str) -> list[str]:
        return ["--config", str(tmp_path / f"{name}.yaml")]

    cases = {
        "syntax": (_file("syntax"), {}, r"syntax\.yaml is not valid YAML at line 4, column 1"),
        "empty": (_file("empty"), {}, r"empty\.yaml is empty: it would run the whole default"),
        "flase": (_file("flase"), {}, r"auto_resume in .*flase\.yaml must be true or false, got 'flase'"),
        "positions": (["--data.block_size", "300"], {}, r"data\.block_size is 300 tokens but the model has only 256 "
                      r"positions"),
        "device": (["--global_copy_device", "cuda:99"], {}, r"global_copy_device 'cuda:99' names a device this "
                   r"machine does not have"),
        "variable": ([], {"DILOCO_INNER_STEPS": "0"}, r"inner_steps must be >= 1, got 0\. \(set: inner_steps by "
                     r"DILOCO_INNER_STEPS\)"),
        "ddp_variable": (["--config", str(_small_config(tmp_path, "ddp"))], {"DILOCO_COMPRESSION": "fp4"},
                         r"DILOCO_COMPRESSION set in the environment, but this run has trainer: ddp"),
        "workers": (["--pipeline_stages", "2"], {}, r"world size 1 is not divisible by the worker size"),
        "offline_push": (["--push_to_hub", "true"], {}, r"HF_HUB_OFFLINE is set: pushing the final model "
                         r"\(push_to_hub\) to offline_push needs the network"),
        "tokenizer": (["--output_dir", str(existing), "--tokenizer.vocab_size", "600", "--max_steps", "12"], {},
                      r"This run's tokenizer in .*existing/tokenizer was trained with `tokenizer:` .*'vocab_size': "
                      r"512.*but the config now says .*'vocab_size': 600"),
        "locked": ([], {}, r"The output folder .*locked is in use by another job: pid \d+ on host .*Wait for it to "
                   r"finish .*or give this run its own folder with --output_dir"),
        "no_secret": (["--lighthouse", "http://127.0.0.1:1", "--site", "site-a"],
                      {"HF_DILOCO_JOB_SECRET": "", "HF_DILOCO_JOB_SECRET_FILE": ""},
                      r"elastic membership \(lighthouse\) needs the job's secret, so that no process outside the job "
                      r"can join it, .* insecure_no_secret: true runs without one\."),
    }  # fmt: skip
    before = _snapshot(existing)
    commands = []
    for name, (flags, env, _) in cases.items():
        output = ["--output_dir", str(tmp_path / name)] if "--output_dir" not in flags else []
        commands.append(([sys.executable, str(SCRIPT), "--config", str(config), *output, *flags], env))
    holder = hold_output_folder_in_a_process(tmp_path / "locked")  # another job's lock on the folder
    try:
        results = _run_together(commands)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    for (name, (_, _, expected)), (returncode, stderr) in zip(cases.items(), results):
        assert returncode == 2, name
        assert re.search(expected, stderr), f"{name}: {stderr[-3000:]}"
        # One clean line, the message, with no traceback around it.
        assert "Traceback" not in stderr and stderr.count("hf-diloco: error: ") == 1, f"{name}: {stderr[-3000:]}"
        assert not (tmp_path / name / "tokenizer").exists(), name
    assert f"pid {holder.pid} on host" in results[list(cases).index("locked")][1]
    assert _snapshot(existing) == before


@pytest.mark.timeout(300)
def test_ranks_that_built_different_tokenizers_and_data_are_refused_at_start(tmp_path):
    """Without a shared disk every node trains its own tokenizer into its own folder: nodes that did so from other
    settings (here another data seed) fail at start, naming the inputs that differ."""
    per_rank = ["--output_dir", str(tmp_path / "rank{rank}"), "--data.seed", "{rank}"]
    result = _run(
        _torchrun(2) + [str(PER_RANK_SCRIPT), "--config", str(_small_config(tmp_path)), "--use_cpu", *per_rank],
        expect_success=False,
    )
    assert result.returncode != 0
    for name in ("tokenizer", "train_data", "validation_data"):
        assert f"{name}: ranks [1] disagree with rank 0" in result.stderr, result.stderr[-4000:]
    assert not (tmp_path / "rank0" / "checkpoint-4").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("step", "point"),
    [
        ("load_text_dataset", "the run's tokenizer (trained or loaded by rank 0 first)"),
        ("train_and_evaluate", "the end of the job"),
    ],
)
def test_a_stalled_peer_at_the_jobs_own_global_points_fails_within_the_bound(tmp_path, step, point):
    bound = 6
    command = [str(PER_RANK_SCRIPT), "--stall_rank_1_after", step, "--config", str(_small_config(tmp_path)),
               "--use_cpu", "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--save_steps", "2",
               "--sync_timeout_seconds", str(bound)]  # fmt: skip
    started = time.monotonic()
    result = _run(_torchrun(2) + command, timeout=240, expect_success=False)
    assert result.returncode != 0
    assert f"rank 1 stalls after {step}" in result.stderr
    assert f"Rank(s) [1] did not reach {point} within sync_timeout_seconds={bound} s" in result.stderr, result.stderr[
        -4000:
    ]
    assert time.monotonic() - started < 200  # the default bound of every wait (ddp_timeout) is 1800 s


@pytest.mark.timeout(300)
def test_checkpoint_of_another_process_count_is_refused_naming_the_ways_out(two_processes, tmp_path):
    """What `make run` after `make run-multi` met when both wrote one folder: a finished run is finished whatever
    the process count (exit 0, nothing written); one to continue is refused before any work."""
    output_dir, _ = two_processes
    before = {path: path.stat().st_mtime_ns for path in output_dir.rglob("*") if path.is_file()}
    command = [sys.executable, str(SCRIPT), "--config", str(_small_config(tmp_path)), "--output_dir", str(output_dir)]
    finished = _run(command)
    assert "already holds a finished run" in finished.stderr, finished.stderr[-3000:]
    assert "written by" not in finished.stderr
    assert {path: path.stat().st_mtime_ns for path in output_dir.rglob("*") if path.is_file()} == before
    result = _run([*command, "--max_steps", str(2 * STEPS)], expect_success=False)
    assert result.returncode != 0
    message = result.stderr[-3000:]
    assert "written by 2 processes and this run has 1" in message, message
    assert "--output_dir" in message and "--auto_resume false" in message
    assert {path: path.stat().st_mtime_ns for path in output_dir.rglob("*") if path.is_file()} == before


# The README's commands shortened: the same commands and configs, a smaller model, data and schedule (one round of
# H = 8 and 4 blocks: the streaming config's 4 fragments need a block each, and sync_delay 1 needs H/P > 1).
SHORT_RUN = [
    "--max_steps", "8", "--eval_steps", "4", "--save_steps", "4", "--logging_steps", "1",
    "--warmup_steps", "0", "--per_device_train_batch_size", "2", "--data.max_train_samples", "12",
    "--data.max_eval_samples", "2", "--data.block_size", "64", "--tokenizer.vocab_size", "512",
    "--model.config.hidden_size", "32", "--model.config.num_hidden_layers", "4", "--model.config.intermediate_size", "64",
]  # fmt: skip
SHORT_DILOCO = ["--inner_steps", "8"]  # a DiLoCo flag: refused with trainer: ddp


def _readme_start_here() -> list[list[str]]:
    """The commands of the README's "Start here", in order: `make run` (what `make -n run` runs), then the training
    commands of the block after it."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text().split("## Start here")[1], flags=re.S)
    first = next(index for index, block in enumerate(blocks) if re.search(r"^make run\b", block, flags=re.M))
    venv = Path(sys.executable).parent.parent
    make = subprocess.run(["make", "-n", "run", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    [make_run] = [line for line in make.stdout.replace("\\\n", " ").splitlines() if "scripts/pretrain.py" in line]
    commands = [shlex.split(make_run)]
    for line in blocks[first + 1].splitlines():
        words = shlex.split(line.split("#")[0])
        if words and words[0] in ("hf-diloco", "torchrun") and "--help" not in words and "plot" not in words:
            commands.append(words)
    return commands


def _shortened(words: list[str]) -> list[str]:
    """A README command with its program from this virtualenv and the short schedule; launches get a free port."""
    command = [str(Path(sys.executable).parent / words[0]), *words[1:], *SHORT_RUN]
    if "tiny_ddp" not in words:
        command += SHORT_DILOCO
    if words[:2] == ["hf-diloco", "launch"]:
        command[2:2] = ["--master_port", str(free_port())]
    return command


@pytest.mark.timeout(900)
def test_the_readme_commands_after_make_run_each_train_in_a_folder_of_their_own(tmp_path):
    """In a fresh folder, as a newcomer types them: `make run`, then the README's three next commands (DDP on the same
    job, two workers, Streaming DiLoCo on two workers); each trains and saves a model in its own folder. The same
    command again finds its run done."""
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")  # `make run` names scripts/pretrain.py from a checkout
    commands = _readme_start_here()
    assert [words[:2] for words in commands[1:]] == [
        ["hf-diloco", "pretrain"],
        ["hf-diloco", "launch"],
        ["hf-diloco", "launch"],
    ]
    folders = []
    for words in commands:
        result = _finish(subprocess.Popen(_shortened(words), cwd=tmp_path, env=_environment(), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True), 420)  # fmt: skip
        assert result.returncode == 0, result.stderr[-4000:]
        assert "already holds a finished run" not in result.stderr, result.stderr[-3000:]
        folder = json.loads(result.stdout[result.stdout.index("{\n") :])["output_dir"]
        assert (tmp_path / folder / "model.safetensors").is_file()
        assert (tmp_path / folder / "README.md").is_file() or "tiny_ddp" in words  # the DiLoCo model card
        folders.append(folder)
    assert folders == [
        "outputs/make_run/tiny_diloco", "outputs/tiny_ddp", "outputs/tiny_diloco_2proc", "outputs/streaming_diloco_2proc"
    ]  # fmt: skip
    result = _finish(subprocess.Popen(_shortened(commands[1]), cwd=tmp_path, env=_environment(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True), 300)  # fmt: skip
    assert result.returncode == 0 and "outputs/tiny_ddp already holds a finished run" in result.stderr


def test_makefile_runs_use_separate_folders():
    make = subprocess.run(["make", "-n", "run", "run-multi"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    folders = re.findall(r"--output_dir (\S+)", make.stdout)
    assert len(folders) == 2 and folders[0] != folders[1], make.stdout


@pytest.mark.parametrize("name", shipped_config_names())
def test_every_shipped_config_parses(name):
    command_line = parse_command_line(["--config", name, "--use_cpu"])
    assert command_line.args.output_dir == f"outputs/{name}"
    assert command_line.auto_resume is True


@pytest.mark.skipif(not cpu_limit_available(), reason="capping one site's CPU needs root and a cgroup cpu controller")
@pytest.mark.timeout(300)
def test_pretrain_with_a_site_at_half_a_cpu_keeps_the_other_busy(tmp_path):
    """Two workers, the second capped by the kernel to half a CPU (a site on slower hardware), `round_policy:
    balanced`: the slow worker runs fewer steps per round and the fast one waits far less than half of each round
    (under `steps` it waits about half: 0.46-0.60 a round measured here, against 0.02-0.40 with `balanced`)."""
    path = _small_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["training"].update(max_steps=48, logging_steps=8, eval_steps=24, save_steps=24)
    config["diloco"].update(inner_steps=8, round_policy="balanced")
    path.write_text(yaml.safe_dump(config))
    output_dir = tmp_path / "out"
    limit, process = CpuLimit(0.5), None
    try:
        process = _start(
            _torchrun(2) + [str(SCRIPT), "--config", str(path), "--output_dir", str(output_dir), "--use_cpu"]
        )
        deadline = time.monotonic() + 60
        while not (slow := children_with_environment(process.pid, "RANK", "1")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slow, "torchrun started no rank 1"
        limit.add(slow[0])  # seconds of imports and set-up before its first step: it is capped from the start
        result = _finish(process, 240)
    finally:
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        limit.close()
    assert result.returncode == 0, result.stderr[-5000:]
    steps = json.loads((output_dir / "checkpoint-48" / "diloco_worker_steps.json").read_text())[
        "inner_steps_per_worker"
    ]
    # The fast worker runs whole rounds (8 steps) unless another job's load on the machine makes it the slower one
    # for a round (measured beside a `make run` loop: 47 of 48); the capped worker runs far fewer.
    assert 42 <= steps[0] <= 48 and steps[1] <= 0.85 * steps[0], steps
    state = json.loads((output_dir / "checkpoint-48" / "trainer_state.json").read_text())
    waits = [entry["diloco/wait_fraction"] for entry in state["log_history"] if "diloco/wait_fraction" in entry]
    assert len(waits) == 6 and sum(waits[1:]) / 5 < 0.4, waits  # rank 0 (the fast worker) logs each round

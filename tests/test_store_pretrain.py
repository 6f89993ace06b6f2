"""The main job through a store, as docs/how-to/store.md ("Sites that cannot reach each other") gives it: its three
commands, run together (shortened by flags) through the config's folder store: the three sites save the same model,
bit for bit, and their cards say how many sites contributed per round. Sites of other shapes (a torchrun of 2
pipeline stages beside one process) through moto's S3 server reached as a Hugging Face bucket do the same. A store
cut off longer than its bound stops the site with one message naming it, its checkpoint saved, and the same command
resumes it once the store answers; cut off for less, the run goes on."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.store_common import Blackout, free_port, s3_server, wait_all

ROOT = Path(__file__).resolve().parent.parent
HF_DILOCO = Path(sys.executable).parent / "hf-diloco"
TORCHRUN = Path(sys.executable).parent / "torchrun"
SHORT = ["--max_steps", "12", "--inner_steps", "4", "--eval_strategy", "no", "--save_strategy", "no",
         "--logging_steps", "4", "--per_device_train_batch_size", "2", "--warmup_steps", "0",
         "--data.max_train_samples", "12", "--data.max_eval_samples", "2", "--data.block_size", "64",
         "--tokenizer.vocab_size", "512", "--model.config.hidden_size", "32", "--model.config.num_hidden_layers", "2",
         "--model.config.intermediate_size", "64", "--grace_seconds", "1"]  # fmt: skip


def readme_site_commands() -> list[list[str]]:
    """The page's commands that start the three sites, in order."""
    text = (ROOT / "docs" / "how-to" / "store.md").read_text()
    section = text[text.index("# Sites that cannot reach each other") :]
    block = section[section.index("```bash") + len("```bash") : section.index("```", section.index("```bash") + 7)]
    lines = [line.split("#")[0].strip().rstrip("&").strip() for line in block.splitlines()]
    commands = [shlex.split(line) for line in lines if line.startswith("hf-diloco pretrain")]
    assert len(commands) == 3 and all("--site" in command for command in commands), block
    return commands


def _env(extra: dict | None = None) -> dict:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("DILOCO_", "AWS_"))}
    env.update(HF_DILOCO_JOB_SECRET="a secret the three sites share", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    return {**env, **(extra or {})}


def _run_sites(tmp_path: Path, store_url: str, env: dict) -> dict[str, Path]:
    processes, outputs = {}, {}
    for command in readme_site_commands():
        site = command[command.index("--site") + 1]
        output = tmp_path / "outputs" / f"sites_store_{site}"  # the default folder of a site
        argv = [str(HF_DILOCO), *command[1:], *SHORT, "--store_url", store_url]
        log = (tmp_path / f"{site}.log").open("wb")
        processes[site] = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        outputs[site] = output
    wait_all(processes, tmp_path, timeout=400)
    return outputs


def _check_one_model(tmp_path: Path, outputs: dict[str, Path], store: str) -> None:
    models = {site: load_file(str(output / "model.safetensors")) for site, output in outputs.items()}
    first = next(iter(models.values()))
    for site, model in models.items():
        assert model.keys() == first.keys() and all(model[k].equal(first[k]) for k in first), site
        log = (tmp_path / f"{site}.log").read_text()
        assert f"through the store {store}, site {site}" in log and "quorum 2 after a grace window of 1 s" in log
        card = (outputs[site] / "README.md").read_text()
        assert re.search(rf"sites per round (2-)?3 \(mean [\d.]+\) over \d+ rounds through the store {store}", card), (
            card
        )


@pytest.mark.timeout(600)
def test_the_readme_s_three_sites_train_one_model_through_a_folder_store(tmp_path):
    store = f"file://{tmp_path}/store"
    _check_one_model(tmp_path, _run_sites(tmp_path, store, _env()), store)


@pytest.mark.timeout(600)
def test_a_site_of_two_pipeline_stages_and_a_site_of_one_process_train_one_model_through_a_hugging_face_bucket(
    tmp_path,
):
    """Sites of different shapes through moto's S3 server reached as a Hugging Face bucket (hf://buckets/..., the
    gateway at AWS_ENDPOINT_URL): one `hf-diloco pretrain` process beside a torchrun of 2 pipeline stages; each stage
    writes and reads its own parameters' ranges, and both save the same model, bit for bit."""
    with s3_server("job-bucket") as env:
        store = "hf://buckets/my-org/job-bucket/job-1"
        common = ["pretrain", "--config", "sites_store", *SHORT, "--store_url", store, "--quorum", "2"]
        one = [str(HF_DILOCO), *common, "--site", "one"]
        two = [str(TORCHRUN), "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "hf_diloco", *common,
               "--site", "two", "--use_cpu", "--pipeline_stages", "2", "--pipeline_microbatches", "2"]  # fmt: skip
        processes = {}
        for site, argv in (("one", one), ("two", two)):
            log = (tmp_path / f"{site}.log").open("wb")
            processes[site] = subprocess.Popen(argv, cwd=tmp_path, env=_env(env), stdout=log, stderr=subprocess.STDOUT)
        wait_all(processes, tmp_path, timeout=400)
    outputs = {"one": tmp_path / "outputs" / "sites_store_one", "two": tmp_path / "outputs" / "sites_store_2proc_two"}
    models = {site: load_file(str(output / "model.safetensors")) for site, output in outputs.items()}
    assert models["one"].keys() == models["two"].keys()
    assert all(models["one"][k].equal(models["two"][k]) for k in models["one"])
    card = (outputs["two"] / "README.md").read_text()
    assert re.search(rf"sites per round 2 \(mean 2\) over \d+ rounds through the store {store}", card), card


@pytest.mark.timeout(600)
def test_a_store_cut_off_past_its_bound_stops_the_site_saved_and_the_same_command_resumes_it(tmp_path):
    with s3_server("job-bucket") as env:
        relay = Blackout(int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
        env = _env({**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{relay.port}"})
        argv = [str(HF_DILOCO), "pretrain", "--config", "sites_store", "--site", "alone", "--output_dir", "out",
                *SHORT, "--max_steps", "24", "--quorum", "1", "--store_timeout_seconds", "4",
                "--store_url", "s3://job-bucket/job"]  # fmt: skip
        log = tmp_path / "first.log"
        with log.open("wb") as out:
            process = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
            while "'diloco/inner_step': '8'" not in log.read_text(errors="replace") and process.poll() is None:
                time.sleep(0.05)
            relay.cut()  # longer than store_timeout_seconds
            process.wait(240)
        text = log.read_text(errors="replace")
        assert process.returncode == 2, text[-3000:]
        last = text.strip().splitlines()[-1]
        assert last.startswith("hf-diloco: error: The store s3://job-bucket/job did not answer for"), last
        assert "this site's checkpoint is saved and it resumes with the same command" in last
        saved = sorted((tmp_path / "out").glob("checkpoint-*"))
        assert saved, "no checkpoint was saved before stopping"
        relay.restore()
        again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
        assert "'diloco/inner_step': '16'" in again.stdout + again.stderr  # it went on from its checkpoint-12
        assert "'diloco/inner_step': '4'" not in again.stdout + again.stderr
        assert (tmp_path / "out" / "model.safetensors").exists()
        brief_log = tmp_path / "brief.log"
        with brief_log.open("wb") as out:
            brief = subprocess.Popen([*argv[:-2], "--store_url", "s3://job-bucket/brief", "--output_dir", "out-brief"],
                                     cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
            while "'diloco/inner_step': '8'" not in brief_log.read_text(errors="replace") and brief.poll() is None:
                time.sleep(0.05)
            relay.cut()
            time.sleep(1.5)  # under the bound: the requests are retried and go through
            relay.restore()
            brief.wait(400)
        output = brief_log.read_text(errors="replace")
        assert brief.returncode == 0, output[-3000:]

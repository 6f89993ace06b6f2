"""The main job under elastic membership: three sites, each a `torchrun --nproc_per_node 2` of `hf-diloco pretrain`
(scripts/pretrain.py, DDP ranks, gloo) given `--lighthouse`, `--site` and `--min_workers 2` on its command line,
against a real `torchft_lighthouse` process. Every process of one site leaves as it enters an exchange, with the
others' exchange in flight: the two others retry it among themselves and train on without a restart. The lost site,
started again from nothing, heals both of its ranks from the live sites, and the three save the same global model,
bit for bit (each site's saved model is its two ranks' shares of θg, gathered)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from hf_diloco.job.config_file import shipped_config_text
from tests.elastic_common import JOB_SECRET, LighthouseProcess

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "tests" / "scripts" / "elastic_pretrain_site.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS, H, DIE_AT, WAIT_AT = 24, 4, 8, 12


def _config(tmp_path: Path) -> Path:
    config = yaml.safe_load(shipped_config_text("tiny_diloco"))
    config["data"].update(max_train_samples=12, max_eval_samples=2, block_size=64)
    config["tokenizer"]["vocab_size"] = 512
    config["model"]["config"].update(hidden_size=32, num_hidden_layers=2, intermediate_size=64)
    config["training"].update(
        max_steps=STEPS, logging_steps=H, eval_strategy="no", save_strategy="no", per_device_train_batch_size=2,
        warmup_steps=0,
    )  # fmt: skip
    config["diloco"].update(inner_steps=H, data_parallel_per_worker=2)
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start_site(tmp_path: Path, lighthouse: str, site: str, run: str, **variables: str) -> subprocess.Popen:
    """A site as its own torchrun of two ranks, in a session of its own (so that it can be killed whole)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("DILOCO_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(PYTHONPATH=str(ROOT), RUST_LOG="warn", **JOB_SECRET, **variables)
    argv = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(SITE), "--config", str(_config(tmp_path))]
    argv += ["--output_dir", str(tmp_path / site), "--use_cpu", "--lighthouse", lighthouse, "--site", site]
    argv += [
        "--site_host",
        "127.0.0.1",
        "--min_workers",
        "2",
        "--start_workers",
        "3",
        "--membership_sync_timeout",
        "20",
    ]
    log = (tmp_path / f"{site}-{run}.log").open("ab")
    return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _heartbeating(lighthouse: str, site: str) -> set[str]:
    """The torchft replica ids (`site:uuid`, one per start of a site) on the Lighthouse's status page."""
    with urllib.request.urlopen(f"{lighthouse}/status", timeout=5) as response:
        return set(re.findall(rf"{site}:[0-9a-f-]+", response.read().decode(errors="replace")))


@pytest.mark.slow
def test_three_pretrain_sites_of_two_ranks_survive_a_lost_site_and_heal_it(tmp_path):
    lighthouse = LighthouseProcess(tmp_path, heartbeat_ms=5000, join_timeout_ms=60000)
    flag = tmp_path / "rejoined"
    waiting = dict(SITE_WAIT_AT=str(WAIT_AT), SITE_WAIT_FOR=str(flag))
    address, processes = lighthouse.address(), {}
    try:
        for site in ("site-a", "site-b"):
            processes[site] = _start_site(tmp_path, address, site, "run", **waiting)
        processes["site-c"] = _start_site(tmp_path, address, "site-c", "lost", SITE_DIE_AT=str(DIE_AT))
        lost = processes["site-c"].wait(timeout=300)
        # The two train on alone: their retried exchange and the next one run among them, then they wait.
        deadline = time.monotonic() + 240
        while len(list(tmp_path.glob("rejoined.waiting.*"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        before = _heartbeating(address, "site-c")
        processes["site-c"] = _start_site(tmp_path, address, "site-c", "rejoin")
        deadline = time.monotonic() + 180
        while not _heartbeating(address, "site-c") - before and time.monotonic() < deadline:
            time.sleep(0.2)
        flag.touch()  # the two go on: the Lighthouse now waits for the new site-c too
        codes = {site: process.wait(timeout=300) for site, process in processes.items()}
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, 9)
                process.wait()
        lighthouse.kill()
    logs = {path.name: path.read_text(errors="replace") for path in tmp_path.glob("*.log")}
    assert lost != 0 and codes == {"site-a": 0, "site-b": 0, "site-c": 0}, {k: v[-3000:] for k, v in logs.items()}
    assert len(list(tmp_path.glob("died.*"))) == 2, logs["site-c-lost.log"][-3000:]  # both ranks, at the exchange
    # The survivors' exchange in flight at the loss was retried among the two; no survivor restarted.
    for site in ("site-a", "site-b"):
        assert "retrying with the workers present" in logs[f"{site}-run.log"], logs[f"{site}-run.log"][-3000:]
        assert logs[f"{site}-run.log"].count("elastic, site") == 1, "a survivor started twice"
    # Both ranks of the restarted site healed from a live peer and took the job's step.
    assert logs["site-c-rejoin.log"].count("healed from a live peer") == 2, logs["site-c-rejoin.log"][-3000:]
    weights = {site: load_file(tmp_path / site / "model.safetensors") for site in ("site-a", "site-b", "site-c")}
    for site in ("site-b", "site-c"):
        assert weights[site].keys() == weights["site-a"].keys()
        for name, value in weights["site-a"].items():
            assert value.equal(weights[site][name]), (site, name)
    # Each survivor's card: rounds among the two between the loss and the heal, then among three again.
    for site in ("site-a", "site-b"):
        card = (tmp_path / site / "README.md").read_text()
        row = re.search(
            r"\| Worker membership \| elastic: \d+ exchanges among 2-3 workers; (\d+) drop\(s\), (\d+) join", card
        )
        assert row and int(row.group(1)) >= 1 and int(row.group(2)) >= 1, card


@pytest.mark.slow
def test_a_joiner_of_another_model_width_is_refused_naming_the_parameter_and_both_shapes(tmp_path):
    """A site of the main job trains (one process, paced); another, `hf-diloco pretrain` with hidden_size 64 instead of
    32, joins. It heals from the live site and refuses the state it received before loading any of it: exit status 2
    and one line naming the parameter, both shapes and what to do. The live site trains on and finishes. The job's
    secret signs the heal, and neither site writes or prints it."""
    lighthouse = LighthouseProcess(tmp_path, heartbeat_ms=5000, join_timeout_ms=5000)
    secret = "job-secret-" + os.urandom(12).hex()
    config = yaml.safe_load(_config(tmp_path).read_text())
    config["diloco"]["data_parallel_per_worker"] = 1
    config["training"]["max_steps"] = 60
    path = tmp_path / "one_process_site.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {name: value for name, value in os.environ.items() if not name.startswith("DILOCO_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(PYTHONPATH=str(ROOT), RUST_LOG="warn", HF_DILOCO_JOB_SECRET=secret, SITE_PACE="0.3")

    started = []

    def start(program: list[str], site: str, *extra: str) -> subprocess.Popen:
        argv = [*program, "--config", str(path), "--output_dir", str(tmp_path / site)]
        argv += ["--lighthouse", lighthouse.address(), "--site", site, "--site_host", "127.0.0.1", *extra]
        with open(tmp_path / f"{site}.log", "wb") as log:
            started.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
        return started[-1]

    try:
        live = start([sys.executable, str(SITE)], "live")
        deadline = time.monotonic() + 180
        while "DiLoCo run: elastic" not in (tmp_path / "live.log").read_text(errors="replace"):
            assert live.poll() is None and time.monotonic() < deadline, (tmp_path / "live.log").read_text()[-3000:]
            time.sleep(0.2)
        joiner = start([sys.executable, "-m", "hf_diloco", "pretrain"], "wider", "--model.config.hidden_size", "64")
        codes = {"wider": joiner.wait(timeout=300), "live": live.wait(timeout=300)}
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
        lighthouse.kill()
    logs = {name: (tmp_path / f"{name}.log").read_text(errors="replace") for name in codes}
    assert codes == {"wider": 2, "live": 0}, {name: log[-3000:] for name, log in logs.items()}
    assert logs["wider"].splitlines()[-1] == (
        "hf-diloco: error: A live peer trains another model than this worker: model.embed_tokens.weight is [512, 32] "
        "in the peer and [512, 64] in this worker. Every site of a job trains the same model: start this worker with "
        "the live sites' model settings (model: in the config, e.g. hidden_size, num_hidden_layers, the vocabulary), "
        "or train this model as a job of its own, against another Lighthouse."
    )
    written = [p.read_bytes() for site in ("live", "wider") for p in (tmp_path / site).rglob("*") if p.is_file()]
    assert not [data for data in [*written, *(log.encode() for log in logs.values())] if secret.encode() in data]

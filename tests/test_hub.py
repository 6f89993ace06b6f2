"""The Hub upload path, against a local HTTP server that answers the endpoints `huggingface_hub` calls."""

import base64
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import yaml
from safetensors.torch import save_file

from hf_diloco.cli import push
from hf_diloco.core.settings.config import DiLoCoConfig
from hf_diloco.publish.hub import ensure_model_card, files_to_publish, push_folder_to_hub
from hf_diloco.publish.model_card import write_model_card

pytestmark = pytest.mark.timeout(120)


class FakeHub(BaseHTTPRequestHandler):
    """Just enough of the Hub API for `create_repo` + `upload_folder` with small (regular, base64) files."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        hub = self.server.hub
        hub["requests"].append((self.command, self.path, dict(self.headers)))
        path = self.path.split("?")[0]
        if path == "/api/repos/create":
            payload = json.loads(body)
            hub["created"].append(payload)
            return self._json({"url": f"{hub['endpoint']}/{payload['organization']}/{payload['name']}"})
        if path == "/api/validate-yaml":
            # The real Hub checks the card's metadata before anything is hashed; a YAML parse is our stand-in.
            content = json.loads(body)["content"]
            hub["validated"].append(content)
            try:
                yaml.safe_load(content.split("---\n")[1])
            except yaml.YAMLError as error:
                return self._json({"errors": [{"message": str(error)}]}, status=400)
            return self._json({"errors": [], "warnings": []})
        if "/preupload/" in path:
            files = json.loads(body)["files"]
            return self._json(
                {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
            )
        if "/commit/" in path:
            lines = [json.loads(line) for line in body.decode().splitlines() if line]
            hub["commits"].append({"path": path, "content_type": self.headers["Content-Type"], "lines": lines})
            repo_id = path.split("/api/models/")[1].split("/commit/")[0]
            oid = "0123abcd" * 5
            return self._json({"commitUrl": f"{hub['endpoint']}/{repo_id}/commit/{oid}", "commitOid": oid})
        self.send_error(404, f"fake hub does not serve {path}")

    def _json(self, payload, status=200):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Refuse every connection that is not to the local fake Hub."""
    connect = socket.socket.connect

    def guarded(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] != "127.0.0.1":
            raise OSError(f"test tried to reach {address}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


@pytest.fixture
def fake_hub(monkeypatch):
    # The fake Hub is this machine's own server: its tests run online to it whatever HF_HUB_OFFLINE the suite was
    # started with (huggingface_hub reads the variable once, at import), and `loopback_only` keeps them on this machine.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    server.hub = {"endpoint": endpoint, "requests": [], "created": [], "commits": [], "validated": []}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.hub
    server.shutdown()
    server.server_close()


def _model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "global_model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    save_file(
        {"model.embed_tokens.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4)},
        folder / "model.safetensors",
    )
    return folder


def _training_output_folder(tmp_path: Path) -> Path:
    """What a finished run leaves in its output folder: the model and tokenizer, and the training state around it."""
    folder = _model_folder(tmp_path)
    published = ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "all_results.json"]
    private = ["optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth", "rng_state_1.pth", "training_args.bin"]
    private += ["trainer_state.json", "diloco_state_rank0.pt", "diloco_manifest.json", "events_rank0.json"]
    for name in published + private:
        (folder / name).write_text(name)
    for name in ("checkpoint-2/model.safetensors", "checkpoint-2/optimizer.pt", "tokenizer/tokenizer.json"):
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(name)
    (folder / "runs" / "Dec01").mkdir(parents=True)
    (folder / "runs" / "Dec01" / "events.out.tfevents.1").write_text("tb")
    return folder


def _uploaded(commit: dict) -> dict[str, bytes]:
    return {
        op["value"]["path"]: base64.b64decode(op["value"]["content"])
        for op in commit["lines"][1:]
        if op["key"] == "file"
    }


def _card_kwargs() -> dict:
    settings = DiLoCoConfig(inner_steps=8).diloco_dict()
    settings["num_workers"] = 2
    communication = {"bytes_sent": 4096, "steps": 16, "num_parameters": 1000}
    return {"settings": settings, "communication": communication, "data_description": "tiny", "base_model": None}


def test_push_uploads_weights_config_and_card(tmp_path, fake_hub):
    folder = _model_folder(tmp_path)
    info = push_folder_to_hub(
        folder,
        "someone/tiny-diloco",
        token="hf_fake_token",
        endpoint=fake_hub["endpoint"],
        private=True,
        model_card=_card_kwargs(),
    )
    assert info.oid == "0123abcd" * 5
    assert fake_hub["created"] == [
        {"name": "tiny-diloco", "organization": "someone", "visibility": "private", "type": "model"}
    ]
    assert all(headers.get("authorization") == "Bearer hf_fake_token" for _, _, headers in fake_hub["requests"])

    [commit] = fake_hub["commits"]
    assert commit["path"] == "/api/models/someone/tiny-diloco/commit/main"
    assert commit["content_type"] == "application/x-ndjson"
    header, *operations = commit["lines"]
    assert header == {"key": "header", "value": {"summary": "Upload DiLoCo-trained model", "description": ""}}
    uploaded = {}
    for op in operations:
        assert op["key"] == "file" and op["value"]["encoding"] == "base64"
        uploaded[op["value"]["path"]] = base64.b64decode(op["value"]["content"])
    assert set(uploaded) == {"config.json", "model.safetensors", "README.md"}
    for name in ("config.json", "model.safetensors"):
        assert uploaded[name] == (folder / name).read_bytes()

    card = uploaded["README.md"].decode()
    assert fake_hub["validated"] == [card]
    front = yaml.safe_load(card.split("---\n")[1])
    assert "diloco" in front["tags"] and front["library_name"] == "transformers"
    # The card names the repository it was pushed to; the local card is left as it was.
    assert 'from_pretrained("someone/tiny-diloco")' in card
    assert card == (folder / "README.md").read_text().replace("path/to/this/model", "someone/tiny-diloco")


def test_push_uploads_what_a_user_publishes_and_nothing_else(tmp_path, fake_hub):
    folder = _training_output_folder(tmp_path)
    write_model_card(folder, **_card_kwargs())
    push_folder_to_hub(folder, "someone/run", token="t", endpoint=fake_hub["endpoint"])
    expected = {
        "README.md", "config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "all_results.json",
    }  # fmt: skip
    assert set(_uploaded(fake_hub["commits"][-1])) == expected
    # TensorBoard logs and anything else only when asked.
    push_folder_to_hub(
        folder,
        "someone/run",
        token="t",
        endpoint=fake_hub["endpoint"],
        include_logs=True,
        include=["training_args.bin", "checkpoint-*/*"],
    )
    extra = {"runs/Dec01/events.out.tfevents.1", "training_args.bin", "checkpoint-2/model.safetensors"}
    assert set(_uploaded(fake_hub["commits"][-1])) == expected | extra | {"checkpoint-2/optimizer.pt"}


def test_push_command(tmp_path, fake_hub, capsys):
    folder = _training_output_folder(tmp_path)
    write_model_card(folder, **_card_kwargs())
    assert push.main([str(folder), "someone/cli", "--dry_run"]) == 0
    assert "7 file(s)" in capsys.readouterr().out and fake_hub["requests"] == []
    assert (
        push.main([str(folder), "someone/cli", "--token", "t", "--endpoint", fake_hub["endpoint"], "--private"]) == 0
    )
    assert fake_hub["created"][-1]["visibility"] == "private"
    assert set(_uploaded(fake_hub["commits"][-1])) == set(files_to_publish(folder))
    assert "pushed to" in capsys.readouterr().out


def test_push_refuses_folder_without_card(tmp_path, fake_hub):
    folder = _model_folder(tmp_path)
    with pytest.raises(ValueError, match="README.md"):
        push_folder_to_hub(folder, "someone/x", token="t", endpoint=fake_hub["endpoint"])
    assert fake_hub["requests"] == []


def test_push_offline_is_refused_naming_the_variable_before_any_request(tmp_path, fake_hub, monkeypatch, capsys):
    """HF_HUB_OFFLINE=1, the way people without a network run HF code: the push says so and changes nothing."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    folder = _model_folder(tmp_path)
    expected = r"HF_HUB_OFFLINE is set: pushing .* to someone/x needs the network\. Unset HF_HUB_OFFLINE"
    with pytest.raises(ValueError, match=expected):
        push_folder_to_hub(folder, "someone/x", token="t", endpoint=fake_hub["endpoint"], model_card=_card_kwargs())
    assert not (folder / "README.md").exists()
    write_model_card(folder, **_card_kwargs())
    assert push.main([str(folder), "someone/x", "--dry_run"]) == 0  # listing the files needs no network
    with pytest.raises(ValueError, match=expected):
        push.main([str(folder), "someone/x", "--token", "t", "--endpoint", fake_hub["endpoint"]])
    assert fake_hub["requests"] == []


def test_existing_card_keeps_text_and_gains_tag(tmp_path):
    folder = _model_folder(tmp_path)
    (folder / "README.md").write_text("---\nlicense: mit\ntags:\n- llama\n---\n\n# My words\n")
    readme = ensure_model_card(folder)
    text = readme.read_text()
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["tags"] == ["llama", "diloco"] and front["license"] == "mit"
    assert "# My words" in text

    write_model_card(folder, **_card_kwargs())
    before = (folder / "README.md").read_bytes()
    ensure_model_card(folder)
    assert (folder / "README.md").read_bytes() == before

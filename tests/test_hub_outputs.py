"""A finished run's final/ is hub-ready: a model card, the base model in the LoRA metadata, and
``flowalign push`` uploads it (against a stand-in hub on 127.0.0.1: no network)."""

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from safetensors import safe_open

from flowalign.cli import main
from flowalign.config import load_config
from flowalign.trainer import Trainer


@pytest.fixture(scope="module")
def finished_run(tiny_sd3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "tiny-hub-run"
    Trainer(load_config(None, [
        f"output_dir={out}", f"model.path={tiny_sd3_dir}", "model.lora_rank=4", "tracker=none",
        "sampling.num_steps=4", "train.epochs=1", "train.groups_per_epoch=2", "train.group_size=4",
        "train.sample_batch_size=8", "train.train_batch_size=8", "eval.seeds=1", "eval.grid_prompts=2",
        "eval.grid_seeds=1", "eval.every=0", "checkpoint_every=0"])).train()
    return out


def test_final_has_a_model_card_with_the_numbers_and_the_grid(finished_run, tiny_sd3_dir):
    card = (finished_run / "final" / "README.md").read_text()
    metrics = json.loads((finished_run / "metrics.json").read_text())
    front = card.split("---")[1]
    assert "library_name: diffusers" in front and "pipeline_tag: text-to-image" in front
    assert "base_model:" not in front  # a local folder is no hub id: named in the text only
    assert "license: other" in front and "set `model.license`" in card  # a local base of unknown license
    assert f"of `{tiny_sd3_dir}` (model family `sd3`), trained with **flow_grpo**" in card
    assert "the reward `shapes`" in card
    before, after = metrics["before"]["score"], metrics["after"]["score"]
    assert f"| score | {before:.4f} | {after:.4f} | {after - before:+.4f} |" in card
    assert "| prompts × samples per epoch | 2 × 4 |" in card and "| learning rate |" in card
    assert "![before (left) and after (right)" in card and (finished_run / "final" / "before_after.png").is_file()
    assert 'pipe.load_lora_weights("%s")' % (finished_run / "final") in card  # the run's own folder, until pushed


def test_the_lora_file_names_its_base_model_and_still_loads_in_diffusers(finished_run, tiny_sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    path = finished_run / "final" / "pytorch_lora_weights.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    assert metadata["base_model"] == str(tiny_sd3_dir) and metadata["flowalign_method"] == "flow_grpo"
    assert "lora_adapter_metadata" in metadata  # diffusers' own key, kept
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir, text_encoder_3=None, tokenizer_3=None)
    pipe.load_lora_weights(finished_run / "final")
    assert any("lora" in name for name, _ in pipe.transformer.named_parameters())


class StandInHub(BaseHTTPRequestHandler):
    """The hub endpoints huggingface_hub's create_repo and upload_folder call, answering as the hub
    does for small files (uploaded inline: "regular" mode); every commit's files are kept."""

    repos: dict = {}
    requests: list = []
    cards: list = []

    def log_message(self, *args):
        pass

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.requests.append((self.command, self.path, self.headers.get("authorization")))
        endpoint = f"http://{self.server.server_address[0]}:{self.server.server_address[1]}"
        if self.path == "/api/repos/create":
            request = json.loads(body)
            repo = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
            self.repos.setdefault(repo, {})
            return self._reply(200, {"url": f"{endpoint}/{repo}", "name": repo})
        if self.path == "/api/validate-yaml":  # the hub checks a model card's front matter
            self.cards.append(json.loads(body)["content"])
            return self._reply(200, {"warnings": []})
        parts = self.path.split("?")[0].split("/")  # /api/models/OWNER/NAME/(preupload|commit)/main
        if parts[:3] == ["", "api", "models"] and parts[5] == "preupload":
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in files]})
        if parts[:3] == ["", "api", "models"] and parts[5] == "commit":
            repo, kept = f"{parts[3]}/{parts[4]}", {}
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    kept[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            self.repos[repo] = kept
            return self._reply(200, {"commitUrl": f"{endpoint}/{repo}/commit/0123abcd", "commitOid": "0123abcd"})
        return self._reply(404, {"error": f"the stand-in hub has no {self.path}"})


@pytest.fixture
def stand_in_hub(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in_token")
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    StandInHub.repos, StandInHub.requests, StandInHub.cards = {}, [], []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_push_uploads_final_to_the_hub(finished_run, stand_in_hub, capsys):
    assert main(["push", str(finished_run), "--repo", "me/tiny-lora", "--endpoint", stand_in_hub]) == 0
    uploaded = StandInHub.repos["me/tiny-lora"]
    final = finished_run / "final"
    assert set(uploaded) == {p.name for p in final.iterdir()} >= {"README.md", "pytorch_lora_weights.safetensors",
                                                                   "before_after.png", "flowalign_config.yaml"}
    assert all(uploaded[name] == (final / name).read_bytes() for name in uploaded if name != "README.md")
    card = uploaded["README.md"].decode()  # the snippet loads from the repository, not the local folder
    assert 'pipe.load_lora_weights("me/tiny-lora")' in card and str(finished_run) not in card.split("## Use")[1]
    assert all(auth == "Bearer hf_stand_in_token" for _, _, auth in StandInHub.requests)
    assert StandInHub.cards == [card]  # its front matter validated
    assert "uploaded" in capsys.readouterr().out


def test_push_refuses_a_run_without_final(tmp_path, stand_in_hub, capsys):
    assert main(["push", str(tmp_path), "--repo", "me/x", "--endpoint", stand_in_hub]) == 2
    assert "no final/README.md" in capsys.readouterr().err
    assert StandInHub.requests == []  # nothing sent


def test_push_without_a_token_is_one_line(finished_run, stand_in_hub, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(finished_run.parent / "no-hf-home"))  # no stored login either
    assert main(["push", str(finished_run), "--repo", "me/x", "--endpoint", stand_in_hub]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no hub token" in err and "hf auth login" in err
    assert StandInHub.requests == []


def test_push_to_an_unreachable_hub_is_one_line(finished_run, monkeypatch, capsys):
    import socket

    monkeypatch.setenv("HF_TOKEN", "hf_stand_in_token")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["push", str(finished_run), "--repo", "me/x", "--endpoint", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be reached" in err and f"127.0.0.1:{port}" in err

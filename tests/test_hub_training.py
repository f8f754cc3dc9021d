"""hub.repo / hub.strategy: a run pushes each checkpoint's policy/ and its final/ to a stand-in hub
on 127.0.0.1 found through HF_ENDPOINT, the .safetensors files through the hub's LFS upload (batch
endpoint, then a PUT of the bytes, then an lfsFile entry in the commit), the rest inline; a run
without a token stops before any model loads."""

import json

import pytest
import torch
from safetensors.torch import load

from flowalign.config import ConfigError, load_config
from flowalign.trainer import Trainer
from test_hub_outputs import StandInHub, stand_in_hub  # noqa: F401  (a fixture)


class LfsStandInHub(StandInHub):
    """StandInHub answering "lfs" for .safetensors files, with the LFS batch and upload endpoints."""

    lfs: dict = {}

    def do_PUT(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.requests.append((self.command, self.path, self.headers.get("authorization")))
        self.lfs[self.path.rsplit("/", 1)[1]] = body
        self._reply(200, {})

    def do_POST(self):
        endpoint = f"http://{self.server.server_address[0]}:{self.server.server_address[1]}"
        path = self.path.split("?")[0]
        if path.endswith(".git/info/lfs/objects/batch"):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            self.requests.append((self.command, self.path, self.headers.get("authorization")))
            return self._reply(200, {"transfer": "basic", "objects": [
                {"oid": o["oid"], "size": o["size"], "authenticated": True,
                 "actions": {"upload": {"href": f"{endpoint}/lfs-upload/{o['oid']}"}}} for o in body["objects"]]})
        parts = path.split("/")
        if parts[:3] == ["", "api", "models"] and parts[5] == "preupload":
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            return self._reply(200, {"files": [{"path": f["path"], "shouldIgnore": False,
                                                "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular"}
                                               for f in body["files"]]})
        if parts[:3] == ["", "api", "models"] and parts[5] == "commit":
            import base64

            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            repo = f"{parts[3]}/{parts[4]}"
            kept = self.repos.setdefault(repo, {})
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    kept[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] == "lfsFile":
                    kept[item["value"]["path"]] = ("lfs", self.lfs[item["value"]["oid"]])
            self.commits.append(repo)
            return self._reply(200, {"commitUrl": f"{endpoint}/{repo}/commit/0123abcd", "commitOid": "0123abcd"})
        return super().do_POST()


@pytest.fixture
def lfs_hub(monkeypatch):
    import threading
    from http.server import ThreadingHTTPServer

    import huggingface_hub._commit_api

    monkeypatch.setattr(huggingface_hub._commit_api, "is_xet_available", lambda: False)  # the LFS path, not Xet
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in_token")
    server = ThreadingHTTPServer(("127.0.0.1", 0), LfsStandInHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    LfsStandInHub.repos, LfsStandInHub.requests, LfsStandInHub.cards = {}, [], []
    LfsStandInHub.lfs, LfsStandInHub.commits = {}, []
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)  # read when the push happens: no --endpoint anywhere
    yield endpoint
    server.shutdown()
    server.server_close()


def _config(tiny_sd3_dir, out, *extra):
    return load_config(None, [
        f"output_dir={out}", f"model.path={tiny_sd3_dir}", "model.lora_rank=4", "tracker=none",
        "sampling.num_steps=4", "train.epochs=2", "train.groups_per_epoch=2", "train.group_size=4",
        "train.sample_batch_size=8", "train.train_batch_size=8", "eval.seeds=1", "eval.grid_prompts=1",
        "eval.grid_seeds=1", "eval.every=0", *extra])


def test_a_run_pushes_each_checkpoint_and_final_through_lfs(tiny_sd3_dir, tmp_path, lfs_hub):
    out = tmp_path / "run"
    Trainer(_config(tiny_sd3_dir, out, "checkpoint_every=1", "hub.repo=me/tiny-run", "hub.strategy=checkpoint")).train()
    repo = LfsStandInHub.repos["me/tiny-run"]
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    for name in checkpoints:  # each checkpoint's policy/ under its own name (the last ones kept on disk)
        local = out / "checkpoints" / name / "policy" / "pytorch_lora_weights.safetensors"
        kind, pushed = repo[f"{name}/pytorch_lora_weights.safetensors"]
        got, want = load(pushed), load(local.read_bytes())  # the end's re-save of the last epoch may order
        assert kind == "lfs" and got.keys() == want.keys()  # its metadata differently: compare the tensors
        assert all(torch.equal(got[k], want[k]) for k in want)
    final = out / "final"
    assert repo["pytorch_lora_weights.safetensors"] == ("lfs", (final / "pytorch_lora_weights.safetensors").read_bytes())
    assert repo["flowalign_config.yaml"] == (final / "flowalign_config.yaml").read_bytes()  # small: inline
    assert b'pipe.load_lora_weights("me/tiny-run")' in repo["README.md"]
    assert len(LfsStandInHub.commits) == 2 + 1  # a commit per checkpoint (epochs 1, 2), one for final/
    puts = [r for r in LfsStandInHub.requests if r[0] == "PUT"]
    assert puts and all(auth is None or auth == "Bearer hf_stand_in_token" for _, _, auth in LfsStandInHub.requests)


def test_strategy_end_pushes_only_final(tiny_sd3_dir, tmp_path, lfs_hub):
    Trainer(_config(tiny_sd3_dir, tmp_path / "run", "checkpoint_every=1", "hub.repo=me/end-only")).train()
    assert all("/" not in name for name in LfsStandInHub.repos["me/end-only"])  # no checkpoint-* folders
    assert LfsStandInHub.commits == ["me/end-only"]


def test_no_token_stops_before_any_model_loads(tiny_sd3_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-login"))
    monkeypatch.setattr("flowalign.model_setup.load_adapter", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match="hub.repo is 'me/x' but there is no hub token"):
        Trainer(_config(tiny_sd3_dir, tmp_path / "run", "hub.repo=me/x"))
    with pytest.raises(ConfigError, match="hub.repo must be owner/name"):
        Trainer(_config(tiny_sd3_dir, tmp_path / "run", "hub.repo=just-a-name"))


def test_flowalign_push_from_python(tiny_sd3_dir, tmp_path, lfs_hub):
    import flowalign

    Trainer(_config(tiny_sd3_dir, tmp_path / "run", "checkpoint_every=0")).train()
    commit = flowalign.push(tmp_path / "run", "me/from-python")
    assert commit.oid == "0123abcd" and "README.md" in LfsStandInHub.repos["me/from-python"]


"""The reward server and its client over real HTTP on 127.0.0.1: equal scores, batching,
bounded payloads, retries, and a server that is down costing samples instead of the run."""

import contextlib
import json
import random
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from reward_models.worlds.shapes import prompt_split, render_scene
from reward_models.base import Reward, build_reward
from reward_models.remote import RemoteReward, make_server


@pytest.fixture
def serve():
    servers = []

    def start(reward, name="test", **kwargs):
        server = make_server(reward, name, port=0, **kwargs)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def shapes_batch(n=6):
    specs = prompt_split("test")[:n]
    rng = random.Random(0)
    images = torch.from_numpy(np.stack([np.asarray(render_scene(s, rng)) for s in specs])).permute(0, 3, 1, 2) / 255
    return images, [s["prompt"] for s in specs], specs


def test_remote_scores_equal_local_scores_in_png_and_npy(serve):
    images, prompts, specs = shapes_batch()
    for name, fmt in (("shapes", "png"), ("jpeg_compressibility", "npy")):
        local = build_reward(name)
        remote = RemoteReward(serve(local, name), format=fmt)
        assert remote.components == local.components
        got, want = remote(images, prompts, specs), local(images, prompts, specs)
        assert set(got) == set(want)
        for key in want:
            torch.testing.assert_close(got[key], torch.as_tensor(want[key]), rtol=0, atol=0)


def test_health_unknown_paths_and_bounded_payload(serve):
    url = serve(build_reward("jpeg_compressibility"), "jpeg_compressibility", max_payload=10_000)
    with urllib.request.urlopen(url + "/health") as response:
        assert json.loads(response.read()) == {"status": "ok", "reward": "jpeg_compressibility",
                                               "components": ["jpeg_compressibility"],
                                               "max_request_pixels": 2**24, "max_payload": 10_000}
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(url + "/nope")
    assert error.value.code == 404
    client = RemoteReward(url, format="npy", retries=0)
    with pytest.raises(RuntimeError, match="exceeds the limit"):  # 4xx: reported, not retried
        client(torch.rand(4, 3, 32, 32), ["x"] * 4, [{}] * 4)
    bad = urllib.request.Request(url + "/score", data=b'{"samples": ["AAAA"], "prompts": []}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(bad)
    assert error.value.code == 400 and "bad request" in error.value.read().decode()


class CountingReward(Reward):
    components = ("mean",)

    def __init__(self):
        self.calls, self.sizes = 0, []

    def __call__(self, samples, prompts, metadata):
        self.calls += 1
        self.sizes.append(len(prompts))
        time.sleep(0.05)  # long enough for concurrent requests to queue up behind this call
        return {"mean": samples.mean((1, 2, 3))}


def test_concurrent_requests_are_merged_into_batches(serve):
    reward = CountingReward()
    url = serve(reward, max_batch=16)
    results, clients = {}, 12

    def one(k):
        images = torch.full((2, 3, 8, 8), k / clients)
        results[k] = RemoteReward(url, components=["mean"], format="npy")(images, ["p", "p"], [{}, {}])["mean"]

    threads = [threading.Thread(target=one, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(clients):  # every client got its own samples' scores back
        torch.testing.assert_close(results[k], torch.full((2,), k / clients))
    assert sum(reward.sizes) == 2 * clients
    assert reward.calls < clients and max(reward.sizes) <= 16


class FlakyReward(Reward):
    """Fails its first ``failures`` calls, then works."""

    components = ("one",)

    def __init__(self, failures):
        self.failures = failures

    def __call__(self, samples, prompts, metadata):
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("GPU fell off the bus")
        return {"one": torch.ones(len(prompts))}


def test_server_errors_are_retried_with_backoff(serve):
    url = serve(FlakyReward(failures=2))
    client = RemoteReward(url, components=["one"], retries=3, backoff=0.01)
    assert client(torch.rand(2, 3, 8, 8), ["a", "b"], [{}, {}])["one"].tolist() == [1.0, 1.0]


def test_a_server_that_is_down_scores_nan_instead_of_raising():
    client = RemoteReward("http://127.0.0.1:9", components=["score"], retries=1, backoff=0.01, timeout=2)
    out = client(torch.rand(3, 3, 8, 8), ["a"] * 3, [{}] * 3)
    assert torch.isnan(out["score"]).all()


def test_training_survives_a_reward_server_that_dies(tiny_sd3_dir, tmp_path, serve):
    from flowalign.trainer import Trainer
    from helpers import tiny_config

    server_url = serve(build_reward("shapes"), "shapes")
    # a second server that fails every call: its batches come back NaN and are dropped
    dead_url = serve(FlakyReward(failures=10**9))
    for url, dropped in ((server_url, 0), (dead_url, 8)):
        kwargs = f"reward.kwargs={{url: {url}, retries: 0, components: [score, accuracy]}}"
        trainer = Trainer(tiny_config(tiny_sd3_dir, tmp_path / str(dropped), "reward.name=remote", kwargs,
                                      "train.epochs=1", "train.groups_per_epoch=2",
                                      "train.max_nan_epochs=0"))  # 0: go on, even through a whole NaN run
        trainer.train()
        assert trainer.history[0]["reward/dropped_nan"] == dropped
        assert all(torch.isfinite(v).all() for v in trainer.adapter.trained_state_dict().values())
    assert (tmp_path / "8" / "final" / "pytorch_lora_weights.safetensors").is_file()


def test_reward_server_command_serves_until_interrupted():
    proc = subprocess.Popen([sys.executable, "-m", "flowalign.cli", "reward-server", "--reward", "jpeg_compressibility",
                             "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line
        url = line.split("on ")[1].split(" ")[0]
        client = RemoteReward(url)
        assert client.components == ("jpeg_compressibility",)
        assert client(torch.zeros(1, 3, 16, 16), ["x"], [{}])["jpeg_compressibility"].item() < 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def raw_request(url: str, head: bytes, body: bytes = b"", timeout: float = 10) -> str:
    """Send ``head`` (and ``body``) on one socket; the answer's status line and body."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head + body)
        answer = b""
        while data := sock.recv(65536):
            answer += data
            if b"\r\n\r\n" in answer and b'"}' in answer:
                break
    status, _, rest = answer.decode().partition("\r\n")
    return status + " " + rest.split("\r\n\r\n")[-1]


def score_body(**fields) -> bytes:
    images, prompts, specs = shapes_batch(2)
    from reward_models.remote import encode_samples

    return json.dumps({"format": "png", "samples": encode_samples(images), "prompts": prompts, "metadata": specs,
                       **fields}).encode()


def test_decoded_pixels_are_bounded_per_sample_and_per_request_before_decoding(serve):
    from reward_models.remote import encode_samples

    reward = CountingReward()
    url = serve(reward, max_image_pixels=64 * 64, max_request_pixels=3 * 64 * 64)
    client = RemoteReward(url, components=["mean"], retries=0)
    with pytest.raises(RuntimeError, match=r"samples\[0\] decodes to 4160 pixels, above the server's bound of 4096 "
                                           r"per sample \(--max-image-pixels\)"):
        client(torch.rand(1, 3, 65, 64), ["x"], [{}])
    with pytest.raises(RuntimeError, match=r"the request decodes to 16384 pixels, above .* 12288 per request"):
        client(torch.rand(4, 3, 64, 64), ["x"] * 4, [{}] * 4)
    npy = RemoteReward(url, components=["mean"], retries=0, format="npy")
    with pytest.raises(RuntimeError, match="decodes to 4160 pixels"):  # an NPY sample: its values / 3
        npy(torch.rand(1, 3, 65, 64), ["x"], [{}])
    assert reward.calls == 0
    assert client(torch.rand(3, 3, 64, 64), ["x"] * 3, [{}] * 3)["mean"].shape == (3,)  # at the bounds: scored
    big = json.dumps({"samples": encode_samples(torch.zeros(1, 3, 4000, 4000)), "prompts": ["x"]}).encode()
    head = f"POST /score HTTP/1.1\r\nContent-Length: {len(big)}\r\n\r\n".encode()
    assert raw_request(url, head, big).startswith("HTTP/1.1 413")  # 16 Mpx from a few KB of PNG


def test_a_bad_content_length_is_refused_before_the_body_is_read(serve):
    url = serve(CountingReward(), max_payload=10_000)
    # no body follows: a server that waited for one (or read to the end) would time this out
    answer = raw_request(url, b"POST /score HTTP/1.1\r\nContent-Length: -1\r\n\r\n", timeout=5)
    assert answer.startswith("HTTP/1.1 400") and "Content-Length must be a byte count" in answer
    answer = raw_request(url, b"POST /score HTTP/1.1\r\nContent-Length: 200000000\r\n\r\n", timeout=5)
    assert answer.startswith("HTTP/1.1 413") and "exceeds the limit of 10000" in answer
    assert raw_request(url, b"POST /score HTTP/1.1\r\n\r\n", timeout=5).startswith("HTTP/1.1 411")


@pytest.mark.parametrize("field, value, named", [
    ("prompts", "a red circle", "prompts must be a list of strings"),
    ("metadata", [1, 2], "metadata must be a list of objects"),
    ("samples", ["not base64!", "AAAA"], "samples: not base64 PNG"),
    ("format", "gif", "format must be one of uint8, png, npy"),
])
def test_malformed_fields_answer_400_naming_the_field(serve, field, value, named):
    url = serve(build_reward("shapes"), "shapes")
    body = score_body(**{field: value})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(urllib.request.Request(url + "/score", data=body, method="POST"))
    assert error.value.code == 400 and named in error.value.read().decode()


class SlowReward(CountingReward):
    def __call__(self, samples, prompts, metadata):
        if prompts[0] == "slow":
            time.sleep(1.5)
        return {"mean": samples.mean((1, 2, 3))}


def test_idle_and_slow_clients_time_out_without_blocking_others(serve):
    import socket

    url = serve(SlowReward(), idle_timeout_s=0.5, timeout_s=1.0)
    host, port = url.removeprefix("http://").split(":")
    idle = socket.create_connection((host, int(port)), timeout=5)
    began = time.time()
    assert idle.recv(1) == b"" and time.time() - began < 3  # closed by the server, its thread ended
    client = RemoteReward(url, components=["mean"], retries=0, format="npy")
    # a body that trickles in: each read beats the idle timeout, the whole does not beat timeout_s
    trickle = socket.create_connection((host, int(port)), timeout=5)
    trickle.sendall(b"POST /score HTTP/1.1\r\nContent-Length: 1000\r\n\r\n")
    began = time.time()
    while time.time() - began < 1.6:
        with contextlib.suppress(OSError):
            trickle.sendall(b" ")
        assert client(torch.rand(1, 3, 8, 8), ["fast"], [{}])["mean"].shape == (1,)  # others are served meanwhile
        time.sleep(0.3)
    assert trickle.recv(4096).startswith(b"HTTP/1.1 408")
    began = time.time()  # scoring past timeout_s: a 503, which the client scores NaN (after its retries)
    assert torch.isnan(client(torch.rand(1, 3, 8, 8), ["slow"], [{}])["mean"]).all() and time.time() - began < 1.4


# --------------------------------------------------------------------------- uint8 NPY, keep-alive


def test_uint8_round_trip_is_bit_exact_and_the_same_pixels_as_png():
    from reward_models.remote import decode_samples, encode_samples, to_uint8

    x = torch.rand(3, 3, 17, 23, generator=torch.Generator().manual_seed(0))
    x[0, 0, 0, :3] = torch.tensor([0.0, 1.0, 0.5 / 255])  # the ends, and a value that rounds half-way
    got = decode_samples(encode_samples(x, "uint8"), "uint8")
    want = torch.round(x * 255) / 255  # what any 8-bit image keeps, worked out independently
    assert torch.equal(got, want)
    assert torch.equal(got, decode_samples(encode_samples(x, "png"), "png"))  # the same pixels as PNG
    assert torch.equal((got * 255).round().to(torch.uint8), to_uint8(x))
    again = decode_samples(encode_samples(got, "uint8"), "uint8")  # a second trip loses nothing
    assert torch.equal(again, got)


def npy_b64(array) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def object_npy_b64() -> str:
    """An NPY header declaring pickled Python objects, then bytes that are no pickle."""
    import base64
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "|O", "fortran_order": False, "shape": (3, 1, 1)})
    return base64.b64encode(buffer.getvalue() + b"not a pickle").decode()


@pytest.mark.parametrize("sample, named", [
    (npy_b64(np.zeros((3, 8, 8), np.float32)), "format uint8 needs uint8 arrays of shape [3, H, W], got float32 [3, 8, 8]"),
    (npy_b64(np.zeros((8, 8, 3), np.uint8)), "format uint8 needs uint8 arrays of shape [3, H, W], got uint8 [8, 8, 3]"),
    (npy_b64(np.zeros((3, 8, 8), np.uint8))[:-40], "samples: not base64 uint8 NPY"),  # cut short: fewer bytes than its header says
    ("iVBORw0KGgo=", "samples: not base64 uint8 NPY"),  # a PNG signature, not an NPY file
    (object_npy_b64(), "got object [3, 1, 1]"),  # pickled objects: refused from the header, never unpickled
])
def test_the_server_rejects_malformed_uint8_npy_with_a_clear_error(serve, sample, named):
    reward = CountingReward()
    url = serve(reward)
    body = json.dumps({"format": "uint8", "samples": [sample], "prompts": ["x"]}).encode()
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(urllib.request.Request(url + "/score", data=body, method="POST"))
    text = error.value.read().decode()
    assert error.value.code == 400 and named in text, text
    assert reward.calls == 0


def test_uint8_is_the_default_for_a_local_server_and_png_elsewhere(serve):
    reward = CountingReward()
    url = serve(reward)
    assert RemoteReward(url, components=["mean"]).format == "uint8"
    assert RemoteReward(url.replace("127.0.0.1", "localhost"), components=["mean"]).format == "uint8"
    assert RemoteReward("http://reward-box:8765", components=["mean"]).format == "png"
    assert RemoteReward("http://reward-box:8765", components=["mean"], format="uint8").format == "uint8"
    with pytest.raises(ValueError, match="format must be one of uint8, png, npy, got 'jpeg'"):
        RemoteReward(url, components=["mean"], format="jpeg")
    images = torch.rand(2, 3, 8, 8)  # scored on exactly the 8-bit pixels
    got = RemoteReward(url, components=["mean"])(images, ["a", "b"], [{}, {}])["mean"]
    torch.testing.assert_close(got, (torch.round(images * 255) / 255).mean((1, 2, 3)), rtol=0, atol=0)


def counting_server(reward, port=0, **kwargs):
    """A real server whose accepted TCP connections are kept (and so counted)."""
    server = make_server(reward, "test", port=port, **kwargs)
    server.accepted = []
    get_request = server.get_request

    def counted():
        sock, address = get_request()
        server.accepted.append(sock)
        return sock, address

    server.get_request = counted
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop(server):
    """Down as a killed server process is: listening socket and every open connection closed."""
    import socket

    server.shutdown()
    server.server_close()
    for sock in server.accepted:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def test_keep_alive_reuses_one_connection_and_recovers_when_the_server_restarts():
    reward = CountingReward()
    server = counting_server(reward)
    port = server.server_address[1]
    client = RemoteReward(f"http://127.0.0.1:{port}", components=["mean"], retries=0)
    images = torch.rand(2, 3, 8, 8)
    want = (torch.round(images * 255) / 255).mean((1, 2, 3))
    try:
        for _ in range(5):
            torch.testing.assert_close(client(images, ["a", "b"], [{}, {}])["mean"], want)
        assert len(server.accepted) == 1  # five requests, one TCP connection
        import socket  # Nagle off on the kept-alive connection: else each answer's body waits ~40 ms for an ACK

        assert server.accepted[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)

        def from_another_thread():  # the trainer calls its reward from a new thread per batch
            out["mean"] = client(images, ["a", "b"], [{}, {}])["mean"]

        out = {}
        worker = threading.Thread(target=from_another_thread)
        worker.start()
        worker.join()
        torch.testing.assert_close(out["mean"], want)
        assert len(server.accepted) == 1
    finally:
        stop(server)
    server = counting_server(reward, port=port)  # restarted on the same port: the pooled connection is dead
    try:
        for _ in range(3):  # retries=0: the stale connection is replaced without using up a try
            torch.testing.assert_close(client(images, ["a", "b"], [{}, {}])["mean"], want)
        assert len(server.accepted) == 1
    finally:
        stop(server)


def test_a_connection_closed_by_the_servers_idle_timeout_is_replaced():
    reward = CountingReward()
    server = counting_server(reward, idle_timeout_s=0.3)
    client = RemoteReward(f"http://127.0.0.1:{server.server_address[1]}", components=["mean"], retries=0)
    try:
        assert client(torch.rand(1, 3, 8, 8), ["a"], [{}])["mean"].isfinite().all()
        time.sleep(0.8)  # the server closes the idle connection
        assert client(torch.rand(1, 3, 8, 8), ["a"], [{}])["mean"].isfinite().all()
        assert len(server.accepted) == 2
    finally:
        stop(server)


def test_the_reward_server_starts_without_importing_diffusers():
    """Its startup, up to the bound server: diffusers (which loads torch's compiler stack, seconds)
    serves no reward; the library-noise settings imported it for every command until they were told."""
    code = ("import sys\nimport flowalign.arguments as A\nfrom flowalign import cli\nbuild = A.reward_server\n"
            "def bound(args):\n    server = build(args)\n    print('diffusers' in sys.modules)\n"
            "    server.server_close()\n    raise SystemExit(0)\n"
            "A.reward_server = bound\n"
            "cli.main(['reward-server', '--reward', 'jpeg_compressibility', '--port', '0'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr[-2000:]

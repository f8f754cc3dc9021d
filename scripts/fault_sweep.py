"""The fault sweep: every input a user can get wrong and every fault a run can meet, tried as a
careless or hostile user would, each classified by what the user sees.

    OMP_NUM_THREADS=1 nice -n 10 python scripts/fault_sweep.py --out docs/fault_sweep.json
    python scripts/fault_sweep.py --only server --verbose      # one class (or a case id's prefix)

Classes of cases: ``config`` (domains of every kind of key, YAML files), ``data`` (prompt files,
conditioning images, prompt lists in Python), ``weights`` (model folders, LoRA files for
``--weights`` and ``model.init_lora``), ``checkpoint`` (output folders, resume), ``reward``
(plug-ins that misbehave), ``server`` (the reward server's CLI and hostile clients), ``cli`` (the
other commands' arguments) and ``environment`` (read-only, full and size-limited disks, missing
packages, no network).

Each case runs in a forked child (one torch thread, its own empty working folder, stdout and stderr
to files) under a deadline, and is classified:

* ``CLEAN``: non-zero exit, one line ``...: error: ...`` naming the culprit (every word of the
  case's ``culprit``, case-insensitively), no traceback, nothing lost. For ``expect="warn"``
  cases, an exit 0 whose output names the culprit is clean too; ``expect="ok"``: exit 0.
* ``TRACEBACK``: a Python traceback reached the user.
* ``SILENT``: exit 0 (or an answer 200) where the input was wrong.
* ``VAGUE``: non-zero exit, no traceback, but no one-line error naming the culprit.
* ``HANG``: still running at the case's deadline (killed).
* ``DATA-LOSS``: a file of an earlier run changed or disappeared, or two runs mixed in one folder.

Cases are cheap (dry runs, a 1-epoch run of a tiny random SD3, an in-process reward server); the
whole sweep takes a few minutes on one core. tests/test_fault_sweep.py runs the fast ones.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import io
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
CLASSES = ("config", "data", "weights", "checkpoint", "reward", "server", "cli", "environment")
VERDICTS = ("CLEAN", "TRACEBACK", "SILENT", "VAGUE", "HANG", "DATA-LOSS")


@dataclasses.dataclass
class Case:
    id: str
    cls: str
    body: Callable  # (ctx, workdir) -> exit code | "VERDICT: reason" (server cases judge themselves)
    culprit: str = ""  # words the error line must hold
    expect: str = "error"  # error | warn | ok
    timeout: float = 60
    setup: Callable | None = None  # (ctx, workdir) in the parent, before the child
    check: Callable | None = None  # (ctx, workdir) -> None | a data-loss message, after the child
    env: dict = dataclasses.field(default_factory=dict)
    fsize: int | None = None  # RLIMIT_FSIZE of the child, bytes
    slow: bool = False  # left out of the test suite's default run


CASES: list[Case] = []


def add(cls: str, id: str, body, culprit: str = "", **kw) -> None:
    CASES.append(Case(f"{cls}/{id}", cls, body, culprit, **kw))


def fill(text: str, ctx: dict, w: Path) -> str:
    for key, value in {**ctx, "w": str(w)}.items():
        text = text.replace("{" + key + "}", str(value))
    return text


def cli(*argv):
    def body(ctx, w):
        from flowalign.cli import main

        return main([fill(a, ctx, w) for a in argv])
    return body


def train(*overrides, dry=True, recipe="{recipe}", out="{w}/out"):
    """``flowalign train`` on the tiny recipe (1 epoch) with ``overrides``; a dry run by default."""
    argv = ["train", recipe, f"output_dir={out}", *overrides]
    return cli(*argv, *(["--dry-run"] if dry else []))


def write(name: str, content: bytes | str):
    def setup(ctx, w):
        path = w / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return setup


def chain(*setups):
    def setup(ctx, w):
        for s in setups:
            s(ctx, w)
    return setup


# -- fixtures ---------------------------------------------------------------------------------------
TINY_OVERRIDES = ("model.lora_rank=4", "tracker=none", "sampling.num_steps=4", "train.epochs=1",
                  "train.groups_per_epoch=2", "train.group_size=4", "train.sample_batch_size=8",
                  "train.train_batch_size=8", "eval.seeds=1", "eval.grid_prompts=2", "eval.grid_seeds=1",
                  "eval.every=0", "checkpoint_every=1", "train.learning_rate=1e-3")


def build_fixtures(root: Path) -> dict:
    """The tiny model, its recipe, a finished run and PNG files (built in a child: the parent stays
    free of torch's threads)."""
    ctx = {"tiny": root / "tiny-sd3", "recipe": root / "tiny.yaml", "done": root / "done", "png": root / "ok.png"}
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import yaml
            from PIL import Image

            from flowalign.config import _GeneralTrainConfig, load_config, to_dict
            from flowalign.trainer import Trainer
            from pipelines.tiny import TinySD3Sizes, build_tiny_sd3_pipeline
            from reward_models.worlds.shapes import vocabulary

            build_tiny_sd3_pipeline(vocabulary(), TinySD3Sizes(), seed=0).save_pretrained(ctx["tiny"])
            config = load_config(None, [f"model.path={ctx['tiny']}", f"output_dir={ctx['done']}", *TINY_OVERRIDES])
            tree = to_dict(config)
            tree.pop("output_dir")
            general = {f.name for f in dataclasses.fields(_GeneralTrainConfig)}
            tree["train"] = {k: v for k, v in tree["train"].items() if k in general}  # defaults: a method= override works
            ctx["recipe"].write_text(yaml.safe_dump(tree))
            Trainer(config).train()
            Image.new("RGB", (16, 16), (200, 30, 30)).save(ctx["png"])
            code = 0
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "building the fixtures failed"
    return {k: str(v) for k, v in ctx.items()}


def tree_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and ".lock" not in p.name}


def copy_done(name: str = "run"):
    """Setup: the finished run copied to WORK/name, its files' hashes kept for the data-loss check."""
    def setup(ctx, w):
        shutil.copytree(ctx["done"], w / name)
        (w / f".{name}.hashes").write_text(json.dumps(tree_hashes(w / name)))
    return setup


def kept(name: str = "run"):
    """Check: every file of the copied run is still there, unchanged."""
    def check(ctx, w):
        before = json.loads((w / f".{name}.hashes").read_text())
        after = tree_hashes(w / name) if (w / name).is_dir() else {}
        changed = [k for k, v in before.items() if after.get(k) != v]
        return f"{len(changed)} file(s) of the earlier run changed or gone, e.g. {changed[:3]}" if changed else None
    return check


# -- child process ----------------------------------------------------------------------------------
def run_case(case: Case, ctx: dict, w: Path) -> dict:
    w.mkdir(parents=True, exist_ok=True)
    if case.setup is not None:
        try:
            case.setup(ctx, w)
        except (OSError, subprocess.CalledProcessError) as error:  # e.g. no right to mount a tmpfs here
            return {"id": case.id, "class": case.cls, "verdict": "SKIP", "why": f"setup failed: {error}",
                    "exit": None, "seconds": 0.0}
    err, verdict_file = w / ".stderr", w / ".verdict"
    began = time.time()
    read_end, write_end = os.pipe()  # a pipe, not a file: a case's file size limit must not cut its messages
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setsid()
            os.close(read_end)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            os.chdir(w)
            os.environ.update(case.env)
            if case.fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (case.fsize, case.fsize))
            result = case.body(ctx, w)
            if isinstance(result, str):
                verdict_file.write_text(result)
                code = 0
            else:
                code = int(result or 0)
        except SystemExit as error:  # argparse's usage errors
            code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
            if not isinstance(error.code, int) and error.code is not None:
                print(error.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001  (what would reach the user as a traceback)
            traceback.print_exc()
            code = 99
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)

    def copy():
        with open(err, "wb") as f, os.fdopen(read_end, "rb") as pipe:
            while chunk := pipe.read1(65536):
                f.write(chunk)
    copier = threading.Thread(target=copy, daemon=True)
    copier.start()
    code = None
    while time.time() - began < case.timeout:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.05)
    if code is None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    seconds = time.time() - began
    copier.join(5)  # the pipe closes when the child (and any process it left) is gone
    stderr = err.read_text(errors="replace") if err.exists() else ""
    verdict, why = classify(case, code, stderr, verdict_file.read_text() if verdict_file.exists() else None)
    if case.check is not None and verdict != "HANG":
        lost = case.check(ctx, w)
        if lost:
            verdict, why = "DATA-LOSS", lost
    return {"id": case.id, "class": case.cls, "verdict": verdict, "why": why[:300], "exit": code,
            "seconds": round(seconds, 2)}


def error_line(stderr: str) -> str | None:
    lines = [line.strip() for chunk in stderr.splitlines() for line in chunk.split("\r") if ": error: " in line]
    return lines[-1] if lines else None


def classify(case: Case, code, stderr: str, verdict: str | None) -> tuple[str, str]:
    if code is None:
        return "HANG", f"still running after {case.timeout:g} s"
    if "Traceback (most recent call last)" in stderr or code == 99:
        last = [line for line in stderr.strip().splitlines() if line.strip()]
        return "TRACEBACK", last[-1] if last else "traceback"
    if verdict is not None:
        name, _, why = verdict.partition(":")
        return name.strip(), why.strip()
    words = case.culprit.lower().split()
    line = error_line(stderr)
    if code == 0:
        if case.expect == "ok":
            return "CLEAN", "exit 0 as expected"
        if case.expect == "warn":
            said = [line for line in stderr.splitlines() if all(w in line.lower() for w in words)]
            if said:
                return "CLEAN", said[-1].strip()
        return "SILENT", "exit 0: " + (stderr.strip().splitlines() or ["(nothing on stderr)"])[-1][:200]
    if line is None:
        return "VAGUE", f"exit {code} without an error line: {(stderr.strip().splitlines() or [''])[-1][:200]}"
    if not all(w in line.lower() for w in words):
        return "VAGUE", f"does not name {case.culprit!r}: {line}"
    return "CLEAN", line


# -- plug-in rewards (registered in the parent; the children inherit them) ----------------------------
def register_plugins() -> None:
    import torch

    from reward_models.base import register_reward

    def plugin(name, fn, components=("score",)):
        class Plugin:
            def __init__(self, **kwargs):
                self.kwargs = kwargs

            def __call__(self, samples, prompts, metadata):
                return fn(samples, prompts, metadata)
        Plugin.components = components
        Plugin.__name__ = Plugin.__qualname__ = name
        register_reward(name)(Plugin)

    def mean(s):
        return s.float().mean(dim=tuple(range(1, s.ndim)))

    plugin("sweep_b_plus_1", lambda s, p, m: {"score": torch.zeros(len(p) + 1)})
    plugin("sweep_b_minus_1", lambda s, p, m: {"score": torch.zeros(len(p) - 1)})
    plugin("sweep_2d", lambda s, p, m: {"score": torch.zeros(len(p), 2)})
    plugin("sweep_scalar", lambda s, p, m: {"score": torch.tensor(0.5)})
    plugin("sweep_none", lambda s, p, m: None)
    plugin("sweep_list_of_str", lambda s, p, m: {"score": ["good"] * len(p)})
    plugin("sweep_wrong_component", lambda s, p, m: {"other": mean(s)}, components=())
    plugin("sweep_inf", lambda s, p, m: {"score": torch.full((len(p),), float("inf"))})
    plugin("sweep_complex", lambda s, p, m: {"score": torch.zeros(len(p), dtype=torch.complex64)})
    plugin("sweep_all_nan", lambda s, p, m: {"score": torch.full((len(p),), float("nan"))})
    plugin("sweep_nan_in_training", lambda s, p, m: {"score": torch.full((len(p),), float("nan"))
                                                     if "group_id" in m[0] else mean(s)})

    def sys_exit(s, p, m):
        raise SystemExit(3)

    def interrupt(s, p, m):
        raise KeyboardInterrupt

    def forever(s, p, m):
        threading.Event().wait()

    plugin("sweep_sys_exit", sys_exit)
    plugin("sweep_keyboard_interrupt", interrupt)
    plugin("sweep_hangs", forever)

    @register_reward("sweep_bad_constructor")
    class BadConstructor:
        components = ("score",)

        def __init__(self):
            raise ValueError("cannot open the verifier's model")


# -- the cases ---------------------------------------------------------------------------------------
def _method_for(override: str) -> list[str]:
    """``method=M`` for a method's own train option (refused under another method), else nothing."""
    from flowalign.config import _GeneralTrainConfig
    from flowalign.objectives.base import method_options, option_owners

    key = override.split("=", 1)[0]
    owner = option_owners(method_options(), _GeneralTrainConfig).get(key.removeprefix("train."), "general")
    return [] if not key.startswith("train.") or owner == "general" else [f"method={owner.split(', ')[0]}"]


def config_cases() -> None:
    domains = [  # (override, the key the error must name)
        ("train.max_grad_norm=-1", "max_grad_norm"), ("train.max_grad_norm=0", "max_grad_norm"),
        ("train.max_grad_norm=.inf", "max_grad_norm"), ("train.max_grad_norm=.nan", "max_grad_norm"),
        ("train.advantage_clip=-1", "advantage_clip"), ("train.advantage_clip=0", "advantage_clip"),
        ("train.advantage_clip=.nan", "advantage_clip"),
        ("train.weight_decay=-0.1", "weight_decay"), ("train.weight_decay=.inf", "weight_decay"),
        ("train.adam_betas=[1.5, 0.9]", "adam_betas"), ("train.adam_betas=[0.9]", "adam_betas"),
        ("train.adam_betas=[0.9, 0.999, 0.5]", "adam_betas"), ("train.adam_betas=[-0.1, 0.9]", "adam_betas"),
        ("train.clip_range=.inf", "clip_range"), ("train.clip_range=-1", "clip_range"),
        ("train.kl_beta=-1", "kl_beta"), ("train.kl_beta=.inf", "kl_beta"),
        ("train.warmup_epochs=-1", "warmup_epochs"), ("train.max_minutes=-1", "max_minutes"),
        ("train.max_minutes=0", "max_minutes"), ("train.learning_rate=.inf", "learning_rate"),
        ("train.learning_rate=-1", "learning_rate"),
        ("train.groups_per_epoch=1000000000", "groups_per_epoch"), ("train.group_size=1000000000", "group_size"),
        ("train.sample_batch_size=0", "sample_batch_size"), ("train.ema_decay=1", "ema_decay"),
        ("train.ema_decay=-0.5", "ema_decay"), ("train.rng_shards=0", "rng_shards"),
        ("train.max_nan_epochs=-1", "max_nan_epochs"), ("train.epochs=-1", "epochs"),
        ("train.inner_epochs=0", "inner_epochs"), ("train.keep_extremes=-1", "keep_extremes"),
        ("train.group_size=1", "group_size"), ("train.train_batch_size=0", "train_batch_size"),
        ("train.seed=-1", "seed"), ("train.seed=99999999999999999999", "seed"),
        ("train.nft_beta=0", "nft_beta"), ("train.nft_beta=-1", "nft_beta"),
        ("train.nft_old_decay_rate=-1", "nft_old_decay_rate"), ("train.nft_old_decay_max=1.5", "nft_old_decay_max"),
        ("train.gdro_beta=-1", "gdro_beta"), ("train.gdro_tau=0", "gdro_tau"), ("train.gdro_gamma=-1", "gdro_gamma"),
        ("train.dgpo_beta=0", "dgpo_beta"), ("train.dgpo_noise_levels=-1", "dgpo_noise_levels"),
        ("train.noise_draws=0", "noise_draws"), ("train.entropy_coef=.inf", "entropy_coef"),
        ("train.awm_ema_beta=-1", "awm_ema_beta"), ("train.awm_ema_decay=1.5", "awm_ema_decay"),
        ("train.awm_ghuber_power=-1", "awm_ghuber_power"),
        ("sampling.num_steps=0", "num_steps"), ("sampling.eta=-1", "eta"), ("sampling.eta=.inf", "eta"),
        ("sampling.fraction=0", "fraction"), ("sampling.fraction=1.5", "fraction"),
        ("sampling.fraction=-0.5", "fraction"), ("sampling.window_size=0", "window_size"),
        ("sampling.window_size=100", "window_size"), ("sampling.window_start=-1", "window_start"),
        ("sampling.window_start=100", "window_start"), ("sampling.guidance_scale=-1", "guidance_scale"),
        ("sampling.guidance_scale=.inf", "guidance_scale"), ("sampling.temperature=.inf", "temperature"),
        ("sampling.temperature=0", "temperature"), ("sampling.window_stride=0", "window_stride"),
        ("model.lora_alpha=0", "lora_alpha"), ("model.lora_alpha=-1", "lora_alpha"),
        ("model.lora_alpha=.inf", "lora_alpha"), ("model.lora_rank=-1", "lora_rank"),
        ("model.height=30", "height"), ("model.height=-16", "height"), ("model.width=0", "width"),
        ("model.num_frames=0", "num_frames"), ("model.prompt_cache_size=-1", "prompt_cache_size"),
        ("model.lora_targets=[]", "lora_targets"),
        ("reward.weights={score: .inf}", "reward.weights"), ("reward.weights={}", "reward.weights"),
        ("reward.weights={score: .nan}", "reward.weights"), ("reward.weights={score: 0}", "reward.weights"),
        ("reward.timeout_s=0", "timeout_s"), ("reward.timeout_s=-1", "timeout_s"),
        ("reward.on_error=ignore", "on_error"),
        ("eval.seeds=1000000000", "eval.seeds"), ("eval.batch_size=0", "batch_size"), ("eval.every=-1", "every"),
        ("eval.num_steps=0", "num_steps"), ("eval.grid_prompts=0", "grid_prompts"),
        ("output_dir=", "output_dir"), ("threads=-1", "threads"), ("checkpoint_every=-1", "checkpoint_every"),
        ("checkpoints_kept=-1", "checkpoints_kept"), ("tracker=bogus", "tracker"), ("method=bogus", "method"),
        ("resume={w}/no-such-checkpoint", "resume"),
        ("explore.learning_rate=-1", "explore.learning_rate"), ("explore.hidden=0", "hidden"),
        ("routing.warmup=-1", "warmup"), ("routing.strength=-1", "strength"),
        ("routing.max_residual=-1", "max_residual"), ("routing.gram_decay=1.5", "gram_decay"),
        ("routing.floor_max=-1", "floor_max"), ("routing.token_alpha=-1", "token_alpha"),
        ("routing.layer_scale_min=-1", "layer_scale_min"), ("routing.layer_scale_max=0", "layer_scale_max"),
        ("train.bogus_key=1", "bogus_key"), ("model.lora_rank=four", "lora_rank"),
        ("train.ema_warmup=bogus", "ema_warmup"), ("train.lr_schedule=bogus", "lr_schedule"),
        ("train.max_cpu_minutes=-1", "max_cpu_minutes"), ("sampling.window_range=[-1, 2]", "window_range"),
        ("tracker_samples=0", "tracker_samples"), ("tracker_samples_every=-1", "tracker_samples_every"),
        ("hub.strategy=bogus", "hub.strategy"),
    ]
    for override, key in domains:
        add("config", override, train(*_method_for(override), override), key)

    yaml_files = [
        ("empty", b"", "empty"), ("comments_only", b"# nothing here\n", "empty"),
        ("binary", bytes(range(256)) * 4, "yaml"), ("latin1", "method: flow_grpo  # caf\xe9\n".encode("latin-1"),
                                                    "utf-8"),
        ("top_level_list", b"- train\n- eval\n", "mapping"), ("syntax", b"train: {epochs: 2\n", "yaml"),
        ("null_section", b"train:\n", "train"), ("tab_indent", b"train:\n\tepochs: 2\n", "yaml"),
    ]
    for name, content, culprit in yaml_files:
        add("config", f"yaml_{name}", cli("train", "{w}/recipe.yaml", "output_dir={w}/out", "--dry-run"),
            f"recipe.yaml {culprit}", setup=write("recipe.yaml", content))
    add("config", "recipe_missing", cli("train", "{w}/nope.yaml", "--dry-run"), "nope.yaml")
    add("config", "recipe_is_a_folder", cli("train", "{w}", "--dry-run"), "folder")


def data_cases() -> None:
    png_bytes = Path  # placeholder for readability below
    del png_bytes
    files = [  # (file name, content, culprit)
        ("empty.txt", b"", "empty.txt"), ("blank.txt", b"\n  \n\n", "blank.txt"),
        ("latin1.txt", "un caf\xe9\n".encode("latin-1"), "latin1.txt utf-8"),
        ("binary.txt", bytes(range(256)) * 8, "binary.txt"),
        ("null_prompt.jsonl", b'{"prompt": null}\n', "null_prompt.jsonl line 1"),
        ("number_prompt.jsonl", b'{"prompt": 42}\n', "number_prompt.jsonl line 1"),
        ("list_prompt.jsonl", b'{"prompt": ["a", "b"]}\n', "list_prompt.jsonl line 1"),
        ("empty_prompt.jsonl", b'{"prompt": ""}\n', "empty_prompt.jsonl"),
        ("not_object.jsonl", b'["a red circle"]\n', "not_object.jsonl line 1"),
        ("bad_json.jsonl", b'{"prompt": "a"\n', "bad_json.jsonl line 1"),
        ("latin1.jsonl", '{"prompt": "caf\xe9"}\n'.encode("latin-1"), "latin1.jsonl utf-8"),
        ("image_number.jsonl", b'{"prompt": "a red circle", "image": 5}\n', "image_number.jsonl image"),
        ("image_missing.jsonl", b'{"prompt": "a red circle", "image": "nope.png"}\n', "nope.png"),
        ("image_text.jsonl", b'{"prompt": "a red circle", "image": "fake.png"}\n', "fake.png"),
        ("image_truncated.jsonl", b'{"prompt": "a red circle", "image": "cut.png"}\n', "cut.png"),
        ("image_folder.jsonl", b'{"prompt": "a red circle", "image": "."}\n', "image"),
        ("no_header.csv", b"a red circle\na blue square\n", "no_header.csv prompt"),
        ("empty_cell.csv", b"prompt,tag\n,shapes\n", "empty_cell.csv line 2"),
        ("huge_prompt.txt", b"a red circle " * 400_000 + b"\n", "huge_prompt.txt"),
        ("many_lines.txt", b"\n" * 3 + b"x" * 70_000 + b"\n", "many_lines.txt"),
        ("prompts.pdf", b"%PDF-1.4\n", "prompts.pdf"),
    ]

    def images(ctx, w):
        (w / "fake.png").write_text("not an image")
        data = Path(ctx["png"]).read_bytes()
        (w / "cut.png").write_bytes(data[: len(data) // 2])

    for name, content, culprit in files:
        add("data", f"train_prompts_{name}", train(f"data.train_prompts={{w}}/{name}"), culprit,
            setup=chain(write(name, content), images))
    for name, content, culprit in files[:6]:
        add("data", f"eval_prompts_{name}", train(f"data.eval_prompts={{w}}/{name}"), culprit,
            setup=write(name, content))
    add("data", "train_prompts_missing", train("data.train_prompts={w}/nope.txt", dry=False), "nope.txt")
    add("data", "train_prompts_split_typo", train("data.train_prompts=shapes:trian"), "trian")
    add("data", "train_prompts_folder", train("data.train_prompts={w}"), "train_prompts")

    def api(prompts, eval_prompts=None):
        def body(ctx, w):
            import flowalign

            flowalign.train(str(ctx["recipe"]), [f"output_dir={w}/out"], prompts=prompts, eval_prompts=eval_prompts)
            return 0
        return body

    def api_main(body):  # the Python API: an exception with a one-line message is the clean outcome
        def wrapped(ctx, w):
            from flowalign.errors import ConfigError

            try:
                return body(ctx, w)
            except (ConfigError, ValueError, TypeError, FileNotFoundError) as error:
                if "\n" in str(error).strip():
                    print(f"flowalign: error: (several lines) {error}", file=sys.stderr)
                    return 3
                print(f"flowalign: error: {type(error).__name__}: {error}", file=sys.stderr)
                return 2
        return wrapped

    add("data", "api_empty_prompt_list", api_main(api([])), "prompts empty")
    add("data", "api_number_prompts", api_main(api([1, 2])), "prompts")
    add("data", "api_blank_prompts", api_main(api(["", "  "])), "prompts")
    add("data", "api_none_prompt_record", api_main(api([{"prompt": None}])), "prompts")
    add("data", "api_empty_eval_prompts", api_main(api(["a red circle"], [])), "eval_prompts empty")
    add("data", "api_string_not_list", api_main(api("a red circle")), "prompts list")


def weights_cases() -> None:
    import torch

    def lora_variant(kind):
        def setup(ctx, w):
            from safetensors.torch import load_file, save_file

            src = Path(ctx["done"]) / "final"
            dst = w / "lora"
            shutil.copytree(src, dst)
            f = dst / "pytorch_lora_weights.safetensors"
            if kind == "truncated":
                f.write_bytes(f.read_bytes()[:-200])
            elif kind == "text":
                f.write_text("not a safetensors file")
            elif kind == "empty_file":
                f.write_bytes(b"")
            elif kind in ("nan", "shape", "targets", "partial", "extra_keys"):
                state = load_file(f)
                if kind == "nan":
                    state = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
                elif kind == "shape":
                    state = {k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in state.items()}
                elif kind == "targets":
                    state = {k.replace("attn.to_q", "attn.no_such_module").replace("attn.to_k", "attn.no_such_k")
                             .replace("attn.to_v", "nowhere.v").replace("to_out.0", "nothing.0")
                             .replace("add_q_proj", "bogus_q").replace("add_k_proj", "bogus_k")
                             .replace("add_v_proj", "bogus_v").replace("to_add_out", "bogus_out"): v
                             for k, v in state.items()}
                elif kind == "partial":
                    state = {k: v for k, v in state.items() if "to_q" in k}
                elif kind == "extra_keys":
                    state = {**state, "transformer.transformer_blocks.0.attn.ghost.lora_A.weight":
                             torch.zeros(4, 16), "transformer.transformer_blocks.0.attn.ghost.lora_B.weight":
                             torch.zeros(16, 4)}
                save_file(state, f)
            elif kind == "missing_file":
                f.unlink()
        return setup

    kinds = {"truncated": "lora truncated", "text": "lora", "empty_file": "lora", "nan": "lora nan",
             "shape": "lora shape", "targets": "lora", "partial": "lora", "extra_keys": "lora ghost",
             "missing_file": "lora"}
    for kind, culprit in kinds.items():
        expect = "warn" if kind == "partial" else "error"
        add("weights", f"sample_weights_{kind}", cli("sample", "--model", "{tiny}", "--weights", "{w}/lora",
                                                     "a red circle", "--seeds", "0", "--out", "{w}/s.png"),
            culprit, setup=lora_variant(kind), expect=expect)
        add("weights", f"init_lora_{kind}", train("model.init_lora={w}/lora", dry=False), culprit,
            setup=lora_variant(kind), expect=expect)
    add("weights", "grid_policy_lora_nan", cli("grid", "--model", "{tiny}", "--policies", "{w}/lora", "--seeds", "0",
                                               "--max-prompts", "1", "--out", "{w}/g.png"),
        "lora nan", setup=lora_variant("nan"))
    add("weights", "eval_policy_lora_shape", cli("eval", "--model", "{tiny}", "--policies", "{w}/lora", "--seeds",
                                                 "0", "--max-prompts", "1", "--out", "{w}/e"),
        "lora shape", setup=lora_variant("shape"))
    add("weights", "sample_weights_missing", cli("sample", "--model", "{tiny}", "--weights", "{w}/nope", "x"), "nope")

    def model_variant(kind):
        def setup(ctx, w):
            dst = w / "model"
            shutil.copytree(ctx["tiny"], dst)
            if kind == "corrupt_config":
                (dst / "transformer" / "config.json").write_text("{not json")
            elif kind == "no_index":
                (dst / "model_index.json").unlink()
            elif kind == "truncated_weights":
                f = next((dst / "transformer").glob("*.safetensors"))
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            elif kind == "missing_weights":
                next((dst / "transformer").glob("*.safetensors")).unlink()
            elif kind == "empty":
                shutil.rmtree(dst)
                dst.mkdir()
            elif kind == "index_garbage":
                (dst / "model_index.json").write_bytes(b"\xff\xfe garbage")
            elif kind == "vae_missing":
                shutil.rmtree(dst / "vae")
        return setup

    models = {"corrupt_config": "transformer config.json", "no_index": "model_index.json",
              "truncated_weights": "transformer safetensors", "missing_weights": "transformer",
              "empty": "model_index.json", "index_garbage": "model_index.json", "vae_missing": "vae"}
    for kind, culprit in models.items():
        add("weights", f"model_{kind}", train("model.path={w}/model", dry=False), culprit, setup=model_variant(kind))
        add("weights", f"sample_model_{kind}", cli("sample", "--model", "{w}/model", "x", "--seeds", "0",
                                                   "--out", "{w}/s.png"), culprit, setup=model_variant(kind))
    add("weights", "model_missing", train("model.path={w}/nope"), "nope")
    add("weights", "model_builtin_typo", train("model.path=shapes-sd33"), "shapes-sd33")


def checkpoint_cases() -> None:
    add("checkpoint", "rerun_finished_run_without_resume", train(dry=False, out="{w}/run"), "output_dir resume",
        setup=copy_done(), check=kept())

    def started(ctx, w):  # a run stopped after its first checkpoint: no final/ yet
        copy_done()(ctx, w)
        for name in ("final", "metrics.json", "history.jsonl"):
            target = w / "run" / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        (w / ".run.hashes").write_text(json.dumps(tree_hashes(w / "run")))

    add("checkpoint", "rerun_started_run_without_resume", train("train.epochs=2", dry=False, out="{w}/run"),
        "output_dir resume", setup=started, check=kept())
    for override, key in (("train.seed=1", "seed"), ("method=dance_grpo", "method"),
                          ("model.lora_rank=8", "lora_rank"), ("model.lora_alpha=8", "lora_alpha"),
                          ("sampling.num_steps=6", "num_steps"), ("reward.name=jpeg_compressibility", "reward")):
        add("checkpoint", f"resume_after_changing_{key}", train("train.epochs=2", "resume=auto", override, dry=False,
                                                                out="{w}/run"),
            key, setup=copy_done(), check=kept())
    add("checkpoint", "resume_path_missing", train("resume={w}/nope", dry=False), "nope")
    add("checkpoint", "resume_not_a_checkpoint", train("resume={w}", dry=False), "state.json")
    add("checkpoint", "resume_bogus_word", train("resume=latest", dry=False), "resume latest")

    def corrupt_state(ctx, w):
        copy_done()(ctx, w)
        (w / "run" / "checkpoints" / "epoch-000001" / "state.json").write_text("{")
        (w / ".run.hashes").write_text(json.dumps(tree_hashes(w / "run")))

    add("checkpoint", "resume_corrupt_state", train("train.epochs=2", "resume=auto", dry=False, out="{w}/run"),
        "state.json", setup=corrupt_state, check=kept())

    def two_runs(ctx, w):
        from flowalign.cli import main

        pids = []
        for k in range(2):
            pid = os.fork()
            if pid == 0:
                code = 99
                try:
                    os.dup2(os.open(w / f".run{k}.err", os.O_WRONLY | os.O_CREAT, 0o644), 2)
                    time.sleep(0.5 * k)
                    code = main(["train", ctx["recipe"], f"output_dir={w}/shared", "train.epochs=3"])
                except BaseException:  # noqa: BLE001
                    traceback.print_exc()
                finally:
                    os._exit(code)
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
        errs = [(w / f".run{k}.err").read_text(errors="replace") for k in range(2)]
        if any("Traceback" in e for e in errs):
            return "TRACEBACK: " + [e for e in errs if "Traceback" in e][0].strip().splitlines()[-1]
        if codes.count(0) == 2:
            return "DATA-LOSS: two runs wrote one output_dir, both exit 0 (their checkpoints and outputs mixed)"
        refused = [error_line(e) for c, e in zip(codes, errs) if c != 0]
        if codes.count(0) == 1 and refused[0] and "in use" in refused[0]:
            return f"CLEAN: {refused[0]}"
        return f"VAGUE: exits {codes}: {refused}"

    add("checkpoint", "two_runs_one_output_dir", two_runs, timeout=120)

    def stale_lock(ctx, w):
        (w / "out").mkdir()
        (w / "out" / ".lock").write_text(json.dumps({"pid": 999_999_999, "host": socket.gethostname()}))
    add("checkpoint", "stale_lock_is_taken_over", train(dry=False), "", expect="ok", setup=stale_lock)
    add("checkpoint", "resume_auto_empty_folder_starts_fresh", train("resume=auto", dry=False), "", expect="ok")
    add("checkpoint", "output_dir_is_a_file", train(out="{w}/f"), "output_dir", setup=write("f", "x"))


def reward_cases() -> None:
    plugins = {"sweep_b_plus_1": "sweep_b_plus_1 shape", "sweep_b_minus_1": "sweep_b_minus_1 shape",
               "sweep_2d": "sweep_2d shape", "sweep_scalar": "sweep_scalar shape", "sweep_none": "sweep_none",
               "sweep_list_of_str": "sweep_list_of_str", "sweep_wrong_component": "sweep_wrong_component score",
               "sweep_inf": "sweep_inf inf", "sweep_complex": "sweep_complex",
               "sweep_sys_exit": "sweep_sys_exit systemexit",
               "sweep_keyboard_interrupt": "sweep_keyboard_interrupt keyboardinterrupt",
               "sweep_bad_constructor": "sweep_bad_constructor cannot open"}
    for name, culprit in plugins.items():
        add("reward", name, train(f"reward.name={name}", dry=False), culprit)
    add("reward", "all_nan_under_the_streak_limit", train("reward.name=sweep_all_nan", dry=False),
        "every reward nan")
    add("reward", "nan_in_every_training_batch", train("reward.name=sweep_nan_in_training", "train.epochs=2",
                                                       dry=False), "every reward nan")
    add("reward", "hangs_with_the_default_deadline", train("reward.name=sweep_hangs", dry=False),
        "sweep_hangs", timeout=240, slow=True)
    add("reward", "hangs_with_a_short_deadline", train("reward.name=sweep_hangs", "reward.timeout_s=1", dry=False),
        "sweep_hangs", timeout=60)
    add("reward", "kwargs_unknown", train("reward.kwargs={bogus: 1}"), "bogus")
    add("reward", "kwargs_wrong_type", train("reward.kwargs={min_area: lots}", dry=False), "min_area")
    add("reward", "unknown_name", train("reward.name=nope"), "nope")
    add("reward", "extra_reward_unknown", train("eval.extra_rewards=[nope]"), "nope")
    add("reward", "extra_reward_raises", train("eval.extra_rewards=[sweep_sys_exit]", dry=False), "sweep_sys_exit")
    add("reward", "remote_unreachable", train("reward.name=remote", "reward.kwargs={url: 'http://127.0.0.1:9', "
                                              "retries: 0}", dry=False), "127.0.0.1:9")
    add("reward", "remote_bad_url", train("reward.name=remote", "reward.kwargs={url: 'ftp:/x'}", dry=False), "url")


# -- the reward server ---------------------------------------------------------------------------------
def _png(side: int, color=(0, 0, 0)) -> str:
    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((side, side, 3), color, dtype=np.uint8)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _legit_body(n: int = 2) -> bytes:
    from reward_models.worlds.shapes import prompt_split

    specs = prompt_split("test")[:n]
    return json.dumps({"format": "png", "samples": [_png(16, (120, 60, 30))] * n,
                       "prompts": [s["prompt"] for s in specs], "metadata": specs}).encode()


def _post(port: int, body: bytes, timeout: float = 30, headers=None) -> tuple[int | None, str, float]:
    import http.client

    began = time.time()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/score", body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")[:300], time.time() - began
    except (OSError, http.client.HTTPException) as error:
        return None, f"{type(error).__name__}: {error}", time.time() - began
    finally:
        conn.close()


def _serve(reward: str = "shapes", **bounds):
    """A reward server in a thread of this (child) process, on a free port, through the CLI."""
    from flowalign.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["reward-server", "--reward", reward, "--port", str(port)]
    for key, value in bounds.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    threading.Thread(target=main, args=(argv,), daemon=True).start()
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return port
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the server did not start")


def server_request_case(body_of, culprit: str, status: int = 400, **bounds):
    """One bad request: CLEAN if answered with ``status`` naming ``culprit``, and a legitimate request
    made right after is still scored."""
    def body(ctx, w):
        port = _serve(**bounds)
        code, text, _ = _post(port, body_of())
        legit, _, _ = _post(port, _legit_body())
        if legit != 200:
            return f"HANG: a legitimate request after it got {legit}"
        if code == 200:
            return f"SILENT: accepted with 200: {text[:120]}"
        if code is None:
            return f"VAGUE: no answer: {text}"
        if all(word in text.lower() for word in culprit.lower().split()) and 400 <= code < 500:
            return f"CLEAN: {code} {text[:160]}"
        return f"VAGUE: {code} {text[:160]}"
    return body


def server_cases() -> None:
    serve = ["reward-server", "--reward", "shapes"]
    for args, culprit in ((["--port", "-1"], "port"), (["--port", "70000"], "port"), (["--host", "no.such.host."],
                                                                                        "no.such.host."),
                          (["--host", "999.1.1.1"], "999.1.1.1"), (["--kwargs", "not json"], "kwargs"),
                          (["--kwargs", "[1]"], "kwargs"), (["--kwargs", '{"bogus": 1}'], "bogus"),
                          (["--max-batch", "0"], "max-batch"), (["--max-payload-mb", "-1"], "max-payload-mb"),
                          (["--max-image-pixels", "0"], "max-image-pixels"), (["--timeout-s", "0"], "timeout-s"),
                          (["--idle-timeout-s", "-5"], "idle-timeout-s"), (["--timeout-s", "nan"], "timeout-s")):
        add("server", f"cli_{args[0].strip('-')}_{args[1]}", cli(*serve, *args), culprit, timeout=20)
    add("server", "cli_unknown_reward", cli("reward-server", "--reward", "nope"), "nope", timeout=20)

    def port_in_use(ctx, w):
        from flowalign.cli import main

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            return main([*serve, "--port", str(s.getsockname()[1])])
    add("server", "cli_port_in_use", port_in_use, "port in use", timeout=20)

    def public_without_token(ctx, w):
        from flowalign.cli import main

        result = {}
        thread = threading.Thread(target=lambda: result.update(code=main([*serve, "--host", "0.0.0.0", "--port", "0"])),
                                  daemon=True)
        thread.start()
        thread.join(8)
        if thread.is_alive():
            return "SILENT: serves every client on 0.0.0.0 with no token"
        return result["code"]
    add("server", "public_bind_without_token", public_without_token, "token", timeout=20)

    def legit_meta():
        return json.loads(_legit_body())

    def with_field(field, value):
        def make():
            request = legit_meta()
            request[field] = value
            return json.dumps(request).encode()
        return make

    add("server", "prompts_string", server_request_case(with_field("prompts", "ab"), "prompts"), timeout=40)
    add("server", "metadata_numbers", server_request_case(with_field("metadata", [1, 2]), "metadata"), timeout=40)
    add("server", "samples_not_base64", server_request_case(with_field("samples", ["%%%", "%%%"]), "samples"),
        timeout=40)
    add("server", "format_bogus", server_request_case(with_field("format", "gif"), "format"), timeout=40)
    add("server", "body_not_json", server_request_case(lambda: b"{not json", "json"), timeout=40)
    add("server", "body_array", server_request_case(lambda: b"[1, 2]", "object"), timeout=40)
    add("server", "lengths_differ", server_request_case(with_field("prompts", ["a"]), "length"), timeout=40)
    add("server", "one_huge_png", server_request_case(lambda: json.dumps(
        {"format": "png", "samples": [_png(4000)], "prompts": ["x"], "metadata": [{}]}).encode(), "pixels", 413),
        timeout=60)
    add("server", "request_pixel_budget", server_request_case(lambda: json.dumps(
        {"format": "png", "samples": [_png(1024)] * 24, "prompts": ["x"] * 24, "metadata": [{}] * 24}).encode(),
        "pixels", 413), timeout=120)
    add("server", "metadata_the_reward_cannot_read", server_request_case(
        with_field("metadata", [{"bogus": 1}, {"bogus": 2}]), "metadata"), timeout=40)

    def isolation(ctx, w):
        """A request whose metadata makes the reward raise, batched with legitimate ones."""
        import numpy  # noqa: F401

        port = _serve()
        bad = legit_meta()
        bad["metadata"] = [{"bogus": 1}, {"bogus": 2}]
        results = {}

        def send(key, body):
            results[key] = _post(port, body)
        threads = [threading.Thread(target=send, args=(f"legit{k}", _legit_body())) for k in range(3)]
        threads.insert(1, threading.Thread(target=send, args=("bad", json.dumps(bad).encode())))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        legit = [results[f"legit{k}"][0] for k in range(3)]
        if any(code != 200 for code in legit):
            return f"SILENT: legitimate requests batched with a bad one answered {legit} (bad: {results['bad'][0]})"
        if results["bad"][0] == 200:
            return "SILENT: the bad request was scored"
        return f"CLEAN: legitimate 200s, the bad one {results['bad'][0]}"
    add("server", "bad_request_batched_with_good_ones", isolation, timeout=60)

    def slow_headers(ctx, w):
        port = _serve(idle_timeout_s=2)
        began = time.time()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /score HTTP/1.1\r\n")
            try:
                while time.time() - began < 12:
                    s.sendall(b"X")  # one byte a second: every read is within the idle timeout
                    time.sleep(1)
                    s.setblocking(False)
                    try:
                        if s.recv(1024) == b"":
                            break
                    except BlockingIOError:
                        pass
                    finally:
                        s.setblocking(True)
            except OSError:
                pass
        held = time.time() - began
        if held >= 11:
            return f"HANG: a client dribbling its headers held a connection {held:.0f} s (idle timeout 2 s)"
        return f"CLEAN: closed after {held:.1f} s"
    add("server", "dribbled_headers", slow_headers, timeout=40)

    def flood(ctx, w):
        port = _serve()
        held = []
        for _ in range(900):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=2)
                s.sendall(b"POST /score HTTP/1.1\r\nContent-Length: 10\r\n")
                held.append(s)
            except OSError:
                break
        code, text, seconds = _post(port, _legit_body(), timeout=20)
        for s in held:
            s.close()
        if code != 200:
            return f"HANG: with {len(held)} slow connections held, a legitimate request got {code} ({text[:80]})"
        return f"CLEAN: legitimate request answered in {seconds:.2f} s with {len(held)} connections held"
    add("server", "connection_flood", flood, timeout=90)

    def negative_length(ctx, w):
        port = _serve()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
            answer = s.recv(4096).decode(errors="replace")
        return f"CLEAN: {answer.splitlines()[0]}" if " 400 " in answer else f"VAGUE: {answer[:100]}"
    add("server", "negative_content_length", negative_length, timeout=30)


def cli_cases() -> None:
    grid = ["grid", "--model", "{tiny}", "--max-prompts", "1", "--seeds", "0", "--out", "{w}/g.png"]
    for args, culprit in ((["--steps", "0"], "steps"), (["--steps", "-3"], "steps"),
                          (["--max-prompts", "-1"], "max-prompts"), (["--max-prompts", "0"], "max-prompts"),
                          (["--seeds", "a,b"], "seeds"), (["--seeds", ""], "seeds"), (["--seeds", "-1"], "seeds"),
                          (["--guidance", "nan"], "guidance"), (["--guidance", "inf"], "guidance"),
                          (["--threads", "-1"], "threads"), (["--model-kwargs", "[1]"], "model-kwargs"),
                          (["--model-kwargs", "{bogus: 1}"], "bogus"), (["--model", "{w}/nope"], "nope"),
                          (["--policies", "{w}/nope"], "nope"),
                          (["--out", "{w}/g.txt"], "out"), (["--prompts", "{w}/nope.txt"], "nope.txt"),
                          (["--prompt", ""], "prompt"), (["--image", "{png}"], "image"),
                          (["--prompts", "{w}/empty.txt"], "empty.txt")):
        add("cli", f"grid_{args[0].strip('-')}_{args[1].split('/')[-1] or 'empty'}", cli(*grid, *args), culprit,
            setup=write("empty.txt", ""))
    ev = ["eval", "--model", "{tiny}", "--max-prompts", "1", "--seeds", "0", "--out", "{w}/e"]
    for args, culprit in ((["--rewards", "nope"], "nope"), (["--rewards", ""], "rewards"),
                          (["--rewards", "shapes,"], "rewards"), (["--max-prompts", "-1"], "max-prompts"),
                          (["--prompts", "{w}/empty.txt"], "empty.txt"), (["--out", "{w}/f"], "out"),
                          (["--seeds", "x"], "seeds"), (["--steps", "0"], "steps"), (["--guidance", "nan"], "guidance"),
                          (["--policies", "{w}/nope"], "nope"), (["--rewards", "sweep_bad_constructor"], "cannot open")):
        add("cli", f"eval_{args[0].strip('-')}_{args[1].split('/')[-1] or 'empty'}", cli(*ev, *args), culprit,
            setup=chain(write("empty.txt", ""), write("f", "x")))
    sample = ["sample", "--model", "{tiny}", "--seeds", "0"]
    for args, culprit in ((["--guidance", "nan", "x", "--out", "{w}/s.png"], "guidance"),
                          (["--steps", "0", "x", "--out", "{w}/s.png"], "steps"),
                          (["--seeds", "", "x", "--out", "{w}/s.png"], "seeds"),
                          (["", "--out", "{w}/s.png"], "prompt"),
                          (["x", "--out", "{w}/s.jpgx"], "out"),
                          (["--partial-fen", "8/8/8/8/8/8/8/8 w - - 0 1", "x"], "partial-fen")):
        add("cli", f"sample_{'_'.join(a.strip('-').split('/')[-1] for a in args[:2]) or 'empty'}_{args[-1][-6:]}",
            cli(*sample, *args), culprit)
    report = ["report"]
    for name, args, culprit, setup in (
            ("missing_run", ["{w}/nope"], "nope", None),
            ("run_is_a_file", ["{w}/f"], "f", write("f", "x")),
            ("corrupt_metrics", ["{w}/run"], "metrics.json", chain(copy_done(), write("run/metrics.json", "{"))),
            ("corrupt_config", ["{w}/run"], "config.json", chain(copy_done(), write("run/config.json", "[1"))),
            ("eval_missing", ["{w}/run", "--eval", "{w}/nope"], "nope", copy_done()),
            ("eval_without_summary", ["{w}/run", "--eval", "{w}"], "summary.json", copy_done()),
            ("eval_corrupt_summary", ["{w}/run", "--eval", "{w}/ev"], "summary.json",
             chain(copy_done(), write("ev/summary.json", "{"))),
            ("image_missing", ["{w}/run", "--image", "{w}/nope.png"], "nope.png", copy_done()),
            ("image_not_png", ["{w}/run", "--image", "{w}/fake.png"], "fake.png",
             chain(copy_done(), write("fake.png", "text"))),
            ("out_below_a_file", ["{w}/run", "--out", "{w}/f/index.html"], "out", chain(copy_done(), write("f", "x"))),
            ("history_garbage", ["{w}/run"], "history.jsonl",
             chain(copy_done(), write("run/history.jsonl", "\x00\x01garbage\n")))):
        add("cli", f"report_{name}", cli(*report, *args), culprit, setup=setup)
    for name, args, culprit, setup in (
            ("missing_run", ["{w}/nope", "--repo", "me/x"], "nope", None),
            ("unfinished_run", ["{w}/run", "--repo", "me/x"], "final", copy_done()),
            ("bad_repo_id", ["{w}/run", "--repo", "not a repo!!"], "repo", copy_done()),
            ("no_network", ["{w}/run", "--repo", "me/x", "--endpoint", "http://127.0.0.1:9"], "127.0.0.1:9",
             copy_done())):
        def unfinished(ctx, w, setup=setup, name=name):
            if setup:
                setup(ctx, w)
            if name == "unfinished_run":
                shutil.rmtree(w / "run" / "final")
        add("cli", f"push_{name}", cli("push", *args), culprit, setup=unfinished, env={"HF_TOKEN": "hf_fake"})
    gg = ["generate-groups", "{recipe}", "data.offline_groups={w}/groups", "method=gdro"]
    add("cli", "grid_out_in_a_new_folder", cli(*grid, "--out", "{w}/new/dir/g.png"), "", expect="ok")
    add("cli", "sample_out_in_a_new_folder", cli(*sample, "x", "--out", "{w}/new/s.png"), "", expect="ok")
    add("cli", "generate_groups_negative", cli(*gg, "--groups", "-1"), "groups")
    add("cli", "generate_groups_zero", cli(*gg, "--groups", "0"), "groups")
    add("cli", "generate_groups_no_folder", cli("generate-groups", "{recipe}", "--groups", "2"), "offline_groups")
    add("cli", "recipes_show_unknown", cli("recipes", "--show", "nope"), "nope")


def environment_cases() -> None:
    def tmpfs(size: str, ro: bool = False):
        def setup(ctx, w):
            (w / "disk").mkdir()
            options = f"size={size}" + (",ro" if ro else "")
            subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(w / "disk")], check=True,
                           capture_output=True)
        return setup

    def unmount(ctx, w):
        subprocess.run(["umount", "-l", str(w / "disk")], check=False)
        return None

    can_mount = os.geteuid() == 0 and shutil.which("mount") is not None
    if can_mount:
        for size, what in (("8k", "early"), ("150k", "late")):
            add("environment", f"train_full_disk_{what}", train(dry=False, out="{w}/disk/run"), "disk/run",
                setup=tmpfs(size), check=unmount)
        add("environment", "train_read_only", train(dry=False, out="{w}/disk/run"), "disk read-only",
            setup=tmpfs("1m", ro=True), check=unmount)
        add("environment", "grid_full_disk", cli("grid", "--model", "{tiny}", "--max-prompts", "2", "--seeds", "0",
                                                 "--out", "{w}/disk/g.png"), "disk/g.png", setup=tmpfs("4k"),
            check=unmount)
        add("environment", "eval_read_only", cli("eval", "--model", "{tiny}", "--max-prompts", "1", "--seeds", "0",
                                                 "--out", "{w}/disk/e"), "disk/e", setup=tmpfs("1m", ro=True),
            check=unmount)
        add("environment", "report_read_only", cli("report", "{done}", "--out", "{w}/disk/r.html"), "disk/r.html",
            setup=tmpfs("1m", ro=True), check=unmount)
        add("environment", "sample_read_only", cli("sample", "--model", "{tiny}", "x", "--seeds", "0", "--out",
                                                   "{w}/disk/s.png"), "disk/s-0.png read-only", setup=tmpfs("1m", ro=True),
            check=unmount)
        add("environment", "generate_groups_full_disk", cli("generate-groups", "{recipe}", "method=gdro",
                                                            "data.offline_groups={w}/disk/groups", "--groups", "2"),
            "disk/groups", setup=tmpfs("8k"), check=unmount)
    for size, what in ((2_000, "config"), (30_000, "checkpoint")):
        add("environment", f"train_file_size_limit_{what}", train(dry=False, out="{w}/run"), "run", fsize=size)
    add("environment", "resume_after_file_size_limit", cli("train", "{recipe}", "output_dir={w}/run",
                                                           "train.epochs=2", "resume=auto"), "", expect="ok",
        setup=copy_done())
    add("environment", "grid_file_size_limit", cli("grid", "--model", "{tiny}", "--max-prompts", "2", "--seeds", "0",
                                                   "--out", "{w}/g.png"), "g.png", fsize=100)

    def blocked(package, argv):
        def body(ctx, w):
            sys.modules[package] = None  # what a missing optional package looks like to an import
            from flowalign.cli import main

            return main([fill(a, ctx, w) for a in argv])
        return body
    add("environment", "pytesseract_missing", blocked("pytesseract", ["train", "{recipe}", "output_dir={w}/o",
                                                                      "reward.name=ocr", "--dry-run"]),
        "pytesseract pip install")
    add("environment", "python_chess_missing", blocked("chess", ["eval", "--model", "{tiny}", "--rewards",
                                                                 "chess_puzzle", "--out", "{w}/e"]), "chess pip install")
    add("environment", "hub_offline", train("model.path=no-such-org/no-such-model", dry=False), "no-such-org",
        env={"HF_HUB_OFFLINE": "1"})
    add("environment", "home_unwritable_cache", train(dry=False), "", expect="ok",
        env={"HF_HOME": "/proc/no-such-dir"})


def all_cases() -> list[Case]:
    if not CASES:
        for make in (config_cases, data_cases, weights_cases, checkpoint_cases, reward_cases, server_cases,
                     cli_cases, environment_cases):
            make()
    return CASES


def prepare(root: Path) -> dict:
    """Imports, plug-ins and fixtures, once, before the children fork."""
    import torch

    torch.set_num_threads(1)
    import flowalign.cli
    import flowalign.trainer  # noqa: F401
    import reward_models.remote
    import reward_models.shapes

    register_plugins()
    ctx = build_fixtures(root)
    # what every child would otherwise import again (seconds each): the adapter, its pipeline, the rewards
    from flowalign.config import load_config
    from flowalign.preflight import dry_run
    from pipelines.sd3 import SD3Adapter  # noqa: F401
    import reward_models.jpeg  # noqa: F401

    dry_run(load_config(ctx["recipe"], [f"output_dir={root}/warm"]))
    return ctx


def totals(results: list[dict]) -> dict:
    results = [r for r in results if r["verdict"] != "SKIP"]  # a case this machine cannot set up
    count = Counter(r["verdict"] for r in results)
    out = {v: count.get(v, 0) for v in VERDICTS}
    out["cases"] = len(results)
    out["clean_share"] = round(out["CLEAN"] / max(len(results), 1), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="a class, or a case id's prefix (comma-separated)")
    parser.add_argument("--skip-slow", action="store_true", help="leave out the slow cases (the default deadline)")
    parser.add_argument("--out", default=None, help="a JSON file for every case's verdict and the totals")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cases = all_cases()
    if args.only:
        prefixes = args.only.split(",")
        cases = [c for c in cases if any(c.id.startswith(p) or c.cls == p for p in prefixes)]
    if args.skip_slow:
        cases = [c for c in cases if not c.slow]
    root = Path(tempfile.mkdtemp(prefix="fault-sweep-"))
    began = time.time()
    ctx = prepare(root)
    results = []
    for k, case in enumerate(cases):
        result = run_case(case, ctx, root / "cases" / f"{k:03d}")
        results.append(result)
        if args.verbose or result["verdict"] != "CLEAN":
            print(f"{result['verdict']:9s} {case.id}: {result['why']}", flush=True)
    by_class = {cls: totals([r for r in results if r["class"] == cls]) for cls in CLASSES}
    summary = {"totals": totals(results), "by_class": by_class, "seconds": round(time.time() - began),
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True).stdout.strip(), "results": results}
    print(json.dumps({"totals": summary["totals"], "by_class": {c: {k: v for k, v in t.items() if v}
                                                                  for c, t in by_class.items()}}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    for line in Path("/proc/mounts").read_text().splitlines():  # tmpfs disks of cases that hung
        if str(root) in line.split()[1]:
            subprocess.run(["umount", "-l", line.split()[1]], check=False)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

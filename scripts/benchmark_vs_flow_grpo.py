"""flowalign against Flow-GRPO's own code, side by side in one process, on the same tiny SD3 model.

    OMP_NUM_THREADS=1 python scripts/benchmark_vs_flow_grpo.py --rounds 5 --out docs/flow_grpo_side_by_side.json
    OMP_NUM_THREADS=1 python scripts/benchmark_vs_flow_grpo.py --flow-grpo-src /path/to/flow_grpo
    OMP_NUM_THREADS=1 python scripts/benchmark_vs_flow_grpo.py --reuse-uncond   # train.reuse_rollout_uncond

The peer's code is not part of this repository: it is read at run time from a checkout of
https://github.com/yifan123/flow_grpo at commit ac4c86e (``--flow-grpo-src``, or else downloaded
from GitHub into ``~/.cache/flowalign/``); without either the script says so and exits 0. Its
functions are used as they are: ``pipeline_with_logprob`` and ``sde_step_with_logprob``
(flow_grpo/diffusers_patch, imported), ``PerPromptStatTracker`` (flow_grpo/stat_tracking.py), and,
from scripts/train_sd3.py (a script whose imports — wandb, absl, accelerate — a library cannot
need), the function ``compute_log_prob`` and the statements of its training loop from the
advantage clamp to the loss (the PPO clip and the KL), both read with ``ast`` from the file and
compiled unchanged into a function of their free variables.

Model: the shipped shapes-sd3 (an SD3Transformer2DModel of 7 blocks, 9.1 M parameters, with
its VAE and CLIP encoders), LoRA rank 32 on train_sd3.py's targets, batch 4, CFG 4.5 (Flow-GRPO's
``train.cfg = True``: the unconditional branch detached; flowalign: ``train.detach_uncond: true``),
10 steps, noise level 0.7 (η = 0.7), one thread. Each round times every variant once, in a fixed
interleaved order, in process CPU time; the table gives medians over rounds of ratios formed
within a round, so that machine load hits both sides alike.

Rows (each a ratio of times, lower is better except the last):

* rollout with log-probs ÷ the plain ``StableDiffusion3Pipeline.__call__`` (same embeddings, steps,
  CFG, decoded to "pt"): the peer's ``pipeline_with_logprob``; flowalign's ``rollout`` + decode.
* LoRA step ÷ one LoRA forward: one trained timestep of a 4-sample minibatch (forward with
  gradient, log-prob, PPO loss, backward, and 1/S of the gradient clip and AdamW step that close
  the minibatch's S timesteps), over one no-gradient forward of the CFG batch (8 rows).
  flowalign: ``Trainer.update_policy`` (its whole update on that minibatch) / S.
* LoRA + KL step: the same with the reference policy's forward (LoRA off) and the KL term.
* full fine-tune step ÷ one forward of the full model.
* epoch samples/s, flowalign ÷ the faithful Flow-GRPO loop: sample 2 groups of 4 (one prompt
  each) with log-probs, score (the shapes verifier), per-prompt advantages, one update over the
  trained timesteps of each 4-sample minibatch. Both train the same 9 SDE steps (the last,
  deterministic step of flowalign's plan has no log-prob; the peer loop is given the same 9).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import torch

PEER_REPO = "https://github.com/yifan123/flow_grpo"
PEER_COMMIT = "ac4c86e8cae021841f1fde853d340e0db67690dd"  # ac4c86e
CACHE = Path.home() / ".cache" / "flowalign"
BATCH, STEPS, GUIDANCE, NOISE_LEVEL = 4, 10, 4.5, 0.7


# -- the peer's code ------------------------------------------------------------------------------
def peer_checkout(src: str | None) -> Path | None:
    """A checkout of flow_grpo at PEER_COMMIT: ``src``, or the cached / downloaded archive; None if neither."""
    if src:
        path = Path(src).expanduser()
        return path if (path / "scripts" / "train_sd3.py").is_file() else None
    target = CACHE / f"flow_grpo-{PEER_COMMIT[:7]}"
    if (target / "scripts" / "train_sd3.py").is_file():
        return target
    url = f"{PEER_REPO}/archive/{PEER_COMMIT}.tar.gz"
    try:
        with urllib.request.urlopen(url, timeout=30) as response, tempfile.TemporaryFile() as f:
            f.write(response.read())
            f.seek(0)
            with tarfile.open(fileobj=f) as tar:
                members = [m for m in tar.getmembers() if m.name.split("/", 1)[-1].startswith(("flow_grpo/", "scripts/"))]
                CACHE.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
                    tar.extractall(tmp, members=members, filter="data")
                    Path(tmp, f"flow_grpo-{PEER_COMMIT}").rename(target)
        return target
    except Exception as error:  # noqa: BLE001  (no network, no GitHub, a bad archive: the caller skips)
        print(f"could not download {url}: {type(error).__name__}: {error}")
        return None


def _function_from_script(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"train_sd3.py has no function {name}")


def _loss_statements(tree: ast.Module) -> list[ast.stmt]:
    """train_sd3.py's statements from ``advantages = torch.clamp(...)`` to the ``if config.train.beta > 0``
    that sets ``loss`` (the PPO clip and the KL), as they stand in its training loop."""
    def assigns(stmt, name):
        return isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)

    for node in ast.walk(tree):
        for body in (getattr(node, "body", None), getattr(node, "orelse", None)):
            if isinstance(body, list) and any(assigns(s, "ratio") for s in body):
                start = next(i for i, s in enumerate(body) if assigns(s, "advantages"))
                end = next(i for i, s in enumerate(body) if i > start and isinstance(s, ast.If)
                           and any(assigns(b, "loss") for b in s.body))
                return body[start:end + 1]
    raise LookupError("train_sd3.py: the training loop's loss statements were not found")


def load_peer(root: Path) -> SimpleNamespace:
    """The peer's functions (module docstring). Its package directory is put on sys.path as it is."""
    sys.path.insert(0, str(root))
    pipeline = importlib.import_module("flow_grpo.diffusers_patch.sd3_pipeline_with_logprob")
    sde = importlib.import_module("flow_grpo.diffusers_patch.sd3_sde_with_logprob")
    tracking = importlib.import_module("flow_grpo.stat_tracking")
    tree = ast.parse((root / "scripts" / "train_sd3.py").read_text())
    compute = _function_from_script(tree, "compute_log_prob")
    loss = ast.FunctionDef(
        name="ppo_loss", args=ast.arguments(posonlyargs=[], args=[ast.arg(a) for a in (
            "sample", "j", "log_prob", "prev_sample_mean", "prev_sample_mean_ref", "std_dev_t", "config")],
            kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[*_loss_statements(tree), ast.Return(ast.Name("loss", ast.Load()))], decorator_list=[])
    module = ast.fix_missing_locations(ast.Module(body=[compute, loss], type_ignores=[]))
    namespace = {"torch": torch, "sde_step_with_logprob": sde.sde_step_with_logprob}
    exec(compile(module, str(root / "scripts" / "train_sd3.py"), "exec"), namespace)
    return SimpleNamespace(pipeline_with_logprob=pipeline.pipeline_with_logprob, compute_log_prob=namespace["compute_log_prob"],
                           ppo_loss=namespace["ppo_loss"], tracker=tracking.PerPromptStatTracker,
                           sde_step_with_logprob=sde.sde_step_with_logprob)


def peer_config(beta: float) -> SimpleNamespace:
    """The keys of config/base.py the peer's functions read, at its defaults (beta: train.beta)."""
    return SimpleNamespace(train=SimpleNamespace(cfg=True, adv_clip_max=5, clip_range=1e-4, beta=beta),
                           sample=SimpleNamespace(guidance_scale=GUIDANCE, noise_level=NOISE_LEVEL))


# -- flowalign ------------------------------------------------------------------------------------
def flowalign_trainer(tmp: str, *, lora: bool, kl: bool, groups: int = 1, extra: list[str] = ()):
    from flowalign.config import load_config
    from flowalign.trainer import Trainer

    overrides = [f"output_dir={tmp}", "tracker=none", "threads=1", "eval.every=0", "checkpoint_every=0",
                 f"sampling.guidance_scale={GUIDANCE}", f"sampling.eta={NOISE_LEVEL}", f"sampling.num_steps={STEPS}",
                 "train.detach_uncond=true", f"train.group_size={BATCH}", f"train.groups_per_epoch={groups}",
                 f"train.sample_batch_size={BATCH}", f"train.train_batch_size={BATCH}", "train.clip_range=1.0e-4",
                 f"train.kl_beta={0.04 if kl else 0.0}", "model.lora_alpha=64",
                 "model.lora_rank=32" if lora else "model.lora_rank=0", *extra]
    return Trainer(load_config("configs/shapes_flow_grpo.yaml", overrides))


# -- the measurements -------------------------------------------------------------------------------
def cpu_time(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


class Sides:
    """Everything both sides need, built once: the trainers (flowalign's LoRA, LoRA + KL and full
    fine-tune), their sampled minibatches, and the peer's sample dicts on the same model."""

    def __init__(self, peer, tmp: str, batched_uncond: bool = False, extra: list[str] = ()):
        self.peer = peer
        self.lora = flowalign_trainer(f"{tmp}/lora", lora=True, kl=False, extra=extra)
        self.lora_kl = flowalign_trainer(f"{tmp}/kl", lora=True, kl=True, extra=extra)
        self.full = flowalign_trainer(f"{tmp}/full", lora=False, kl=False, extra=extra)
        self.epoch = flowalign_trainer(f"{tmp}/epoch", lora=True, kl=False, groups=2, extra=extra)
        for trainer in (self.lora, self.lora_kl, self.full, self.epoch):
            if batched_uncond:
                trainer.adapter.splits_uncond = lambda: False
            trainer.train_epoch()  # warm-up; also moves the LoRA off zero
        self.batches = {}
        for name in ("lora", "lora_kl", "full"):
            trainer = getattr(self, name)
            batch = trainer.sample_epoch()
            advantages, _ = trainer.compute_advantages(batch)
            self.batches[name] = (batch, advantages)
        adapter = self.lora.adapter
        self.pipe = adapter.pipe
        self.prompts = [spec["prompt"] for spec in self.batches["lora"][0].specs]

    # peer side
    def peer_sample(self, trainer, prompts: list[str], generator: torch.Generator) -> dict:
        """One batch as train_sd3.py samples it (its sampling section, on ``trainer``'s model)."""
        pipe, peer = trainer.adapter.pipe, self.peer
        embeds, neg, pooled, neg_pooled = pipe.encode_prompt(prompts, None, None, do_classifier_free_guidance=True,
                                                             max_sequence_length=trainer.adapter.max_sequence_length)
        with torch.no_grad():
            images, latents, log_probs = peer.pipeline_with_logprob(
                pipe, prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=neg,
                negative_pooled_prompt_embeds=neg_pooled, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                output_type="pt", height=trainer.adapter.height, width=trainer.adapter.width,
                noise_level=NOISE_LEVEL, generator=generator, max_sequence_length=trainer.adapter.max_sequence_length)
        latents = torch.stack(latents, dim=1)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "neg": neg, "neg_pooled": neg_pooled,
                "timesteps": pipe.scheduler.timesteps.repeat(len(prompts), 1), "latents": latents[:, :-1],
                "next_latents": latents[:, 1:], "log_probs": torch.stack(log_probs, dim=1), "images": images}

    def peer_update(self, trainer, sample: dict, advantages: torch.Tensor, beta: float, optimizer, params,
                    trained_steps: int) -> None:
        """train_sd3.py's training section on one minibatch: each trained timestep's compute_log_prob
        (and the reference's, under no_grad with the LoRA off, when beta > 0), its loss, backward;
        then the clip and the optimizer step that close the accumulation."""
        from pipelines.base import disabled_lora

        transformer, config = trainer.adapter.model, peer_config(beta)
        sample = {**sample, "advantages": advantages[:, None].repeat(1, STEPS)}
        embeds = torch.cat([sample["neg"], sample["prompt_embeds"]])
        pooled = torch.cat([sample["neg_pooled"], sample["pooled_prompt_embeds"]])
        transformer.train()
        for j in range(trained_steps):
            _, log_prob, mean, std = self.peer.compute_log_prob(transformer, trainer.adapter.pipe, sample, j, embeds,
                                                                pooled, config)
            mean_ref = None
            if beta > 0:
                with torch.no_grad(), disabled_lora(transformer):
                    _, _, mean_ref, _ = self.peer.compute_log_prob(transformer, trainer.adapter.pipe, sample, j,
                                                                   embeds, pooled, config)
            loss = self.peer.ppo_loss(sample, j, log_prob, mean, mean_ref, std, config)
            (loss / trained_steps).backward()  # what accelerator.backward does under accumulation
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        transformer.eval()

    def forward(self, trainer) -> None:
        """One no-gradient forward of the CFG batch (2 × 4 rows) on ``trainer``'s model."""
        batch, _ = self.batches["lora"]
        adapter, sub = trainer.adapter, batch.traj
        with torch.no_grad():
            adapter.predict(sub.latents[:, 3], sub.timesteps[3], sub.cond, GUIDANCE)


def step_ratios(sides: Sides, rounds: int) -> dict:
    """LoRA, LoRA + KL and full fine-tune steps over a forward, both sides, paired per round."""
    generator = torch.Generator().manual_seed(0)
    cases = {"lora": (sides.lora, 0.0), "lora_kl": (sides.lora_kl, 0.04), "full": (sides.full, 0.0)}
    samples = {}
    for name, (trainer, beta) in cases.items():
        batch, advantages = sides.batches[name]
        samples[name] = (sides.peer_sample(trainer, [s["prompt"] for s in batch.specs], generator),
                         torch.nan_to_num(advantages, nan=0.0).float())
        # the peer's own optimizer over the same trainable parameters (its train_sd3.py: AdamW, lr 3e-4)
        trainer.peer_optimizer = torch.optim.AdamW(trainer.params, lr=3e-4)
    trained_steps = int(sides.batches["lora"][0].traj.trained.sum(1).max())
    out = {name: {"flowalign": [], "flow_grpo": []} for name in cases}
    for _ in range(rounds):
        for name, (trainer, beta) in cases.items():
            forward = statistics.median(cpu_time(lambda: sides.forward(trainer)) for _ in range(3))
            batch, advantages = sides.batches[name]
            ours = cpu_time(lambda: trainer.update_policy(batch, advantages)) / trained_steps
            sample, adv = samples[name]
            theirs = cpu_time(lambda: sides.peer_update(trainer, sample, adv, beta, trainer.peer_optimizer,
                                                        trainer.params, trained_steps)) / trained_steps
            out[name]["flowalign"].append(ours / forward)
            out[name]["flow_grpo"].append(theirs / forward)
    return {name: {side: statistics.median(v) for side, v in sides_.items()} | {"trained_steps": trained_steps}
            for name, sides_ in out.items()}


def rollout_ratios(sides: Sides, rounds: int) -> dict:
    from flowalign.rollout import rollout
    from flowalign.samplers.steps import plan_steps

    adapter, pipe, peer = sides.lora.adapter, sides.pipe, sides.peer
    prompts = sides.prompts[:BATCH]
    embeds, neg, pooled, neg_pooled = pipe.encode_prompt(prompts, None, None, do_classifier_free_guidance=True,
                                                         max_sequence_length=adapter.max_sequence_length)
    cond = adapter.encode(prompts)
    common = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=neg,
                  negative_pooled_prompt_embeds=neg_pooled, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                  output_type="pt", height=adapter.height, width=adapter.width,
                  max_sequence_length=adapter.max_sequence_length)

    def plain(seed):
        pipe(generator=torch.Generator().manual_seed(seed), **common)

    def theirs(seed):
        peer.pipeline_with_logprob(pipe, generator=torch.Generator().manual_seed(seed), noise_level=NOISE_LEVEL,
                                   **common)

    def ours(seed):
        g = torch.Generator().manual_seed(seed)
        traj = rollout(adapter, cond, adapter.initial_noise(BATCH, g), adapter.schedule(STEPS),
                       plan_steps(STEPS, BATCH, NOISE_LEVEL), guidance_scale=GUIDANCE, generator=g)
        adapter.decode(traj.samples)

    adapter.model.eval()
    ratios = {"flowalign": [], "flow_grpo": []}
    with torch.no_grad():
        plain(0), theirs(0), ours(0)
        for r in range(rounds):
            base = cpu_time(lambda: plain(r))
            ratios["flow_grpo"].append(cpu_time(lambda: theirs(r)) / base)
            ratios["flowalign"].append(cpu_time(lambda: ours(r)) / base)
    return {side: statistics.median(v) for side, v in ratios.items()}


def epoch_ratio(sides: Sides, rounds: int) -> dict:
    """samples/s of flowalign's epoch over the faithful Flow-GRPO loop's, on the same trainer's model."""
    trainer, peer = sides.epoch, sides.peer
    from reward_models.base import build_reward

    reward = build_reward("shapes")
    tracker = peer.tracker()
    optimizer = torch.optim.AdamW(trainer.params, lr=3e-4)
    trained_steps = STEPS - 1
    generator = torch.Generator().manual_seed(1)
    specs = trainer.train_specs

    def theirs():
        """2 groups of 4 (a prompt each): sample, score, per-prompt advantages, update per minibatch."""
        trainer.adapter.model.eval()
        picks = torch.randint(len(specs), (2,), generator=generator).tolist()
        batches = []
        for i in picks:
            prompts = [specs[i]["prompt"]] * BATCH
            sample = sides.peer_sample(trainer, prompts, generator)
            scores = reward(sample["images"], prompts, [specs[i]] * BATCH)
            batches.append((sample, prompts, torch.as_tensor(scores["score"]).float()))
        prompts = [p for _, ps, _ in batches for p in ps]
        advantages = torch.as_tensor(tracker.update(prompts, torch.cat([r for _, _, r in batches]).numpy())).float()
        tracker.clear()
        for k, (sample, _, _) in enumerate(batches):
            sides.peer_update(trainer, sample, advantages[k * BATCH:(k + 1) * BATCH], 0.0, optimizer, trainer.params,
                              trained_steps)

    theirs()
    ratios = []
    for _ in range(rounds):
        ours_s = cpu_time(trainer.train_epoch)
        theirs_s = cpu_time(theirs)
        ratios.append(theirs_s / ours_s)  # samples/s: the same 8 samples each side
    return {"flowalign_over_flow_grpo": statistics.median(ratios), "samples_per_epoch": 2 * BATCH}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flow-grpo-src", help="a local checkout of yifan123/flow_grpo (at ac4c86e)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--batched-uncond", action="store_true",
                        help="flowalign computes CFG's unconditional branch inside the training forward's batch and "
                             "detaches it afterwards (its form before the branch ran on its own): the comparison")
    parser.add_argument("--reuse-uncond", action="store_true",
                        help="flowalign with train.reuse_rollout_uncond: the training forward takes CFG's unconditional "
                             "prediction from the rollout (exact on an update's first minibatch; docs/performance.md)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = peer_checkout(args.flow_grpo_src)
    if root is None:
        where = args.flow_grpo_src or f"{PEER_REPO} (commit {PEER_COMMIT[:7]})"
        print(f"skipped: Flow-GRPO's code is not available here ({where}); pass --flow-grpo-src PATH to a "
              f"checkout of {PEER_REPO} at {PEER_COMMIT[:7]}")
        return
    peer = load_peer(root)
    with tempfile.TemporaryDirectory() as tmp:
        sides = Sides(peer, tmp, batched_uncond=args.batched_uncond,
                      extra=["train.reuse_rollout_uncond=true"] if args.reuse_uncond else [])
        results = {"rollout": rollout_ratios(sides, args.rounds), **step_ratios(sides, args.rounds),
                   "epoch": epoch_ratio(sides, args.rounds)}
    results["settings"] = {"batched_uncond": args.batched_uncond, "reuse_uncond": args.reuse_uncond, "model": "shapes-sd3", "batch": BATCH, "steps": STEPS, "guidance": GUIDANCE,
                           "noise_level": NOISE_LEVEL, "rounds": args.rounds, "threads": torch.get_num_threads(),
                           "peer": f"{PEER_REPO}@{PEER_COMMIT[:7]}", "torch": torch.__version__}
    rows = [("rollout with log-probs ÷ plain diffusers call", "rollout"), ("LoRA step ÷ one LoRA forward", "lora"),
            ("LoRA + KL step ÷ forward", "lora_kl"), ("full fine-tune step ÷ forward", "full")]
    print("| ratio | Flow-GRPO's code | flowalign |\n|---|---|---|")
    for label, key in rows:
        print(f"| {label} | {results[key]['flow_grpo']:.2f} | {results[key]['flowalign']:.2f} |")
    print(f"| epoch samples/s, flowalign ÷ a faithful Flow-GRPO loop | 1 | "
          f"{results['epoch']['flowalign_over_flow_grpo']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

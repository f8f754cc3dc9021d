"""Comparable evaluation of policies: which weights to load, fixed-seed ODE samples, reward tables.

A *policy* is a label and a folder of trained weights (``None`` = the base model). Every policy
samples every (prompt, seed) from the same initial noise, so a cell of a grid or a row of a table
differs between policies only through the weights. ``evaluate`` (``flowalign eval``) draws it as
a run's own evaluation does (``held_out_noise``), so it reproduces a run's held-out numbers;
``grid`` and ``sample`` seed each seed's noise with ``manual_seed(seed)``, so a grid cell and a
``sample`` of the same prompt and seed agree.

``evaluate`` appends one JSON line per scored sample to ``samples.jsonl`` as it goes and skips
what is already there, so an interrupted evaluation resumes where it stopped; ``summary.json`` and
``summary.csv`` are rewritten from all lines at the end.

Because the samples are paired, each policy after the first also gets its *paired change* against
the first (usually the base model): the mean over the (prompt, seed) pairs both scored of
(this − first), with a standard error. Sampling noise shared by the pair cancels, so the change is
far more precise than the difference of two means: a trained policy whose reward is level with the
base reads as level, not as above or below by chance. Every prompt of a seed starts from the same
noise, so one seed's pairs are not independent draws: the standard error is clustered by seed
(on the audio-video world, 192 seeds, it is 1.3–1.9× the one that treats every pair as independent).
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm


@dataclass(frozen=True)
class Policy:
    label: str
    weights: Path | None  # a save_trained folder (final/, checkpoints/*/policy/) or None: the base model


def resolve_policies(specs: list[str]) -> list[Policy]:
    """``base``, a weights folder, a checkpoint folder (its ``policy/``) or a run folder (every
    checkpoint in order, then ``final/``, which stands for the last checkpoint of a finished run).
    Labels are short and unique: ``base``, ``epoch-20``, ``final``; ``LABEL=FOLDER`` names a
    policy (a run's policies become ``LABEL/epoch-20``, ``LABEL/final``)."""
    from flowalign.checkpoint import checkpoint_folders

    policies = []
    for spec in specs:
        if spec == "base":
            policies.append(Policy("base", None))
            continue
        name, named, folder = spec.partition("=")
        if not named or Path(spec).expanduser().exists():
            name, folder = "", spec
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"no such run, checkpoint or weights folder: {path.resolve()}")
        found = []
        if (path / "checkpoints").is_dir() or (path / "final").is_dir():  # a run
            last = _final_epoch(path)  # its checkpoint holds the same weights as final/
            for ckpt in [c for c in checkpoint_folders(path / "checkpoints") if (c / "policy").is_dir()]:
                if _epoch_label(ckpt) != last:
                    found.append(Policy(_epoch_label(ckpt), ckpt / "policy"))
            if (path / "final").is_dir():
                found.append(Policy("final", path / "final"))
            found = [Policy(f"{name}/{p.label}", p.weights) for p in found] if name else found
        elif (path / "policy").is_dir():  # one checkpoint
            found.append(Policy(name or _epoch_label(path), path / "policy"))
        else:
            found.append(Policy(name or path.name, path))
        policies += found
    labels = [p.label for p in policies]
    if not policies:
        raise FileNotFoundError(f"no policies found in {specs}")
    if len(set(labels)) < len(labels):  # e.g. two runs' final/: prefix the run folder
        policies = [Policy(f"{p.weights.parent.parent.name}/{p.label}" if p.weights and p.label.startswith("epoch")
                           else f"{p.weights.parent.name}/{p.label}" if p.weights else p.label, p.weights)
                    for p in policies]
        labels = [p.label for p in policies]
        if len(set(labels)) < len(labels):  # their samples would be pooled under one label
            twice = sorted({label for label in labels if labels.count(label) > 1})
            raise ValueError(f"policies {twice} have the same label; name them: LABEL=FOLDER")
    return policies


def _epoch_label(checkpoint: Path) -> str:
    return f"epoch-{int(checkpoint.name.split('-')[-1])}"


def _final_epoch(run: Path) -> str | None:
    """The label of the checkpoint written with ``final/`` (a finished run's last epoch)."""
    if not (run / "metrics.json").is_file() or not (run / "final").is_dir():
        return None
    return f"epoch-{json.loads((run / 'metrics.json').read_text())['epochs']}"


def load_policy(policy: Policy, model: str, family: str = "sd3", **loading):
    """The adapter of ``model`` with ``policy``'s weights; ``loading``: ``pipelines.load_adapter``'s
    settings (dtype, attention, options = model.kwargs, height, width, num_frames)."""
    from pipelines import load_adapter

    from flowalign.untrusted import check_policy_weights

    return check_policy_weights(policy.weights, lambda: load_adapter(family, model, trained=policy.weights, **loading))


EVAL_SEED = 20_241_202  # every held-out sample's noise comes from it: before/after and policies are paired


def held_out_noise(adapter, count: int) -> torch.Tensor:
    """The noise convention of every evaluation (in-run and ``flowalign eval``):
    held-out sample k starts from row k of ``adapter.initial_noise(count, generator seeded
    EVAL_SEED)``. Prompt i's seed s is sample ``i·S + s`` for S seeds per prompt (seeds 0 … S − 1),
    so ``flowalign eval --seeds 0,…,S−1`` draws exactly what a run's evaluation with
    ``eval.seeds: S`` draws on the same prompts."""
    return adapter.initial_noise(count, torch.Generator().manual_seed(EVAL_SEED))


@torch.no_grad()
def ode_samples(adapter, encode, prompts: list[str | dict], noise: torch.Tensor, steps: int, guidance: float,
                batch_size: int) -> torch.Tensor:
    """The one held-out sampler: ODE (η = 0) final latents [len(prompts), ...] from ``noise``
    [len(prompts), ...], ``batch_size`` at a time; ``encode``: the adapter's, or a prompt cache. A
    prompt may be a record (a dict with "prompt" and, for image-conditioned families, "image")."""
    from flowalign.rollout import rollout
    from flowalign.samplers.steps import plan_steps
    from pipelines.base import encode_records

    from tqdm.auto import tqdm

    schedule = adapter.schedule(steps)
    latents = []
    starts = range(0, len(prompts), batch_size)  # a bar where it takes more than one batch (an in-run evaluation)
    for lo in tqdm(starts, desc=f"ODE samples ({len(prompts)})", unit="batch", leave=False, disable=len(starts) < 2):
        sub = prompts[lo:lo + batch_size]
        cond = encode_records(encode, [p if isinstance(p, dict) else {"prompt": p} for p in sub])
        traj = rollout(adapter, cond, noise[lo:lo + len(sub)], schedule, plan_steps(steps, len(sub), 0.0),
                       guidance_scale=guidance)
        latents.append(traj.samples)
    return torch.cat(latents)


def sample_images(adapter, prompts: list[str], seeds: list[int], steps: int, guidance: float,
                  batch_size: int = 16) -> torch.Tensor:
    """ODE samples, images float [len(prompts)·len(seeds), 3, H, W] in [0, 1], row-major (prompt, seed)."""
    return sample_pairs(adapter, [(p, s) for p in prompts for s in seeds], steps, guidance, batch_size)


@torch.no_grad()
def sample_pairs(adapter, pairs: list[tuple[str | dict, int]], steps: int, guidance: float,
                 batch_size: int = 16) -> torch.Tensor:
    """One ODE sample per (prompt, seed) for ``grid`` and ``sample``: a seed's noise is
    ``initial_noise(1, manual_seed(seed))`` whatever the prompt, so a grid cell and ``flowalign
    sample`` of the same prompt and seed agree. A prompt may be a prompt record (a dict; its "image"
    conditions an image-conditioned family). Decoded samples [len(pairs), ...]."""
    noise = torch.cat([adapter.initial_noise(1, torch.Generator().manual_seed(s)) for _, s in pairs])
    return _decoded(adapter, [p for p, _ in pairs], noise, steps, guidance, batch_size)


def _decoded(adapter, prompts: list[str | dict], noise: torch.Tensor, steps: int, guidance: float, batch_size: int):
    from pipelines.base import decode_samples, encode_records

    def records(sub):
        return [p if isinstance(p, dict) else {"prompt": p} for p in sub]

    out = [decode_samples(adapter, ode_samples(adapter, adapter.encode, prompts[lo:lo + batch_size],
                                               noise[lo:lo + batch_size], steps, guidance, batch_size),
                          lambda lo=lo: encode_records(adapter.encode, records(prompts[lo:lo + batch_size])))
           for lo in range(0, len(prompts), batch_size)]
    # decoded samples that are not one tensor (pipelines.joint.AudioVideoSamples) concatenate themselves
    return torch.cat(out) if isinstance(out[0], torch.Tensor) else type(out[0]).cat(out)


def evaluate(policies: list[Policy], records: list[dict], rewards: dict, out_dir: str | Path, *, model: str,
             family: str = "sd3", seeds: list[int], steps: int, guidance: float, batch_size: int = 16,
             loading: dict | None = None) -> dict:
    """Score every policy × prompt record × seed with every reward; resumable (module docstring).

    rewards: {name: Reward}. Returns the summary: per policy, the mean of every ``reward/component``
    overall and per category (the records' "tag"), and the category mean where there are tags.
    ``loading``: how each policy's adapter loads (``load_policy``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines_path = out_dir / "samples.jsonl"
    done = set()
    if lines_path.exists():
        # Keep the complete lines only (a crash can cut the last one short), then append after them.
        kept = _read_rows(lines_path)
        tmp = lines_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, lines_path)
        done = {(row["policy"], row["index"], row["seed"]) for row in kept}
    todo = [(p, i, s) for p in policies for i in range(len(records)) for s in seeds
            if (p.label, i, s) not in done]
    bar = tqdm(total=len(todo), desc="eval", unit="sample")
    with open(lines_path, "a") as sink:
        for policy in policies:
            mine = [(i, s) for p, i, s in todo if p == policy]
            if not mine:
                continue
            adapter = load_policy(policy, model, family, **(loading or {}))
            noise = held_out_noise(adapter, len(records) * (max(seeds) + 1))
            for lo in range(0, len(mine), batch_size):
                chunk = mine[lo:lo + batch_size]
                rows = [i * (max(seeds) + 1) + s for i, s in chunk]  # held_out_noise's convention
                images = _decoded(adapter, [records[i] for i, _ in chunk], noise[rows], steps, guidance, batch_size)
                subset = [records[i] for i, _ in chunk]
                scores = {}
                for name, reward in rewards.items():
                    for component, values in reward(images, [r["prompt"] for r in subset], subset).items():
                        scores[f"{name}/{component}"] = torch.as_tensor(values, dtype=torch.float32).tolist()
                for k, (i, s) in enumerate(chunk):
                    row = {"policy": policy.label, "index": i, "seed": s, "prompt": records[i]["prompt"],
                           "tag": records[i].get("tag"), **{key: v[k] for key, v in scores.items()}}
                    sink.write(json.dumps(row) + "\n")
                sink.flush()
                bar.update(len(chunk))
    bar.close()
    summary = summarize(_read_rows(lines_path),
                        [p.label for p in policies])
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    write_summary_csv(summary, out_dir / "summary.csv")
    return summary


def _read_rows(path: Path) -> list[dict]:
    """The complete JSON lines of ``path`` (a crash can cut the last one short: it is skipped)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def summarize(rows: list[dict], order: list[str]) -> dict:
    """{policy: {"samples": n, metric: mean, metric + "_by_category": {tag: mean}, metric + "_category_mean"}};
    every policy after ``order[0]`` also gets "reference": order[0] and, per metric, metric + "_change" and
    metric + "_change_se": ``paired_change`` against the reference's samples of the same (prompt, seed)."""
    summary = {}
    reference = {(r["index"], r["seed"]): r for r in rows if order and r["policy"] == order[0]}
    for label in order:
        mine = [r for r in rows if r["policy"] == label]
        metrics = sorted({k for r in mine for k in r if "/" in k})
        entry: dict = {"samples": len(mine)}
        if label != order[0]:
            entry["reference"] = order[0]
        for metric in metrics:
            entry[metric] = _mean([r[metric] for r in mine])
            tags = sorted({r["tag"] for r in mine if r.get("tag")})
            if tags:
                per = {t: _mean([r[metric] for r in mine if r.get("tag") == t]) for t in tags}
                entry[f"{metric}_by_category"] = per
                entry[f"{metric}_category_mean"] = sum(per.values()) / len(per)
            if label != order[0]:
                pairs = [(r.get(metric), reference[r["index"], r["seed"]].get(metric), r["seed"]) for r in mine
                         if (r["index"], r["seed"]) in reference]
                entry[f"{metric}_change"], entry[f"{metric}_change_se"] = paired_change(pairs)
        summary[label] = entry
    return summary


def paired_change(pairs: list[tuple[float | None, float | None, object]]) -> tuple[float, float]:
    """(mean m of a − b, its cluster-robust standard error) over the pairs (a, b, cluster) where a
    and b are finite: var = G / (G − 1) · Σ_g (Σ_{i∈g} (d_i − m))² / n² over the G clusters (the
    seeds). With one pair per cluster it is the textbook sd(a − b)² / n. NaN with fewer than two
    clusters."""
    diffs = [(a - b, c) for a, b, c in pairs
             if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)]
    clusters = {c for _, c in diffs}
    if len(clusters) < 2:
        return float("nan"), float("nan")
    mean = sum(d for d, _ in diffs) / len(diffs)
    sums = dict.fromkeys(clusters, 0.0)
    for d, c in diffs:
        sums[c] += d - mean
    g = len(clusters)
    return mean, math.sqrt(g / (g - 1) * sum(v * v for v in sums.values())) / len(diffs)


def metric_cell(entry: dict, metric: str) -> str:
    """"mean" of ``metric`` in a summary entry, with "(change ± se)" against the reference where there is one."""
    text = f"{entry.get(metric, float('nan')):.4f}"
    if f"{metric}_change" in entry:
        text += f" ({entry[f'{metric}_change']:+.4f} ± {entry[f'{metric}_change_se']:.4f})"
    return text


def is_change_key(key: str) -> bool:
    return key.endswith(("_change", "_change_se"))


def _mean(values: list[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def write_summary_csv(summary: dict, path: str | Path) -> None:
    """One row per policy and metric (category "all" and one row per category)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["policy", "metric", "category", "value"])
        for label, entry in summary.items():
            for key, value in entry.items():
                if key in ("samples", "reference"):
                    continue
                if isinstance(value, dict):
                    metric = key[: -len("_by_category")]
                    writer.writerows([label, metric, tag, v] for tag, v in value.items())
                elif key.endswith("_category_mean"):
                    writer.writerow([label, key[: -len("_category_mean")], "category_mean", value])
                elif is_change_key(key):
                    metric, _, what = key.rpartition("_change")
                    writer.writerow([label, metric, f"change{what} vs {entry['reference']}", value])
                else:
                    writer.writerow([label, key, "all", value])

"""In-run evaluation: held-out samples at fixed noise (``flowalign.evaluation.held_out_noise``, the
one convention ``flowalign eval`` shares), reward components overall and per category, diversity,
the paired change against the run's "before" evaluation, and a grid per evaluation.

ODE sampling (η = 0) of every held-out prompt × ``eval.seeds``; for masked diffusion, the
unmasking plan and the categorical draws of one generator seeded EVAL_SEED, run through the
batches in order (the same draws before and after; the samples differ only through the weights).
"""

from __future__ import annotations

import torch

from flowalign.checkpoint import CheckpointError, read_torch, torch_save
from flowalign.ema import maybe_swapped_in
from flowalign.epoch_sampler import cat_components, masked_rollout, reward_chunk
from flowalign.evaluation import EVAL_SEED, held_out_noise, ode_samples, paired_change
from flowalign.grids import as_image_cells, load_grids, save_grid, side_by_side, to_pil_grid, with_inputs
from flowalign.logs import get_logger
from pipelines.base import decode_samples, encode_records

log = get_logger("evaluator")


def latent_diversity(latents: torch.Tensor, seeds: int) -> float:
    """Mean over prompts of the mean pairwise RMS distance between the final latents of its
    ``seeds`` samples (latents [P·seeds, ...], grouped by prompt). Collapse to one image per
    prompt drives it to 0; it is a cheap, model-agnostic stand-in for perceptual diversity."""
    x = latents.float().flatten(1).view(-1, seeds, latents[0].numel())
    d = torch.cdist(x, x) / x.shape[-1] ** 0.5  # [P, seeds, seeds]
    return (d.sum(dim=(1, 2)) / (seeds * (seeds - 1))).mean().item()


def nanmean(values: torch.Tensor) -> float:
    ok = torch.isfinite(values)
    return values[ok].mean().item() if ok.any() else float("nan")


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "/"))
        elif isinstance(v, (list, tuple)):
            out[key] = str(v)
        else:
            out[key] = v
    return out


class Evaluator:
    """``evaluate(label, epoch, train_seconds)`` on every process (the main one samples)."""

    def __init__(self, config, adapter, encode, reward, extra_rewards, dist, model, eval_specs, out):
        self.config, self.adapter, self.encode, self.reward = config, adapter, encode, reward
        self.extra_rewards, self.dist, self.model, self.eval_specs, self.out = extra_rewards, dist, model, eval_specs, out
        self.ema = None  # evaluated weights: the EMA when train.ema_decay > 0
        self.rollout = "ode"  # the objective's rollout kind; "unmasking": masked diffusion, board diversity
        self.grids: dict = {}  # label → the evaluation's grid (main process)
        self.rewards: dict = {}  # label → its per-sample rewards {component: [N]} (main process; the callbacks')

    @torch.no_grad()
    def evaluate(self, label: str, epoch: int, train_seconds: float) -> dict:
        acc = self.dist.accelerator
        result: dict = {}
        with self.dist.full_params(self.model):
            if acc.is_main_process:
                with maybe_swapped_in(self.ema):
                    result = self._evaluate_main(label, epoch, train_seconds)
                log.info("eval %s: %s", label, ", ".join(f"{k} {v:.3f}" for k, v in result.items()
                                                         if isinstance(v, float)))
            acc.wait_for_everyone()
        return result

    def _evaluate_main(self, label: str, epoch: int, train_seconds: float) -> dict:
        e, t = self.config.eval, self.config.train
        specs = [spec for spec in self.eval_specs for _ in range(e.seeds)]
        latents = self.samples(specs)
        components = self._score(latents, specs, self.reward)
        for reward in self.extra_rewards:
            components.update(self._score(latents, specs, reward))
        result = {"epoch": epoch, "samples": len(specs), "train_seconds": train_seconds,
                  "train_samples": epoch * t.groups_per_epoch * t.group_size * self.dist.accelerator.num_processes}
        if e.seeds > 1 and self.rollout == "unmasking":
            from flowalign.chess.diversity import grouped_board_diversity

            result.update(grouped_board_diversity(latents, e.seeds))  # distinct, board_distance
        elif e.seeds > 1:
            result["latent_diversity"] = latent_diversity(latents, e.seeds)
        self.rewards[label] = components
        before = self._paired_samples(label, components)
        for name, values in components.items():
            result[name] = nanmean(values)
            if name in before and len(before[name]) == len(values):  # one noise per sample: each its own cluster
                result[f"{name}_change"], result[f"{name}_change_se"] = paired_change(
                    [(a, b, i) for i, (a, b) in enumerate(zip(values.tolist(), before[name].tolist()))])
            tags = sorted({spec.get("tag") for spec in specs if spec.get("tag")})
            if tags:
                per = {tag: nanmean(values[[sp.get("tag") == tag for sp in specs]]) for tag in tags}
                result[f"{name}_by_category"] = per
                result[f"{name}_category_mean"] = sum(per.values()) / len(per)
        self._grid(label, latents, specs)
        return result

    def samples(self, specs: list[dict]) -> torch.Tensor:
        """Final samples of the held-out ``specs``, paired across evaluations (module docstring)."""
        e, s = self.config.eval, self.config.sampling
        self.adapter.model.eval()
        if self.rollout == "unmasking":
            generator, latents = torch.Generator().manual_seed(EVAL_SEED), []
            for lo in range(0, len(specs), e.batch_size):
                sub = specs[lo:lo + e.batch_size]
                latents.append(masked_rollout(self.adapter, encode_records(self.encode, sub), s,
                                              generator).samples)
            return torch.cat(latents)
        noise = held_out_noise(self.adapter, len(specs))
        return ode_samples(self.adapter, self.encode, specs, noise, e.num_steps or s.num_steps,
                           s.guidance_scale, e.batch_size)

    @torch.no_grad()
    def _score(self, latents: torch.Tensor, specs: list[dict], reward, chunk: int = 64) -> dict[str, torch.Tensor]:
        return cat_components([reward_chunk(reward, self._decode(latents[lo:lo + chunk], specs[lo:lo + chunk]),
                                            specs[lo:lo + chunk]) for lo in range(0, len(specs), chunk)])

    def _decode(self, latents: torch.Tensor, specs: list[dict]):
        return decode_samples(self.adapter, latents, lambda: encode_records(self.encode, specs))

    def _paired_samples(self, label: str, components: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Writes this evaluation's per-sample rewards to ``eval_samples/<label>.pt`` and returns the
        "before" evaluation's ({} for "before" itself): the same noise, so each later evaluation
        reports its paired change against it (``<component>_change`` ± ``_change_se``), across resumes."""
        folder = self.out / "eval_samples"
        folder.mkdir(parents=True, exist_ok=True)
        torch_save({k: v.float().cpu() for k, v in components.items()}, folder / f"{label}.pt")
        path = folder / "before.pt"
        if label == "before" or not path.is_file():
            return {}
        try:
            return read_torch(path)
        except CheckpointError:  # a damaged file costs the standard errors, not the run
            return {}

    def _grid(self, label: str, latents: torch.Tensor, specs: list[dict]) -> None:
        """Rows: ``grid_prompts`` held-out prompts spread over the set; columns: the first seeds."""
        e = self.config.eval
        n_prompts, n_seeds = min(e.grid_prompts, len(self.eval_specs)), min(e.grid_seeds, e.seeds)
        rows = [round(i * (len(self.eval_specs) - 1) / max(n_prompts - 1, 1)) for i in range(n_prompts)]
        idx = [r * e.seeds + c for r in rows for c in range(n_seeds)]
        images = as_image_cells(self._decode(latents[idx], [specs[i] for i in idx]))  # boards (FEN strings) are drawn
        if self.eval_specs[rows[0]].get("image"):  # an image-conditioned task: its input in the first column
            images = with_inputs(images, [self.eval_specs[r]["image"] for r in rows], n_seeds)
            n_seeds += 1
        grid = to_pil_grid(images, n_prompts, n_seeds)
        self.grids[label] = grid
        save_grid(grid, self.out / "grids" / f"{label}.png", [self.eval_specs[r]["prompt"] for r in rows])

    def save_before_after(self) -> None:
        grids = {**load_grids(self.out / "grids", ("before",)), **self.grids}  # resumed: "before" is on disk
        if "before" in grids and "after" in grids:
            side_by_side({"before": grids["before"], "after": grids["after"]}).save(
                self.out / "grids" / "before_after.png")

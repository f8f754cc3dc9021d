"""Experimental corner: methods not yet proven by a benchmark, kept working and tested.

Stability note: their config keys and interfaces may change or go. EXPLORENET (``explore.mode``,
a training hook: ``explore_hook.py``) learns a non-trivial noise shape, but no benefit could be
measured on the shapes world (docs/explorenet.md). Audio-video routing (``routing.reweight`` /
``routing.influence``, a wrapper of the DiffusionNFT objective: ``routing.py``) is measured on one
world only, where ``floor_gate: all`` is the one rule that held sync (docs/audio_video.md). A
benchmark that shows one of them helping on more than one world promotes it: a wrapper to
``flowalign/objectives/``, a noise model to the epoch sampler.

``rules(config)``: their config rules; ``attach(config, ctx, objective_cls, encode, sampler)``: the
objective to train with (routing's subclass where it is on) and the training hooks that are on.
"""

from __future__ import annotations


def rules(config) -> list[tuple[str, bool, str]]:
    from flowalign.experimental import explore_hook, routing

    return explore_hook.rules(config) + routing.rules(config)


def attach(config, ctx, objective_cls, encode, sampler):
    """(objective, hooks): the objective built from ``objective_cls`` (or routing's subclass of it);
    a training hook has ``before_update(batch) → stats``, ``components()`` (checkpointed state by
    name) and ``write_outputs(folder)``."""
    hooks = []
    if config.explore.mode != "none":
        from flowalign.experimental.explore_hook import ExploreHook

        hooks.append(ExploreHook(config, ctx, encode, sampler))
    if config.routing.reweight or config.routing.influence:  # routing.rules: only with method diffusion_nft
        from flowalign.experimental.routing import RoutedNFT

        objective_cls = RoutedNFT
    return objective_cls(ctx), hooks

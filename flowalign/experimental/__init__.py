"""Experimental corner: methods not yet proven by a benchmark, kept working and tested.

Stability note: the interfaces here may change or go. EXPLORENET (``explore.mode``, a training
hook: ``explore_hook.py``) did not beat isotropic noise on the shapes world (docs/explorenet.md);
audio-video routing (``routing.reweight`` / ``routing.influence``, a wrapper of the DiffusionNFT
objective: ``routing.py``) helps sync on the audio-video world under ``floor_gate: all`` only
(docs/audio_video.md). A benchmark that shows one of them helping across worlds promotes it to
``flowalign/objectives/`` (a wrapper) or to the epoch sampler (a noise model).

``rules(config)``: their config rules; ``attach(config, ctx, objective, encode, sampler)``: the
objective to train with (wrapped where a wrapper is on) and the training hooks that are on.
"""

from __future__ import annotations


def rules(config) -> list[tuple[str, bool, str]]:
    from flowalign.experimental import explore_hook, routing

    return explore_hook.rules(config) + routing.rules(config)


def attach(config, ctx, objective, encode, sampler):
    """(objective, hooks): a training hook has ``before_update(batch) → stats``, ``components()``
    (checkpointed state by name) and ``write_outputs(folder)``."""
    hooks = []
    if config.explore.mode != "none":
        from flowalign.experimental.explore_hook import ExploreHook

        hooks.append(ExploreHook(config, ctx, encode, sampler))
    if config.routing.reweight or config.routing.influence:
        from flowalign.experimental.routing import RoutedNFT

        objective = RoutedNFT(objective)
    return objective, hooks

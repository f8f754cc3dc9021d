"""The learning rate of each epoch (``train.lr_schedule``), a pure function of the epoch so that a
resumed run continues exactly: the factor multiplying ``train.learning_rate`` during epoch e
(0-based) of E, with W = ``train.warmup_epochs``:

    constant (default)      min(1, (e + 1) / (W + 1))   a linear warm-up, then constant
    a diffusers schedule    diffusers' get_scheduler(name, num_warmup_steps=W,
                            num_training_steps=E + 1) at step e + 1: linear, cosine,
                            cosine_with_restarts, polynomial, constant_with_warmup

Steps are epochs (every optimizer step of an epoch uses its rate); the schedules count from step
e + 1 of E + 1 so that the first epoch's rate is not 0 and the last one's not 0 either.
"""

from __future__ import annotations

SCHEDULES = ("constant", "linear", "cosine", "cosine_with_restarts", "polynomial", "constant_with_warmup")


def lr_factor(name: str, epoch: int, warmup: int, epochs: int) -> float:
    """The factor of epoch ``epoch`` (module docstring)."""
    if name == "constant":
        return min(1.0, (epoch + 1) / (warmup + 1))
    import torch
    from diffusers.optimization import get_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=epochs + 1)
    return float(scheduler.lr_lambdas[0](epoch + 1))

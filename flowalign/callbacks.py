"""Callbacks: code of yours that runs at the points of a run, as transformers' TrainerCallback and
TRL's ``image_samples_hook``. Subclass ``Callback``, override the events you need, and pass
instances: ``flowalign.Trainer(config, callbacks=[MyCallback()])`` (or ``flowalign.train(...,
callbacks=[...])``). Every event is called on every process, in order of the list, after the
built-in ones; ``trainer.accelerator.is_main_process`` tells the main process. The built-in tracker
logging and hub pushing are callbacks themselves (``TrackerLogging``, ``HubPush``)::

    class SaveBest(flowalign.Callback):
        best = -1.0
        def on_evaluate(self, trainer, label, epoch, result, grid, rewards):
            if result["score"] > self.best:
                self.best = result["score"]
                grid.save(f"best-{epoch}.png")

Events (``trainer``: the Trainer; ``epoch``: epochs done, 1-based after training starts):

    on_rollouts(trainer, epoch, batch)       an epoch's rollouts, scored (an EpochBatch: .specs,
                                             .rewards [B], .components {name: [B]}, .traj)
    on_epoch_end(trainer, epoch, stats)      the epoch's statistics (what history.jsonl holds)
    on_evaluate(trainer, label, epoch, result, grid, rewards)
                                             a held-out evaluation: its metrics, its grid (a PIL
                                             image, main process; else None) and the per-sample
                                             rewards {component: [N]} (main process; else {})
    on_checkpoint(trainer, epoch, path)      a checkpoint was saved at ``path``
    on_train_end(trainer, summary)           the run finished and wrote final/ (not after a signal stop)
"""

from __future__ import annotations


class Callback:
    """Override the events you need (module docstring); each does nothing by default."""

    def on_rollouts(self, trainer, epoch: int, batch) -> None:
        pass

    def on_epoch_end(self, trainer, epoch: int, stats: dict) -> None:
        pass

    def on_evaluate(self, trainer, label: str, epoch: int, result: dict, grid, rewards: dict) -> None:
        pass

    def on_checkpoint(self, trainer, epoch: int, path) -> None:
        pass

    def on_train_end(self, trainer, summary: dict) -> None:
        pass


class TrackerLogging(Callback):
    """The trackers (TensorBoard, W&B, ...): every epoch's statistics, every evaluation's metrics and
    grid, and the captioned training-sample grids (flowalign/sample_log.py)."""

    def on_rollouts(self, trainer, epoch, batch):
        from flowalign import sample_log
        from flowalign.outputs import log_grid

        if sample_log.due(trainer.config, epoch + 1) and trainer.accelerator.is_main_process:
            grid = sample_log.samples_grid(trainer.adapter, trainer.encode, batch, trainer.config.tracker_samples)
            log_grid(trainer.accelerator, grid, epoch + 1, sample_log.TAG)

    def on_epoch_end(self, trainer, epoch, stats):
        trainer.accelerator.log(stats, step=epoch)

    def on_evaluate(self, trainer, label, epoch, result, grid, rewards):
        from flowalign.evaluator import flat
        from flowalign.outputs import log_grid

        if trainer.accelerator.is_main_process:
            trainer.accelerator.log({f"eval/{k}": v for k, v in flat(result).items() if isinstance(v, (int, float))},
                                    step=epoch)
            log_grid(trainer.accelerator, grid, epoch)  # the grid as an image in TensorBoard / W&B


class HubPush(Callback):
    """``hub.repo``: each checkpoint's policy/ (``hub.strategy: checkpoint``) and final/ (flowalign/hub.py)."""

    def on_checkpoint(self, trainer, epoch, path):
        from flowalign.hub import push_during_training
        from flowalign.trainer import log

        if trainer.accelerator.is_main_process:
            push_during_training(trainer.config, trainer.out, path, log)

    def on_train_end(self, trainer, summary):
        from flowalign.hub import push_during_training
        from flowalign.trainer import log

        if trainer.accelerator.is_main_process:
            push_during_training(trainer.config, trainer.out, None, log)


def fire(callbacks: list, event: str, *args) -> None:
    """Call ``event`` on every callback, in order."""
    for callback in callbacks:
        getattr(callback, event)(*args)

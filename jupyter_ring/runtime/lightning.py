"""A Lightning callback that reports training progress to the notebook's dashboard.

::

    import lightning as L
    from jupyter_ring.runtime.lightning import RingProgress

    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=2, callbacks=[RingProgress()])
    trainer.fit(model, loader)     # the dashboard shows each rank's step and loss

In a ``%%distributed`` cell the Trainer runs on the cluster's ranks (torchrun's environment is
set on every rank, so Lightning uses them instead of starting processes). Outside a notebook
the callback only updates the ranks' local progress, like ``ring.progress``.
"""

import math
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the Lightning callback needs lightning: pip install 'jupyter_ring[frameworks]'") from exc

from .. import runtime as _ring

__all__ = ["RingProgress"]


class RingProgress(pl.Callback):
    """Reports ``trainer.global_step`` (of ``estimated_stepping_batches``) and the training loss
    of each rank through ``ring.progress`` and ``ring.log``."""

    def __init__(self, metric: str = "loss") -> None:
        super().__init__()
        self.metric = metric

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        total = trainer.estimated_stepping_batches
        _ring.progress(trainer.global_step, total=total if math.isfinite(total) else None, desc="fit")

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        _ring.progress(trainer.global_step)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            _ring.log(**{self.metric: float(loss)})

"""``horovod.torch.elastic.ElasticSampler``: the epoch's samples not yet processed, partitioned over
the current world, again after every reset; and its ``TorchState`` handler.

The epoch's order is ``range(len(dataset))``, shuffled by ``seed + epoch`` when ``shuffle`` (the
same on every rank). ``record_batch(batch_idx, batch_size)`` after each batch counts
``batch_size * size()`` samples as processed (``processed_num``): rank ``r`` takes the positions
``r, r + n, r + 2n ...`` of what remains, so after ``b`` batches of every rank the processed
samples are exactly the first ``b * batch_size * n`` of it. ``reset()`` (from ``set_epoch``,
``load_state_dict`` and so from ``TorchState.sync``) drops them and partitions the rest over the
world of the moment: a rank lost or added between two commits neither skips a sample nor sees
one twice within the epoch. As Horovod's (and ``DistributedSampler``'s), each rank gets
``ceil(remaining / n)`` samples, the last ones padded with the first of the remaining ones.

``record_indices(indices)`` (Horovod 0.20-0.22's, removed in 0.23, kept here) marks the dataset
indices this rank processed, for a loop whose batches are not the sampler's prefix; ``sync``
takes the union over the ranks.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterable, Iterator, Sized
from typing import Any, TypedDict

import torch.utils.data

from .. import _api
from .._horovod.elastic_world import sync_root

__all__ = ["ElasticSampler", "SamplerStateHandler", "SamplerState"]


class SamplerState(TypedDict, total=False):
    """``ElasticSampler.state_dict()``: Horovod's two keys, and the recorded indices when there are any."""

    epoch: int
    processed_num: int
    processed_indices: set[int]


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Partitions a dataset over the ranks and re-partitions what is left of the epoch after a reset.

    Use it as Horovod's: put it in the ``TorchState`` (``TorchState(model, opt, sampler=sampler)``),
    call ``record_batch(batch_idx, batch_size)`` after each batch and ``set_epoch(epoch + 1)`` at
    the end of each epoch (not its start: a reset mid-epoch must keep what was processed).
    ``dataset``: anything with ``len()`` (of constant size); ``seed``: the same on every rank.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"ElasticSampler: the dataset must have a length (len(dataset)), got "
                            f"{type(dataset).__name__}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"ElasticSampler: seed must be an int (the same on every rank), got {seed!r}")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = seed

        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()

        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self._recorded = 0  # positions of remaining_indices record_batch counted since the last reset

        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order when shuffling, nothing processed yet. Call it at the
        end of an epoch, so that a reset in the middle of one keeps what was processed."""
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` samples of every rank as processed (``batch_idx`` is
        not used, as in Horovod: call it once per batch, in order)."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 0:
            raise ValueError(f"ElasticSampler.record_batch: batch_size must be an int >= 0, got {batch_size!r}")
        step = batch_size * self.num_replicas
        if self.processed_indices:
            # the remaining order no longer starts at processed_num: name the batch's samples instead
            self.processed_indices.update(self.remaining_indices[self._recorded:self._recorded + step])
        else:
            self.processed_num += step
        self._recorded += step

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark dataset indices this rank processed (Horovod 0.22's); ``TorchState.sync`` takes the
        union of every rank's, and the next reset leaves them out of the epoch."""
        self.processed_indices.update(int(i) for i in indices)

    def load_state_dict(self, state_dict: SamplerState) -> None:
        """Take a ``state_dict()`` (also Horovod's, without ``processed_indices``) and re-partition."""
        try:
            self.epoch = state_dict["epoch"]
            self.processed_num = state_dict["processed_num"]
        except KeyError as exc:
            raise ValueError(f"ElasticSampler.load_state_dict: the state has no {exc.args[0]!r}; pass what "
                             "state_dict() returned") from None
        self.processed_indices = set(state_dict.get("processed_indices", ()))
        self.reset()

    def state_dict(self) -> SamplerState:
        """``{'epoch', 'processed_num'}`` (Horovod's), and ``'processed_indices'`` when any were recorded."""
        state: SamplerState = {"epoch": self.epoch, "processed_num": self.processed_num}
        if self.processed_indices:
            state["processed_indices"] = set(self.processed_indices)
        return state

    def reset(self) -> None:
        """Partition what is left of the epoch over the world of now (``size()``, ``rank()``)."""
        self.num_replicas = _api.size()
        self.rank = _api.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)  # the same order on every rank
        done = self.processed_indices
        self.remaining_indices = [i for i in order[self.processed_num:] if i not in done]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self._recorded = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        padding = self.total_size - len(indices)
        if padding and indices:
            # every rank must get num_samples (equal batch counts keep the collectives matched):
            # repeat from the start, as DistributedSampler does (Horovod's slice falls short when
            # the ranks outnumber the samples left)
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


class SamplerStateHandler:
    """``TorchState``'s handler of an ``ElasticSampler``: its ``state_dict`` saved at commit,
    loaded at restore, and at sync rank 0's (the sync root's) epoch and count with every rank's
    recorded indices."""

    def __init__(self, sampler: ElasticSampler) -> None:
        self.value = sampler
        self._saved: SamplerState = copy.deepcopy(sampler.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        states: list[Any] = _api.allgather_object(self.value.state_dict(), name="elastic.ElasticSampler")
        root = states[sync_root()]  # rank 0's, or the first survivor's after a replacement
        state: SamplerState = {"epoch": root["epoch"], "processed_num": root["processed_num"]}
        recorded = set().union(*(s.get("processed_indices", ()) for s in states))
        if recorded:
            state["processed_indices"] = recorded
        self.value.load_state_dict(state)  # re-partitions over the world of now
        self.save()

    def set_value(self, value: ElasticSampler) -> None:
        self.value = value
        self.save()

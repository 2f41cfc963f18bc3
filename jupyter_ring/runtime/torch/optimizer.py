"""Horovod's ``DistributedOptimizer`` for torch: gradients allreduced in buckets while backward runs."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, DefaultDict, NoReturn, overload

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from ... import runtime as _ring
from .. import _api
from .._engine.errors import CollectiveMismatchError, RingError
from .._horovod.runtime_names import Adasum, Average, ProcessSet, global_process_set
from .._observe import report as _report
from . import _buckets
from ._buckets import BUCKET_BYTES, Bucket, Reduction
from .compression import Compression, Compressor

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer: gradients are allreduced (averaged) over the ranks before ``step()``.

    Gradients are grouped into buckets of about ``bucket_bytes`` (default
    8 MiB) in the order backward produces them. As soon as a bucket's last gradient is ready
    (a gradient hook), its in-place allreduce starts on the runtime's background engine, so
    communication overlaps the rest of ``backward()``; ``step()`` starts the last bucket and waits
    only for that tail. Holding the last bucket until ``step()`` keeps the ranks in step: no rank
    updates its parameters before every rank has called ``step()``. On one
    host each bucket lives in the transport's shared memory and each parameter's ``.grad`` is a
    view of it (as DDP's ``gradient_as_bucket_view``): the allreduce reads every rank's bucket
    where it lies and writes the result there, with no copy in or out (a gradient autograd
    produced afresh, after ``zero_grad()`` set it to None, is copied into its bucket once).

    Every rank launches buckets in one canonical order (learned from rank 0's first backward
    pass), so ranks whose hooks fire in a different order, or that leave some parameters without
    a gradient (zeros are sent for those, as Horovod does), still agree and never hang.

    Horovod's options: ``sparse_as_dense`` (sparse gradients travel dense and come back sparse),
    ``process_set`` (ranks outside it train locally), ``backward_passes_per_step``,
    ``compression``, ``gradient_predivide_factor``; ``num_groups``/``groups`` are accepted and
    change nothing (buckets of ``bucket_bytes`` take the place of Horovod's fusion groups).

    The class subclasses ``torch.optim.Optimizer`` statically so LR schedulers accept it; the
    wrapped optimizer's ``param_groups``, ``state`` and ``defaults`` are shared, not copied.
    """

    _ring_reported_step: float | bool  # the dashboard's step this optimizer set last (_report_step)

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: Compressor = Compression.none, backward_passes_per_step: int = 1, op: int = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: object = None,
                 sparse_as_dense: bool = False, process_set: ProcessSet = global_process_set,
                 bucket_bytes: int | None = None) -> None:
        # Optimizer.__init__ is not called: it would build new param_groups; we share the wrapped
        # optimizer's. These are the attributes the base class methods (hooks) rely on.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        bucket_bytes = _check_options(optimizer, backward_passes_per_step, op, gradient_predivide_factor, compression,
                                      process_set, bucket_bytes)
        self._opt = optimizer
        self._reduction = Reduction(compression, op, 1.0 / gradient_predivide_factor, gradient_predivide_factor,
                                    process_set, bool(sparse_as_dense))
        self._process_set = process_set
        # a rank outside the optimizer's process set trains locally (Horovod): no hooks, no reduction
        self._local_only = not _api.is_global(process_set) and not process_set.included()
        # num_groups/groups split Horovod's fusion into fixed groups; here buckets of bucket_bytes
        # do that work, so they are accepted and change nothing
        self._groups = groups if groups is not None else num_groups
        self._bpps = backward_passes_per_step
        self._bucket_bytes = bucket_bytes
        self._should_synchronize = True
        self._synchronized = False
        self._params: list[torch.Tensor] = []  # parameters that need a gradient, in param_groups order
        self._names: list[str] = []
        self._index: dict[int, int] = {}      # id(param) -> position in self._params
        self._hooks: list[RemovableHandle] = []
        self._given_names = _check_names(named_parameters, optimizer)
        for group in optimizer.param_groups:
            self._register(group["params"])
        self._order = list(range(len(self._params)))[::-1]  # backward runs roughly last-to-first
        self._order_learned = False
        self._buckets: list[Bucket] = []
        self._bucket_of: list[int] = []       # parameter index -> its bucket's index
        self._make_buckets()
        self._reset_step()

    # -- the wrapped optimizer's state, shared
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._opt.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._opt.param_groups = value

    @property
    def state(self) -> DefaultDict[torch.Tensor, Any]:
        return self._opt.state

    @state.setter
    def state(self, value: DefaultDict[torch.Tensor, Any]) -> None:
        self._opt.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self._opt.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._opt.defaults = value

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Horovod's {parameter: name} of every parameter that gets an allreduced gradient."""
        return {p: name for p, name in zip(self._params, self._names)}

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer."""
        return self._opt

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._opt!r})"

    def __getstate__(self) -> NoReturn:
        raise TypeError("a DistributedOptimizer cannot be pickled; save optimizer.state_dict() instead")

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict (identical on every rank after step())."""
        return self._opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer."""
        return self._opt.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer; its parameters get gradient hooks too."""
        self._drop_stale_step()
        if any(self._counts):
            raise RingError("add_param_group() between loss.backward() and optimizer.step(): call it "
                            "before backward() or after step()")
        self._opt.add_param_group(param_group)
        self._register(self._opt.param_groups[-1]["params"])
        new = list(range(len(self._order), len(self._params)))
        self._order = new[::-1] + self._order
        self._make_buckets()
        self._reset_step()

    # -- set-up
    def _register(self, params: Iterable[torch.Tensor]) -> None:
        if self._local_only:
            return
        for p in params:
            if not p.requires_grad or id(p) in self._index:
                continue
            i = len(self._params)
            self._index[id(p)] = i
            self._params.append(p)
            self._names.append(self._given_names[id(p)] if self._given_names is not None else f"param.{i}")
            self._hooks.append(_hook(p, _GradHook(self, i)))

    def _make_buckets(self) -> None:
        """Cut ``self._order`` into buckets of about ``bucket_bytes`` of one wire dtype each."""
        groups = _buckets.bucket_groups(self._params, self._order, self._reduction, self._bucket_bytes)
        self._buckets = []
        self._bucket_of = [0] * len(self._params)
        for index, (members, key) in enumerate(groups):
            self._buckets.append(_buckets.new_bucket(index, members, key, self._params, self._process_set))
            for i in members:
                self._bucket_of[i] = index

    def _reset_step(self) -> None:
        self._epoch = _api.epoch()
        self._counts = [0] * len(self._params)
        self._next = 0             # index of the next bucket to launch
        self._fired: list[int] = []  # hook order of this step (rank 0's becomes the canonical order)
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.handle = None
            bucket.sparse = {}

    def _drop_stale_step(self) -> None:
        # A notebook cell failed or was interrupted on this rank after backward() and before
        # step(): its queued allreduces were abandoned (every rank drops its own), so the half
        # step is dropped too and the next cell starts a clean one.
        if self._epoch != _api.epoch():
            for bucket in self._buckets:
                _buckets.abandon(bucket)
            self._reset_step()

    # -- hooks
    def _on_grad(self, i: int) -> None:
        self._drop_stale_step()
        self._synchronized = False
        self._counts[i] += 1
        if self._counts[i] > self._bpps:
            raise RingError(
                f"parameter '{self._names[i]}' received {self._counts[i]} gradients before step(), but "
                f"backward_passes_per_step={self._bpps}; raise backward_passes_per_step, or call "
                "optimizer.step() (or synchronize()) after every backward_passes_per_step backward passes")
        if self._counts[i] == self._bpps:
            self._fired.append(i)
            bucket = self._buckets[self._bucket_of[i]]
            bucket.ready += 1
            # launch in the canonical order only: a bucket waits for those before it, so every
            # rank's queue is the same sequence and every rank's engine runs the same batches.
            # The last bucket waits for step(): no rank can finish a step (and update its
            # parameters) before every rank has called step(), so an interrupt, a rank that
            # raises or sleeps before step() leaves every rank's parameters alike.
            buckets = self._buckets
            while self._next < len(buckets) - 1 and buckets[self._next].ready == len(buckets[self._next].params):
                self._launch(buckets[self._next])
                self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        _buckets.launch(bucket, self._params, self._names, self._reduction)

    # -- public
    def synchronize(self) -> None:
        """Finish the allreduce of every gradient (parameters without one get averaged zeros)."""
        if self._local_only:
            self._synchronized = True
            return
        try:
            buckets = self._buckets
            while self._next < len(buckets):
                self._launch(buckets[self._next])
                self._next += 1
            error = None
            for bucket in buckets:
                try:
                    _buckets.finish_bucket(bucket.handle)
                except CollectiveMismatchError as exc:
                    error = error or _buckets.explain(bucket, exc, self._params, self._names, self._process_set)
                    continue
                except BaseException as exc:  # noqa: BLE001 - first error re-raised below
                    error = error or exc
                    continue
                try:
                    _buckets.unpack(bucket, self._params, self._reduction.compression)
                except BaseException as exc:  # noqa: BLE001 - first error re-raised below
                    error = error or exc
            if error is not None:
                raise error
            if not self._order_learned:
                self._learn_order()
        finally:
            self._reset_step()
        self._synchronized = True

    def _learn_order(self) -> None:
        # Rank 0's hook order of its first step becomes everyone's bucket order, so that later
        # steps launch each bucket as soon as it is ready (overlap with the rest of backward).
        # An allreduce, not a broadcast: a rank that called join() before this step answers it
        # with zeros, as Horovod's join does for every allreduce. Rank 0's order + 1 in a Sum
        # with everyone else's zeros; all zeros (rank 0 itself joined) keeps the present order.
        order = _root_order(self._fired, self._order, len(self._params), self._process_set)
        self._order_learned = True
        if order != self._order:
            # grads of the old buckets stay valid views until their next launch moves them in
            self._order = order
            self._make_buckets()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, ``step()`` does not synchronize (after an explicit ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Synchronize the gradients (unless already done) and step the wrapped optimizer."""
        if self._should_synchronize and not self._synchronized:
            self.synchronize()
        elif self._should_synchronize and not self._local_only:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                          "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                          "your code.")
        self._synchronized = False
        result = self._opt.step(closure) if closure is not None else self._opt.step()
        _report_step(self)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; an error between backward() and step(), where it would lose them."""
        self._drop_stale_step()
        waiting = sum(1 for c in self._counts if c)
        if waiting:
            raise RingError(
                f"optimizer.zero_grad() was called after loss.backward() and before optimizer.step(): "
                f"{waiting} gradients are still to be allreduced. Call zero_grad() before backward() "
                "or after step(); to drop this step's gradients call optimizer.synchronize() first")
        return self._opt.zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the wrapper stops allreducing); for re-wrapping in a notebook."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self._params:
            if _hook_of(p) is not None:
                del _HOOKS[id(p)]


def _check_names(named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                 optimizer: torch.optim.Optimizer) -> dict[int, str] | None:
    """``named_parameters`` checked against the optimizer's parameters: {id(parameter): name}."""
    if named_parameters is None:
        return None
    pairs = list(named_parameters)
    if any(not (isinstance(p, tuple) and len(p) == 2) for p in pairs):
        raise TypeError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
    counts: dict[str, int] = {}
    for name, _p in pairs:
        counts[name] = counts.get(name, 0) + 1
    dups = sorted(n for n, c in counts.items() if c > 1)
    if dups:
        raise ValueError(f"named_parameters has duplicate names: {', '.join(repr(d) for d in dups)}; "
                         "each parameter needs a unique name. With several models, prefix each "
                         "model's names: [(f'enc.{n}', p) for n, p in enc.named_parameters()]")
    given = {id(p): name for name, p in pairs}
    missing = [tuple(p.shape) for group in optimizer.param_groups for p in group["params"]
               if id(p) not in given]
    if missing:
        raise ValueError(f"named_parameters was given, but {len(missing)} of the optimizer's parameters "
                         f"are not in it (shapes {missing[:5]}{' ...' if len(missing) > 5 else ''}); pass "
                         "the named_parameters() of the model whose parameters the optimizer holds")
    return given


def _check_options(optimizer: object, backward_passes_per_step: object, op: int, gradient_predivide_factor: float,
                   compression: object, process_set: ProcessSet | None, bucket_bytes: object) -> int:
    """DistributedOptimizer's arguments checked; the bucket size (the default for None)."""
    if isinstance(optimizer, DistributedOptimizer):
        raise TypeError("this optimizer is already a DistributedOptimizer; wrap the plain torch "
                        "optimizer once (re-running a cell? wrap the original optimizer again)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
    if op == Adasum:
        raise ValueError("op=Adasum is not supported by jupyter_ring; use op=Average or op=Sum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor needs op=Average (it splits the averaging "
                         "into a division before and after the sum)")
    if not hasattr(compression, "compress") or not hasattr(compression, "decompress"):
        raise TypeError("compression must be Compression.none, Compression.fp16 or an object with "
                        "compress(tensor) and decompress(tensor, ctx)")
    if not _api.is_global(process_set) and not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set= takes a ProcessSet, got {type(process_set).__name__}")
    if bucket_bytes is None:
        bucket_bytes = BUCKET_BYTES
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int (bytes per gradient bucket), got {bucket_bytes!r}")
    return bucket_bytes


def _root_order(fired: list[int], order: list[int], count: int, process_set: ProcessSet) -> list[int]:
    """The first rank's hook order ``fired`` (then the rest of ``order``), on every rank of the set."""
    root = 0 if _api.is_global(process_set) else _buckets.set_ranks(process_set)[0]
    code = np.zeros(count, np.int64)
    if _ring.rank() == root:
        code[:len(fired)] = np.asarray(fired, np.int64) + 1
    _ring.allreduce_(code, op=_ring.Sum, name="DistributedOptimizer.order", process_set=process_set)
    first = [int(i) - 1 for i in code if i > 0]
    seen = set(first)
    return first + [i for i in order if i not in seen]


# Each parameter's current gradient hook, so that re-wrapping (a re-run cell) replaces it. Kept
# here, not on the parameter, so that pickling a model (%ring pull model) stays possible.
# Keyed by id(): tensors compare elementwise, so they cannot be dictionary keys themselves.
_HOOKS: dict[int, tuple[weakref.ref[torch.Tensor], RemovableHandle]] = {}


def _hook(param: torch.Tensor, hook: _GradHook) -> RemovableHandle:
    """``hook`` on ``param``'s accumulated gradient, in place of an earlier optimizer's."""
    old = _hook_of(param)
    if old is not None:
        # a previous DistributedOptimizer over this parameter (a re-run notebook cell):
        # its hook would queue allreduces nobody synchronizes
        old.remove()
    # (torch leaves register_post_accumulate_grad_hook unannotated)
    handle: RemovableHandle = param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
    _HOOKS[id(param)] = (weakref.ref(param), handle)
    return handle


def _hook_of(param: torch.Tensor) -> RemovableHandle | None:
    entry = _HOOKS.get(id(param))
    if entry is None or entry[0]() is not param:  # gone, or an id reused by another tensor
        _HOOKS.pop(id(param), None)
        return None
    return entry[1]


class _GradHook:
    """Queues parameter ``i``'s gradient allreduce; pickles to a no-op (a pulled model is local)."""

    __slots__ = ("optimizer", "index")

    def __init__(self, optimizer: DistributedOptimizer, index: int) -> None:
        self.optimizer = optimizer
        self.index = index

    def __call__(self, _param: torch.Tensor) -> None:
        self.optimizer._on_grad(self.index)

    def __reduce__(self) -> tuple[Callable[[], Callable[[torch.Tensor], None]], tuple[()]]:
        return (_detached_hook, ())


def _no_allreduce(_param: torch.Tensor) -> None:
    """The hook of a model unpickled away from its DistributedOptimizer: nothing to do."""


def _detached_hook() -> Callable[[torch.Tensor], None]:
    return _no_allreduce


# ------------------------------------------------------------------ dashboard (owner: widgets)
def _report_step(optimizer: DistributedOptimizer) -> None:
    """Count optimizer steps for the notebook's dashboard, unless the user reports progress.

    The optimizer advances ``ring.progress`` by one per ``step()`` as long as the reporter's step
    is the one it set last (or 0: a count restarted with ``ring.progress(0, total=N)``). A user
    who reports other steps (epochs, a global step of their own) takes over for this optimizer.
    """
    last = getattr(optimizer, "_ring_reported_step", None)
    if last is False:
        return
    step = _report.reporter.step
    if last is None or step == last or step == 0:
        _report.reporter.progress(step + 1)
        optimizer._ring_reported_step = step + 1
    else:
        optimizer._ring_reported_step = False

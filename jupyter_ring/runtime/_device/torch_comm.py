"""torch.distributed's collectives counted in the ring's trace, as the ring's own are.

The dashboard's communication table and its time in collectives read the trace
(:class:`._trace.Trace`); torch.distributed's collectives never went through it, so a DDP cell
showed 0 allreduces and 0 % in collectives while its ranks waited in ``backward()``. Two cheap
hooks put them there, under the ring's kinds ("allreduce", "broadcast", "allgather", ...):

- **the collective functions** of ``torch.distributed`` (``all_reduce``, ``broadcast``,
  ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``barrier`` ...: what user code, FSDP,
  Lightning and accelerate call) are wrapped: one record per call, its bytes, and its time from
  the call to the completion of its work (``async_op=True``: a callback on the work's future,
  on the thread that completes it);
- **DDP's gradient allreduces** run in C++ (its reducer calls the process group directly, no
  Python function is called). A DDP model without a communication hook of the user's gets, at
  its first forward, torch's default hook (``allreduce_hook``: divide by the group's size, then
  allreduce each bucket), written here to call the wrapped ``all_reduce``: the same results,
  one record per bucket. A hook registered by the user is theirs: their collectives count
  where they call ``torch.distributed``'s functions.

Installed by the notebook engines when torch.distributed is imported
(``jupyter_ring.engines._torch``); ``jupyter_ring.runtime`` itself never imports torch.
"""

import functools
import time
import weakref
from typing import Any, Callable

from .._observe.report import reporter

__all__ = ["install_counting", "count_ddp", "COUNTED"]

# torch.distributed function -> (the trace's kind, the argument whose bytes are counted: its
# position and its keyword name)
COUNTED: dict[str, tuple[str, int, str]] = {
    "all_reduce": ("allreduce", 0, "tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "reduce": ("reduce", 0, "tensor"),
    "all_gather": ("allgather", 0, "tensor_list"),
    "all_gather_into_tensor": ("allgather", 0, "output_tensor"),
    "reduce_scatter": ("reducescatter", 1, "input_list"),
    "reduce_scatter_tensor": ("reducescatter", 1, "input"),
    "all_to_all": ("alltoall", 1, "input_tensor_list"),
    "all_to_all_single": ("alltoall", 1, "input"),
    "gather": ("gather", 0, "tensor"),
    "scatter": ("scatter", 0, "tensor"),
    "barrier": ("barrier", -1, ""),
}

_MARK = "_jupyter_ring_counts"


def _nbytes(value: Any) -> int:
    """Bytes of a tensor or of a list of tensors (0 for anything else)."""
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    try:
        return int(value.numel()) * int(value.element_size())
    except (AttributeError, TypeError, RuntimeError):
        return 0


def _counted(function: Callable[..., Any], kind: str, position: int, keyword: str) -> Callable[..., Any]:
    """``function`` that also records each call in the trace (count, bytes, time)."""
    name = f"torch.distributed {function.__name__}"

    @functools.wraps(function)
    def collective(*args: Any, **kwargs: Any) -> Any:
        trace = reporter.trace
        if trace is None:  # ring.init() not called: nothing to count into
            return function(*args, **kwargs)
        start = time.perf_counter()
        work = function(*args, **kwargs)
        if position < 0:
            nbytes = 0
        else:
            nbytes = _nbytes(args[position] if len(args) > position else kwargs.get(keyword))
        future = None
        if work is not None:  # async_op=True: done when its future completes
            try:
                future = work.get_future()
            except (AttributeError, RuntimeError):  # a backend's work without a future
                future = None
        if future is None:
            trace.record(kind, name, nbytes, start, time.perf_counter(), {})
        else:
            future.add_done_callback(
                lambda _done: trace.record(kind, name, nbytes, start, time.perf_counter(), {}))
        return work

    setattr(collective, _MARK, True)
    return collective


def install_counting(c10d: Any = None, namespace: Any = None) -> list[str]:
    """Wrap torch.distributed's collective functions (idempotent); returns those wrapped now.

    ``c10d``: ``torch.distributed.distributed_c10d`` (where they live and call each other);
    ``namespace``: ``torch.distributed`` (which re-exports them). Both imported when not given.
    """
    if c10d is None:
        from torch.distributed import distributed_c10d as c10d
    if namespace is None:
        import torch.distributed as namespace
    wrapped = []
    for fname, (kind, position, keyword) in COUNTED.items():
        function = getattr(c10d, fname, None)
        if function is None or getattr(function, _MARK, False):
            continue
        counted = _counted(function, kind, position, keyword)
        setattr(c10d, fname, counted)
        if getattr(namespace, fname, None) is function:
            setattr(namespace, fname, counted)
        wrapped.append(fname)
    return wrapped


# ------------------------------------------------------------------ DDP
def _allreduce_hook(state: "weakref.ref[Any]", bucket: Any) -> Any:
    """torch's ``allreduce_hook`` through the counted ``all_reduce``: the bucket divided by the
    group's size, then summed over the group. The group is read from the model at every call:
    a group re-created after an abort (``_process_groups``) moves the model to it."""
    import torch.distributed as dist

    model = state()
    group: Any = getattr(model, "process_group", None) or dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(group.size())
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def count_ddp(ddp_class: Any) -> bool:
    """Have ``DistributedDataParallel`` models count their gradient allreduces (idempotent).

    At a model's first forward, unless its user registered a comm hook (a Python or a built-in
    one) or it reduces in Python (compiled DDP), :func:`_allreduce_hook` becomes its hook. A
    hook registered after that is refused by torch (one hook per model): the error says why.
    """
    if getattr(ddp_class, _MARK, False):
        return False
    pre_forward = ddp_class._pre_forward
    register = ddp_class.register_comm_hook
    register_builtin = ddp_class._register_builtin_comm_hook

    @functools.wraps(pre_forward)
    def _pre_forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_jupyter_ring_hook") is None:
            self.__dict__["_jupyter_ring_hook"] = _install_hook(self)
        return pre_forward(self, *inputs, **kwargs)

    @functools.wraps(register)
    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        if self.__dict__.get("_jupyter_ring_hook") == "counting":
            raise RuntimeError(
                "this DDP model already has jupyter_ring's comm hook (torch's allreduce_hook that "
                "counts the allreduces for the dashboard), set at its first forward: torch allows "
                "one hook per model. Register your comm hook before the model's first forward")
        self.__dict__["_jupyter_ring_hook"] = "user"
        return register(self, state, hook)

    @functools.wraps(register_builtin)
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        self.__dict__["_jupyter_ring_hook"] = "user"
        return register_builtin(self, comm_hook_type)

    ddp_class._pre_forward = _pre_forward
    ddp_class.register_comm_hook = register_comm_hook
    ddp_class._register_builtin_comm_hook = _register_builtin_comm_hook
    setattr(ddp_class, _MARK, True)
    return True


def _install_hook(model: Any) -> str:
    """Give ``model`` the counting hook where it has none of its user's; what it has now:
    "counting", "user" or "none" (it reduces otherwise: compiled DDP, no reducer)."""
    import torch.distributed as dist

    if getattr(model, "_comm_hooks", None):
        return "user"
    reducer = getattr(model, "reducer", None)
    if reducer is None or getattr(model, "_use_python_reducer", False):
        return "none"
    try:
        dist._register_comm_hook(reducer, weakref.ref(model), _allreduce_hook)
    except RuntimeError:  # a hook registered out of our sight (torch's C++ API)
        return "user"
    return "counting"

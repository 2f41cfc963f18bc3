"""Horovod's API over numpy arrays, backed by one ``Runtime`` per process."""

import atexit
import contextlib
import json
import math
import os
import pickle

import numpy as np

from . import _collectives as C
from ._config import Config
from ._core import DTYPE_CODE, DTYPES, Average, Runtime, Sum
from ._errors import NotInitializedError, RingError
from ._report import reporter

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "config",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "allgather", "allgather_async", "broadcast",
    "broadcast_", "broadcast_async", "reducescatter", "alltoall", "barrier", "broadcast_object",
    "allgather_object", "poll", "synchronize", "stats", "timeline", "reset_stats",
]


class _Process:
    """This process's runtime and its queue of pending async collectives."""

    def __init__(self):
        self.rt = None
        self.queue = []        # (handle, entry) not yet executed, in submission order
        self.results = {}      # handle -> result, or the exception to raise in synchronize()
        self.queued_bytes = 0
        self.next_handle = 1
        self.unnamed = {}      # kind -> counter for auto names
        self.fusion = None     # reusable fusion buffer (bytes)
        self.atexit = False
        self.epoch = 0         # +1 each time queued work is abandoned (a failed notebook cell)


_proc = _Process()


def init(comm=None, **config):
    """Start the runtime on ``comm`` (default MPI.COMM_WORLD); every rank must call it.

    Calling it again while initialised does nothing; ``shutdown()`` then ``init()`` starts anew.
    Keyword arguments override :class:`Config` fields (``stall_timeout=...``).
    """
    if _proc.rt is not None:
        return
    from mpi4py import MPI

    if comm is None:
        comm = MPI.COMM_WORLD
    elif isinstance(comm, (list, tuple)):
        raise TypeError("init(comm=...) takes an mpi4py communicator; build a sub-communicator with "
                        "MPI.COMM_WORLD.Create_group(...) for a subset of ranks")
    elif not isinstance(comm, MPI.Comm):
        raise TypeError(f"init(comm=...) takes an mpi4py communicator, got {type(comm).__name__}")
    _proc.rt = Runtime(comm, Config.from_env(**config))
    reporter.rank = _proc.rt.rank
    reporter.trace = _proc.rt.trace
    if not _proc.atexit:
        # Cancel our posted receives before mpi4py finalizes MPI (atexit runs last-in first-out).
        atexit.register(_at_exit, _proc.rt.config.finalize_timeout)
        _proc.atexit = True


def _at_exit(finalize_timeout):
    """shutdown(), with a bound on what follows: MPI_Finalize (mpi4py's, after every atexit
    handler) waits on the launcher's PMI barrier, which never completes when a peer's host or the
    launcher is unreachable; SIGALRM's default action ends the process then, with no Python
    code left to run (a thread could not: it needs the GIL, which finalization holds)."""
    import signal

    if finalize_timeout > 0 and hasattr(signal, "alarm"):
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(max(1, int(math.ceil(finalize_timeout))))
        except ValueError:  # not the main thread
            pass
    shutdown()


def shutdown():
    """Stop the runtime; pending async handles fail. Safe to call when not initialised."""
    rt, _proc.rt = _proc.rt, None
    _drop_queue(NotInitializedError("the runtime was shut down before this collective ran"))
    if rt is not None:
        rt.close()


def is_initialized():
    """Whether ``init()`` has run (and ``shutdown()`` has not)."""
    return _proc.rt is not None


def _rt():
    rt = _proc.rt
    if rt is None:
        raise NotInitializedError("jupyter_ring's runtime is not initialised; call ring.init() on every "
                                  "rank first (%ring start does this for you)")
    return rt


def size():
    """Number of ranks."""
    return _rt().size


def rank():
    """This process's rank, 0 .. size()-1."""
    return _rt().rank


def local_size():
    """Number of ranks on this host."""
    return _rt().local_size


def local_rank():
    """This rank's index among the ranks on its host (use it to pick a GPU)."""
    return _rt().local_rank


def cross_size():
    """Number of ranks with this rank's local_rank (the number of hosts, when they are alike)."""
    return _rt().cross_size


def cross_rank():
    """This rank's index among the ranks with the same local_rank."""
    return _rt().cross_rank


def config():
    """The live :class:`Config` (change its fields to tune a running runtime)."""
    return _rt().config


# ------------------------------------------------------------------ argument checks
def _auto_name(kind, name):
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"{kind}: name= must be a str, got {type(name).__name__}")
        return name, name
    count = _proc.unnamed.get(kind, 0)
    _proc.unnamed[kind] = count + 1
    return f"{kind}.noname.{count}", None


def _array(tensor, where):
    try:
        arr = np.asarray(tensor)
    except Exception as exc:
        raise TypeError(f"{where}: expected a numpy array (or array-like), got {type(tensor).__name__}") from exc
    if arr.dtype not in DTYPE_CODE:
        supported = ", ".join(str(d) for d in DTYPES)
        raise TypeError(f"{where}: dtype {arr.dtype} is not supported; use one of {supported}")
    return arr


def _inplace(tensor, where):
    if not isinstance(tensor, np.ndarray):
        raise TypeError(f"{where}: the in-place form needs a numpy array, got {type(tensor).__name__}; "
                        "use the out-of-place form (without the trailing _)")
    arr = _array(tensor, where)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{where}: the in-place form needs a C-contiguous array; pass "
                         "np.ascontiguousarray(x) or use the out-of-place form")
    if not arr.flags.writeable:
        raise ValueError(f"{where}: the array is read-only; pass a writable copy (x.copy()) or use the "
                         "out-of-place form")
    return arr


def _op(op, average, where):
    if average is not None:
        if op is not None:
            raise ValueError(f"{where}: pass either op= or the deprecated average=, not both")
        return Average if average else Sum
    return Average if op is None else op


def _factor(value, label, where):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: {label} must be a number, got {value!r}") from None


def _root(root_rank, where):
    rt = _rt()
    if not isinstance(root_rank, (int, np.integer)) or isinstance(root_rank, bool):
        raise TypeError(f"{where}: root_rank must be an int, got {type(root_rank).__name__}")
    if not 0 <= root_rank < rt.size:
        raise ValueError(f"{where}: root_rank {root_rank} is out of range for {rt.size} ranks (0..{rt.size - 1})")
    return int(root_rank)


# ------------------------------------------------------------------ allreduce
def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over all ranks (default op: Average) and return a new array."""
    entry = _allreduce_entry(tensor, False, average, name, op, prescale_factor, postscale_factor)
    return _allreduce_now(entry)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """In-place allreduce: ``tensor`` (a C-contiguous writable array) receives the result."""
    entry = _allreduce_entry(tensor, True, average, name, op, prescale_factor, postscale_factor)
    return _allreduce_now(entry)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """Queue an allreduce; returns a handle for ``synchronize()``/``poll()``. Small ones are fused."""
    entry = _allreduce_entry(tensor, False, average, name, op, prescale_factor, postscale_factor)
    return _enqueue(entry, entry[1].nbytes)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """Queue an in-place allreduce; returns a handle."""
    entry = _allreduce_entry(tensor, True, average, name, op, prescale_factor, postscale_factor)
    return _enqueue(entry, entry[1].nbytes)


def _allreduce_entry(tensor, in_place, average, name, op, prescale, postscale):
    """Check the arguments once, on the caller's line; the queue and the ring trust the entry."""
    rt = _rt()
    given = name
    try:  # the hot path of every gradient: a plain try, not a context manager
        name, explicit = _auto_name("allreduce", name)
        where = f"{'allreduce_' if in_place else 'allreduce'} '{name}'"
        arr = _inplace(tensor, where) if in_place else _array(tensor, where)
        op = _op(op, average, where)
        prescale = _factor(prescale, "prescale_factor", where)
        postscale = _factor(postscale, "postscale_factor", where)
        fn = C._reducer(op, arr.dtype)
        scaled = C._scale_of(rt, arr, op, prescale, postscale, where)
    except (TypeError, ValueError) as exc:
        _poison("allreduce", given, exc)
        raise
    return ("allreduce", arr, in_place, op, prescale, postscale, name, explicit, fn, scaled)


@contextlib.contextmanager
def _joining(kind, name):
    """Bad arguments on this rank: tell the peers waiting in ``kind`` before raising here.

    Without this the other ranks would wait for the stall timeout not knowing why.
    """
    try:
        yield
    except (TypeError, ValueError, pickle.PicklingError, AttributeError) as exc:
        _poison(kind, name, exc)
        raise


def _poison(kind, name, exc):
    rt = _proc.rt
    if rt is not None and not isinstance(exc, RingError):
        _flush()  # queued work first, so the peers meet the poison where this call would be
        rt.poison(kind, name if isinstance(name, str) else "?", exc)


def _allreduce_now(entry):
    """A blocking allreduce: straight to the ring unless async work is queued before it."""
    if _proc.queue:
        return synchronize(_enqueue(entry, entry[1].nbytes))
    return _run_fused(_rt(), [entry])[0]


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """Allreduce a list of arrays together (one fused ring pass); returns a list."""
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """In-place grouped allreduce."""
    return synchronize(_group(tensors, True, average, name, op, prescale_factor, postscale_factor))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """Queue a grouped allreduce; ``synchronize`` returns the list of results."""
    return _group(tensors, False, average, name, op, prescale_factor, postscale_factor)


def _group(tensors, in_place, average, name, op, prescale, postscale):
    rt = _rt()
    with _joining("allreduce", name):
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"grouped_allreduce: expected a list of arrays, got {type(tensors).__name__}")
        name, explicit = _auto_name("grouped_allreduce", name)
        where = f"grouped_allreduce '{name}'"
        arrays = [(_inplace if in_place else _array)(t, f"{where} tensor {i}") for i, t in enumerate(tensors)]
        dtypes = {a.dtype for a in arrays}
        if len(dtypes) > 1:
            raise TypeError(f"{where}: all tensors of a group must share one dtype, got {sorted(map(str, dtypes))}")
        op = _op(op, average, where)
        prescale = _factor(prescale, "prescale_factor", where)
        postscale = _factor(postscale, "postscale_factor", where)
        if arrays:
            C._reducer(op, arrays[0].dtype)
            C._scale_of(rt, arrays[0], op, prescale, postscale, where)
    entry = ("group", arrays, in_place, op, prescale, postscale, name, explicit)
    return _enqueue(entry, sum(a.nbytes for a in arrays))


# ------------------------------------------------------------------ other collectives
def allgather(tensor, name=None):
    """Concatenate every rank's array along dim 0; dim 0 may differ between ranks."""
    return synchronize(allgather_async(tensor, name))


def allgather_async(tensor, name=None):
    """Queue an allgather; returns a handle."""
    _rt()
    with _joining("allgather", name):
        name, explicit = _auto_name("allgather", name)
        arr = _array(tensor, f"allgather '{name}'")
    return _enqueue(("allgather", arr, name, explicit), 0)


def broadcast(tensor, root_rank=0, name=None):
    """Return root's array on every rank (every rank passes an array of the same shape)."""
    return synchronize(broadcast_async(tensor, root_rank, name))


def broadcast_(tensor, root_rank=0, name=None):
    """In-place broadcast into ``tensor``."""
    _rt()
    with _joining("broadcast", name):
        name, explicit = _auto_name("broadcast", name)
        arr = _inplace(tensor, f"broadcast_ '{name}'")
        root = _root(root_rank, f"broadcast_ '{name}'")
    return synchronize(_enqueue(("broadcast", arr, arr, root, name, explicit), 0))


def broadcast_async(tensor, root_rank=0, name=None):
    """Queue a broadcast; returns a handle."""
    _rt()
    with _joining("broadcast", name):
        name, explicit = _auto_name("broadcast", name)
        arr = np.require(_array(tensor, f"broadcast '{name}'"), requirements="C")  # keeps 0-d
        root = _root(root_rank, f"broadcast '{name}'")
    return _enqueue(("broadcast", arr, np.empty_like(arr), root, name, explicit), 0)


def reducescatter(tensor, op=Average, name=None):
    """Reduce over ranks and return this rank's block of dim 0 (first ranks get the extra rows)."""
    rt = _rt()
    with _joining("reducescatter", name):
        name, explicit = _auto_name("reducescatter", name)
        where = f"reducescatter '{name}'"
        arr = np.ascontiguousarray(_array(tensor, where))
        if arr.ndim == 0:
            raise ValueError(f"{where}: needs a tensor with at least one dimension, got a scalar")
        C._reducer(op, arr.dtype)
    return _now(C.reducescatter, rt, arr, op, name, explicit)


def alltoall(tensor, splits=None, name=None):
    """Scatter rows to every rank and gather theirs: returns (output, received_splits)."""
    rt = _rt()
    with _joining("alltoall", name):
        name, explicit = _auto_name("alltoall", name)
        where = f"alltoall '{name}'"
        arr = np.ascontiguousarray(_array(tensor, where))
        splits = _splits(arr, splits, rt.size, where)
    return _now(C.alltoall, rt, arr, splits, name, explicit)


def _splits(arr, splits, n, where):
    if arr.ndim == 0:
        raise ValueError(f"{where}: needs a tensor with at least one dimension, got a scalar")
    rows = arr.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(f"{where}: dim 0 ({rows}) is not divisible by the world size ({n}); "
                             "pass splits=[rows for rank 0, rows for rank 1, ...]")
        return [rows // n] * n
    try:
        splits = [int(s) for s in np.asarray(splits).reshape(-1)]
    except (TypeError, ValueError):
        raise TypeError(f"{where}: splits must be a list of {n} integers, got {splits!r}") from None
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"{where}: splits {splits} must be {n} non-negative row counts summing to dim 0 ({rows})")
    return splits


def barrier():
    """Wait until every rank arrives (interruptible, with the stall timeout)."""
    rt = _rt()
    _now(C.barrier, rt, "barrier")


def broadcast_object(obj, root_rank=0, name=None):
    """Root's picklable object, returned on every rank."""
    rt = _rt()
    with _joining("broadcast_object", name):
        name, explicit = _auto_name("broadcast_object", name)
        root = _root(root_rank, f"broadcast_object '{name}'")
        data = _pickle(obj, f"broadcast_object '{name}'") if rt.rank == root else None
    result = _now(C.broadcast_object, rt, data, root, name, explicit)
    return obj if rt.rank == root else result


def _pickle(obj, where):
    try:
        return np.frombuffer(pickle.dumps(obj), np.uint8)
    except Exception as exc:
        raise TypeError(f"{where}: the object cannot be pickled ({type(exc).__name__}: {exc}); send "
                        "plain data (numbers, lists, dicts, arrays, a model's state_dict())") from exc


def allgather_object(obj, name=None):
    """Every rank's picklable object, as a list in rank order."""
    rt = _rt()
    with _joining("allgather_object", name):
        name, explicit = _auto_name("allgather_object", name)
        data = _pickle(obj, f"allgather_object '{name}'")
    return _now(C.allgather_object, rt, data, name, explicit)


def _now(fn, rt, *args):
    """Run a collective that has no async form, after whatever is queued (order is kept)."""
    _flush()
    return rt.run(fn, rt, *args)


# ------------------------------------------------------------------ handles and fusion
def _enqueue(entry, nbytes):
    handle = _proc.next_handle
    _proc.next_handle += 1
    _proc.queue.append((handle, entry))
    _proc.queued_bytes += nbytes
    if _proc.queued_bytes >= _rt().config.fusion_threshold:
        _flush()
    return handle


def poll(handle):
    """True when ``handle``'s result is ready (runs the queued collectives if needed)."""
    _check_handle(handle)
    if handle not in _proc.results:
        _flush()
    return True


def synchronize(handle):
    """Wait for ``handle`` and return its result (raises the collective's error, if any)."""
    _check_handle(handle)
    if handle not in _proc.results:
        _flush()
    result = _proc.results.pop(handle)
    if isinstance(result, BaseException):
        raise result
    return result


def _check_handle(handle):
    if handle not in _proc.results and all(h != handle for h, _ in _proc.queue):
        raise ValueError(f"unknown or already synchronized handle {handle!r}; each handle is synchronized once")


def _drop_queue(error):
    for handle, _entry in _proc.queue:
        _proc.results[handle] = error
    _proc.queue = []
    _proc.queued_bytes = 0


def abandon_queued(reason):
    """Fail every queued, not yet run collective with ``RingError(reason)`` and start a new epoch.

    Called on a rank whose notebook cell failed or was interrupted: what that cell queued must
    not run at the start of the next cell (the peers, interrupted elsewhere, did not queue the
    same calls). Stateful wrappers (DistributedOptimizer) compare :func:`epoch` to drop a step
    that began before.
    """
    _drop_queue(RingError(f"cancelled: {reason}"))
    _proc.epoch += 1


def epoch():
    """How many times queued work has been abandoned in this process (see abandon_queued)."""
    return _proc.epoch


def discard(handle):
    """Forget ``handle`` without waiting for it (its result, if any, is dropped)."""
    _proc.results.pop(handle, None)


def _flush():
    """Run every queued collective in submission order, fusing allreduces that can share a pass.

    Grouping depends only on the order and arguments of the queued calls, so every rank that
    queued the same calls makes the same fused groups.
    """
    if not _proc.queue:
        return
    rt = _rt()
    queue, _proc.queue, _proc.queued_bytes = _proc.queue, [], 0
    batches, open_batch = [], {}
    limit = rt.config.fusion_threshold
    for handle, entry in queue:
        if entry[0] == "allreduce":
            arr, op, pre, post = entry[1], entry[3], entry[4], entry[5]
            key = (arr.dtype, op, pre, post)
            batch = open_batch.get(key)
            if batch is None or batch[1] + arr.nbytes > limit:
                batch = open_batch[key] = [key, 0, []]
                batches.append(batch)
            batch[1] += arr.nbytes
            batch[2].append((handle, entry))
        else:
            batches.append([None, 0, [(handle, entry)]])
    for index, (key, _nbytes, items) in enumerate(batches):
        try:
            if key is None:
                handle, entry = items[0]
                _proc.results[handle] = _run_single(rt, entry)
            else:
                for handle, result in zip((h for h, _ in items), _run_fused(rt, [e for _, e in items])):
                    _proc.results[handle] = result
        except Exception as exc:
            # The failed batch and everything queued after it fail with the same error; the
            # caller sees it from synchronize() on any of those handles.
            _fail(batches[index:], exc)
            return
        except BaseException:
            _fail(batches[index:], RingError("cancelled: the collective was interrupted"))
            raise


def _fail(batches, exc):
    for _key, _nbytes, items in batches:
        for handle, _entry in items:
            _proc.results[handle] = exc


def _run_single(rt, entry):
    kind = entry[0]
    if kind == "group":
        _kind, arrays, in_place, op, pre, post, name, explicit = entry
        return _run_group(rt, arrays, in_place, op, pre, post, name, explicit)
    if kind == "allgather":
        _kind, arr, name, explicit = entry
        return rt.run(C.allgather, rt, arr, name, explicit)[0]
    if kind == "broadcast":
        _kind, arr, out, root, name, explicit = entry
        return rt.run(C.broadcast_into, rt, arr, out, root, name, explicit)
    raise AssertionError(kind)  # pragma: no cover - entries are built in this module


def _run_fused(rt, entries):
    """One allreduce pass over a batch of queued allreduces sharing dtype, op and scales."""
    _kind, arr, in_place, op, pre, post, name, explicit, fn, scaled = entries[0]
    if len(entries) == 1:
        scale_pre, scale_post, divisor = scaled
        src = arr.reshape(-1) if arr.flags.c_contiguous else np.ascontiguousarray(arr).reshape(-1)
        dst = src if in_place else np.empty_like(src)
        desc = C.allreduce_desc(explicit, arr.shape, pre, post)
        rt.run(C.allreduce_into, rt, src, dst, fn, op, scale_pre, scale_post, divisor, name, desc)
        return [arr if in_place else dst.reshape(arr.shape)]
    members = tuple((e[7], e[1].shape) for e in entries)
    name = f"fused[{name} +{len(entries) - 1}]"
    return _fused_pass(rt, [e[1] for e in entries], op, pre, post, name, members, [e[2] for e in entries])


def _run_group(rt, arrays, in_place, op, pre, post, name, explicit):
    members = tuple((explicit, a.shape) for a in arrays)
    return _fused_pass(rt, arrays, op, pre, post, name, members, [in_place] * len(arrays))


def _fused_pass(rt, arrays, op, pre, post, name, members, in_place):
    dtype = arrays[0].dtype if arrays else np.dtype(np.float32)
    total = sum(a.size for a in arrays)
    need = total * dtype.itemsize
    if _proc.fusion is None or _proc.fusion.nbytes < need:
        _proc.fusion = np.empty(max(need, 1), np.uint8)
    buf = _proc.fusion[:need].view(dtype)
    if arrays:
        np.concatenate([a.reshape(-1) for a in arrays], out=buf)  # one C loop, no temporary
    desc = C.allreduce_desc(None, (total,), pre, post, members)
    fn = C._reducer(op, dtype)
    scale_pre, scale_post, divisor = C._scale_of(rt, buf, op, pre, post, name)
    rt.run(C.allreduce_into, rt, buf, buf, fn, op, scale_pre, scale_post, divisor, name, desc)
    out, offset = [], 0
    for a, inp in zip(arrays, in_place):
        part = buf[offset:offset + a.size].reshape(a.shape)
        if inp:
            a[...] = part
            out.append(a)
        else:
            out.append(part.copy())
        offset += a.size
    return out


# ------------------------------------------------------------------ trace
def stats():
    """Per collective kind: count, bytes, time_s, algbw and busbw (bytes/s) since init/reset."""
    return _rt().trace.stats()


def reset_stats():
    """Clear the trace and the running totals."""
    _rt().trace.reset()


def timeline(path):
    """Write every rank's recent collectives as a Chrome-trace JSON (open it in Perfetto).

    Collective: every rank calls it; rank 0 writes ``path``, one track per rank. Returns the path.
    """
    rt = _rt()
    events = allgather_object(rt.trace.chrome_events(), name="jupyter_ring.timeline")
    if rt.rank == 0:
        merged = [e for rank_events in events for e in rank_events]
        tmp = f"{path}.tmp{os.getpid()}"
        # owner-only from creation: tensor names and timings are the user's business alone
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, fh)
        os.replace(tmp, path)
    return path


# ------------------------------------------------------------------ process sets (adapter hook)
def _new_process(rt):
    """A separate API state (queue, handles, auto names) over ``rt``: one per process set."""
    process = _Process()
    process.rt = rt
    return process


@contextlib.contextmanager
def _using(process):
    """Inside, the API's calls run on ``process`` (a process set's runtime), not this process's.

    Callers hold the adapters' lock: the swap is of one module global.
    """
    global _proc
    saved, _proc = _proc, process
    try:
        yield
    finally:
        _proc = saved

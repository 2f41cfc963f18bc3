"""Recycled memory: the results of out-of-place collectives, and buffers lent to one collective.

A fresh 64 MiB ``np.empty`` costs as much as the allreduce that fills it: the kernel zeroes and
maps every page on first touch. ``ResultPool`` hands out arrays over buffers that earlier results
gave back when the caller dropped them (``grad = allreduce(grad)`` in a loop drops the previous
one), so out-of-place allreduces write into memory that is already mapped, as in-place ones do.
"""

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["ResultPool", "Lender"]

MiB = 1 << 20


class Buffer(Protocol):
    """What ``Lender`` lends: anything that counts its elements (a torch tensor)."""

    def numel(self) -> int: ...


_K = TypeVar("_K", bound=Hashable)   # what a Lender's buffers are kept by
_B = TypeVar("_B", bound=Buffer)     # what a Lender lends


class ResultPool:
    """Free buffers by size (rounded up to whole MiB), at most ``limit`` bytes kept."""

    min_bytes = MiB          # smaller results come from np.empty (malloc reuses those anyway)

    def __init__(self, limit: int = 512 * MiB) -> None:
        self.limit = limit
        self.free: dict[int, list[npt.NDArray[np.uint8]]] = {}  # rounded size -> list of uint8 arrays
        self.kept = 0
        self.lock = threading.Lock()  # results are dropped in any thread

    def empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A new array of ``count`` items of ``dtype`` (uninitialised), recycled when possible."""
        nbytes = count * dtype.itemsize
        if nbytes < self.min_bytes:
            return np.empty(count, dtype)
        size = -(-nbytes // MiB) * MiB
        with self.lock:
            stack = self.free.get(size)
            raw = stack.pop() if stack else None
            if raw is not None:
                self.kept -= size
        if raw is None:
            raw = np.empty(size, np.uint8)
        # an array over a memoryview: every numpy view of it keeps this array (its base) alive
        arr = np.frombuffer(raw.data[:nbytes], dtype)
        weakref.finalize(arr, self._give, raw, size)
        return arr

    def _give(self, raw: npt.NDArray[np.uint8], size: int) -> None:
        with self.lock:
            if self.kept + size <= self.limit:
                self.free.setdefault(size, []).append(raw)
                self.kept += size

    def clear(self) -> None:
        with self.lock:
            self.free = {}
            self.kept = 0


class Lender(Generic[_K, _B]):
    """Buffers lent to one collective at a time: ``lend`` hands out a free buffer of ``key`` with
    at least ``numel`` elements (or ``make()``'s), the collective's finish gives it back. One whose
    collective failed or was abandoned is never given back (a transfer may still write into it),
    so it is never lent again. At most ``keep`` free buffers of each key are kept."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.free: dict[_K, list[_B]] = {}  # key -> list of buffers (torch tensors: anything with numel())
        self.lock = threading.Lock()

    def lend(self, key: _K, numel: int, make: Callable[[], _B]) -> _B:
        with self.lock:
            free = self.free.get(key, [])
            for index, buf in enumerate(free):
                if buf.numel() >= numel:
                    return free.pop(index)
        return make()

    def give_back(self, key: _K, buf: _B) -> None:
        with self.lock:
            free = self.free.setdefault(key, [])
            if len(free) < self.keep:
                free.append(buf)

    def drop(self, keep_key: Callable[[_K], object]) -> None:
        """Forget the free buffers of every key for which ``keep_key(key)`` is false."""
        with self.lock:
            self.free = {k: v for k, v in self.free.items() if keep_key(k)}

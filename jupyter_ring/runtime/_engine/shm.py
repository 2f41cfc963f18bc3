"""Shared-memory slots for allreduce when every rank runs on one host.

Each rank owns one file in ``/dev/shm`` (owner-only, reserved with ``posix_fallocate`` so a full
``/dev/shm`` fails at creation, not with SIGBUS later): a 4 KiB header whose first int64 is the
rank's sync counter, then its slot. A rank creates its file before the agreement exchange and
advertises it there as one int64 (a random token and the slot's log2 size), so peers map it after
the exchange with no extra message; it is unlinked once a sync shows every peer has mapped it.

No MPI call is made here: a sync is "write my counter, poll the peers' counters" from Python,
which the runtime's poll loop makes interruptible and bounded by the stall timeout. Counter values
are ``gen << 32 | tick``: ``tick`` counts syncs since the runtime's last resync, ``gen`` is bumped
by every resync, so a counter left behind by an abandoned collective is always smaller than any
value a later collective waits for.

Ordering: the data stores (numpy copies and ufuncs) must be visible to a peer before the counter
store that announces them. x86-64 keeps stores in order (and an atomic read-modify-write, here a
lock round trip, also drains the non-temporal stores of a large memcpy), so the path is offered
on x86-64 Linux only.
"""

import mmap
import os
import platform
import secrets
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["SharedSlots", "supported", "slot_log2", "sweep_stale"]

SHM_DIR = "/dev/shm"
_HEADER = 4096  # the counter, then the slot from a page boundary
_MIN_LOG2 = 16
_CHUNK_BYTES = 32 << 20  # registered memory comes in files of at least this size
_ALIGN = 64              # registered buffers start on a cache line


def supported() -> bool:
    """Whether this machine offers the path (Linux tmpfs in /dev/shm, x86-64 store ordering)."""
    return (platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")
            and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK))


def slot_log2(nbytes: int, cap: int) -> int:
    """log2 of the slot an allreduce of ``nbytes`` wants: a power of two, at most ``cap``."""
    want = max(_MIN_LOG2, (max(int(nbytes), 1) - 1).bit_length())
    return min(want, max(_MIN_LOG2, int(cap).bit_length() - 1))


def _path(token: int, suffix: int | str) -> str:
    return os.path.join(SHM_DIR, f"jupyter_ring.{token:011x}.{suffix}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(min_age: float = 60.0) -> list[str]:
    """Unlink this user's files in /dev/shm left by runtimes that died unclean; their paths.

    A rank unlinks its files once every peer has mapped them and at shutdown; a SIGKILLed rank
    (a killed kernel's engines, an OOM kill) cannot, and tmpfs is memory: each leaves up to a
    registered-memory chunk (32 MiB) behind. A file is stale when its creator's pid (stored in
    its header) is gone and nothing has written it for ``min_age`` seconds (a live rank's files
    are fresh, and a pid alone could belong to another pid namespace sharing /dev/shm).
    """
    removed: list[str] = []
    now = time.time()
    uid = os.getuid()
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith("jupyter_ring.")]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            info = os.stat(path)
            if info.st_uid != uid or now - info.st_mtime < min_age or info.st_size < 16:
                continue
            with open(path, "rb") as fh:
                header = fh.read(16)
            pid = int.from_bytes(header[8:16], "little")
            if 0 < pid < 1 << 32 and not _alive(pid):
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed


class _Segment:
    """One mapped file: its counter and its slot as numpy views."""

    def __init__(self, path: str, create_bytes: int = 0) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create_bytes else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create_bytes:
                os.posix_fallocate(fd, 0, create_bytes)
            self.map = mmap.mmap(fd, os.fstat(fd).st_size)
        except BaseException:
            if create_bytes:
                _unlink(path)
            raise
        finally:
            os.close(fd)
        self.path = path
        if create_bytes:  # the creator's pid, for sweep_stale() after a process died unclean
            np.frombuffer(self.map, np.int64, 1, 8)[0] = os.getpid()
        self.counter: npt.NDArray[np.int64] = np.frombuffer(self.map, np.int64, 1, 0)
        self.slot: npt.NDArray[np.uint8] = np.frombuffer(self.map, np.uint8, len(self.map) - _HEADER, _HEADER)

    def close(self) -> None:
        # a closed segment is never read again: its views are not Optional (SharedSlots.arrived
        # reads the peers' counters in the poll loop, with no check for None)
        self.counter = self.slot = None  # type: ignore[assignment]
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere: unmapped when it is collected
            pass


class _Chunk:
    """A file of registered memory that buffers (fused gradient buckets) are carved out of."""

    def __init__(self, path: str, nbytes: int) -> None:
        self.segment = _Segment(path, _HEADER + nbytes)
        self.path = path
        self.linked = True     # unlinked once every peer has mapped it
        self.base: int = self.segment.slot.__array_interface__["data"][0]
        self.size = self.segment.slot.nbytes
        self.free = [[0, self.size]]  # [offset, bytes], sorted, merged

    def take(self, nbytes: int) -> int | None:
        for hole in self.free:
            if hole[1] >= nbytes:
                offset = hole[0]
                hole[0] += nbytes
                hole[1] -= nbytes
                if not hole[1]:
                    self.free.remove(hole)
                return offset
        return None

    def give(self, offset: int, nbytes: int) -> None:
        self.free.append([offset, nbytes])
        self.free.sort()
        merged = [self.free[0]]
        for hole in self.free[1:]:
            if merged[-1][0] + merged[-1][1] == hole[0]:
                merged[-1][1] += hole[1]
            else:
                merged.append(hole)
        self.free = merged


class SharedSlots:
    """This rank's slot, the peers' slots it has mapped, and the sync counters; and registered
    memory: buffers in files the peers map too, reduced in place with no copy in."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.token = secrets.randbits(43) | 1  # names this runtime's files; never 0 (0 = "no shm")
        self.own: _Segment | None = None  # this rank's current segment
        self.own_log2 = 0
        self.peers: dict[int, tuple[int, _Segment]] = {}  # rank -> (advertised value, _Segment)
        self.unlink_when_synced: list[str] = []
        self.tick = 0
        self.tick_gen = -1
        self.chunks: list[_Chunk] = []  # this rank's registered memory; a region names (index + 1, offset)
        self.peer_chunks: dict[tuple[int, int], _Segment] = {}  # (rank, chunk index) -> the peer's _Segment
        self._fence = threading.Lock()
        self.probe_path = _path(self.token, "probe")
        segment = _Segment(self.probe_path, _HEADER)
        segment.counter[0] = self.token
        segment.close()

    # ------------------------------------------------------------------ init-time check
    def sees(self, tokens: Sequence[int]) -> bool:
        """Whether every peer's probe file (named by its token) is visible here with its token."""
        for q, token in enumerate(tokens):
            if q == self.rank:
                continue
            try:
                with open(_path(token, "probe"), "rb") as fh:
                    if int.from_bytes(fh.read(8), "little") != token:
                        return False
            except OSError:
                return False
        return True

    def remove_probe(self) -> None:
        _unlink(self.probe_path)

    # ------------------------------------------------------------------ per collective
    def advertise(self, nbytes: int, cap: int) -> int:
        """Make sure this rank's slot holds two pieces of ``nbytes``; the value to send the peers.

        The value names this rank's file and says the slot size it wants for this allreduce
        (every rank then uses the smallest wanted). 0 when the file cannot be made (then every
        rank takes the ring for this allreduce).
        """
        want = slot_log2(2 * nbytes, cap)
        if self.own is None or self.own_log2 < want:
            try:
                segment = _Segment(_path(self.token, want), _HEADER + (1 << want))
            except OSError:
                return 0
            self._drop_own()
            self.own, self.own_log2 = segment, want
            self.unlink_when_synced.append(segment.path)
        return self.token << 12 | self.own_log2 << 6 | want

    def _drop_own(self) -> None:
        if self.own is not None:
            # the peers map only the file advertised in the collective at hand: this one is done
            _unlink(self.own.path)
            if self.own.path in self.unlink_when_synced:
                self.unlink_when_synced.remove(self.own.path)
            self.own.close()
            self.own = None

    def attach(self, own: int, advertised: Mapping[int, int]) -> int:
        """Map every peer's advertised slot; return the slot size (bytes) every rank wants."""
        want = own & 63
        for q, value in advertised.items():
            want = min(want, value & 63)
            known = self.peers.get(q)
            if known is not None and known[0] >> 6 == value >> 6:
                continue
            segment = _Segment(_path(value >> 12, value >> 6 & 63))
            if known is not None:
                known[1].close()
            self.peers[q] = (value, segment)
        return 1 << want

    def slot(self, q: int) -> npt.NDArray[np.uint8]:
        if q != self.rank:
            return self.peers[q][1].slot
        assert self.own is not None  # an allreduce on this path advertised (made) this rank's slot
        return self.own.slot

    def arrive(self, gen: int) -> int:
        """Announce this rank's next sync point; returns the value to wait for."""
        if self.tick_gen != gen:
            self.tick_gen, self.tick = gen, 0
        self.tick += 1
        value = gen << 32 | self.tick
        with self._fence:  # an atomic RMW: every earlier store is visible before the counter's
            pass
        assert self.own is not None  # an allreduce on this path advertised (made) this rank's slot
        self.own.counter[0] = value
        return value

    def ticks(self, gen: int) -> int:
        """Syncs counted in generation ``gen`` so far."""
        return self.tick if self.tick_gen == gen else 0

    def align(self, gen: int, tick: int) -> None:
        """Continue counting syncs from ``tick`` (every rank passes the same, at least its own).

        After ``join()`` the ranks left out of the allreduces in between counted fewer syncs; every
        rank moves on from one value above every rank's count, so no counter of before can pass
        for a later sync.
        """
        self.tick_gen, self.tick = gen, max(self.ticks(gen), tick)

    def arrived(self, value: int, ranks: Iterable[int] | None = None) -> bool:
        """Whether every peer (of ``ranks``, when given) reached sync point ``value``."""
        peers = self.peers
        for q in (peers if ranks is None else ranks):
            if peers[q][1].counter[0] < value:
                return False
        return True

    def missing(self, value: int, ranks: Iterable[int] | None = None) -> list[int]:
        peers = self.peers
        return sorted(q for q in (peers if ranks is None else ranks) if peers[q][1].counter[0] < value)

    def synced(self) -> None:
        """Every peer passed a sync with this rank's file mapped: its name is no longer needed."""
        while self.unlink_when_synced:
            _unlink(self.unlink_when_synced.pop())

    # ------------------------------------------------------------------ registered memory
    def register(self, nbytes: int) -> tuple[npt.NDArray[np.uint8] | None, int]:
        """A buffer of ``nbytes`` in registered memory (uint8, a view of a chunk); None when
        /dev/shm cannot hold it. Give it back with ``unregister``."""
        nbytes = max(_ALIGN, -(-int(nbytes) // _ALIGN) * _ALIGN)
        for index, chunk in enumerate(self.chunks):
            offset = chunk.take(nbytes)
            if offset is not None:
                return chunk.segment.slot[offset:offset + nbytes], (index + 1) << 40 | offset
        index = len(self.chunks)
        try:
            chunk = _Chunk(_path(self.token, f"r{index}"), max(nbytes, _CHUNK_BYTES))
        except OSError:
            return None, 0
        self.chunks.append(chunk)
        offset = chunk.take(nbytes)
        assert offset is not None  # a fresh chunk holds at least nbytes
        return chunk.segment.slot[offset:offset + nbytes], (index + 1) << 40 | offset

    def unregister(self, region: int, nbytes: int) -> None:
        """Give back a buffer from ``register`` (its memory is reused by later ones)."""
        if 0 < region >> 40 <= len(self.chunks):
            self.chunks[(region >> 40) - 1].give(region & ((1 << 40) - 1),
                                                 max(_ALIGN, -(-int(nbytes) // _ALIGN) * _ALIGN))

    def locate(self, array: np.ndarray) -> int:
        """The region of ``array`` (flat, contiguous) when it lies in registered memory, else 0."""
        if not self.chunks:
            return 0
        start: int = array.__array_interface__["data"][0]
        end = start + array.nbytes
        for index, chunk in enumerate(self.chunks):
            if chunk.base <= start and end <= chunk.base + chunk.size:
                return (index + 1) << 40 | (start - chunk.base)
        return 0

    def region(self, q: int, token: int, region: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """Peer ``q``'s registered ``region`` (named by its ``token``) as ``nbytes`` of uint8."""
        key = (q, region >> 40)
        segment = self.peer_chunks.get(key)
        if segment is None:
            segment = self.peer_chunks[key] = _Segment(_path(token, f"r{(region >> 40) - 1}"))
        offset = region & ((1 << 40) - 1)
        return segment.slot[offset:offset + nbytes]

    def mapped_by_every_peer(self, region: int) -> None:
        """Every peer has mapped this region's file (a sync passed with it in use): unlink it."""
        chunk = self.chunks[(region >> 40) - 1]
        if chunk.linked:
            _unlink(chunk.path)
            chunk.linked = False

    def close(self) -> None:
        self.remove_probe()
        for path in self.unlink_when_synced:
            _unlink(path)
        self.unlink_when_synced = []
        self._drop_own()
        for _value, segment in self.peers.values():
            segment.close()
        self.peers = {}
        for chunk in self.chunks:
            if chunk.linked:
                _unlink(chunk.path)
            chunk.segment.close()
        self.chunks = []
        for segment in self.peer_chunks.values():
            segment.close()
        self.peer_chunks = {}

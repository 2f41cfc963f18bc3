"""What a rank is doing, readable from outside the rank: the collective in progress and the ranks
it waits on (a small record in a shared file), and every thread's Python stack on a signal.

Neither needs the rank's main thread to cooperate, so both work on a rank stuck in C code that
holds the GIL or blocks signals:

- the record is a 512-byte memory-mapped file that :class:`Activity` rewrites in one copy when a
  collective begins, starts waiting on peers and ends; another process reads it at any time;
- the stacks come from :mod:`faulthandler` registered on :data:`WHERE_SIGNAL` (SIGUSR2): its
  handler is C code that runs in whichever thread the kernel delivers the signal to (a thread
  that blocks it is skipped), needs no GIL and writes every thread's stack to the rank's file.

``arm(directory, rank)`` sets both up (``%ring start`` does it on every engine); the front end
signals the ranks and reads ``rank<r>.stacks`` and ``rank<r>.doing`` (``cluster/_where.py``).
Costs nothing between requests but the record's rewrite: one ``pack_into`` per collective.
"""

import faulthandler
import mmap
import os
import re
import signal
import struct
import threading
import time
from collections.abc import Iterable
from typing import IO, NamedTuple

__all__ = ["WHERE_SIGNAL", "Doing", "Frame", "ThreadStack", "Activity", "activity", "doing", "arm",
           "disarm", "stack_path", "doing_path", "read_doing", "parse_stacks"]

WHERE_SIGNAL = signal.SIGUSR2

# The record, at fixed offsets so that each change rewrites only its own fields (a few
# pack_into calls, no allocation): seq, since (time.time(), 0 = not in a collective), waiting
# since | main thread id, pid | ranks waited on: count, then up to _MAX_WAIT | "kind\tname".
_TIMES = struct.Struct("<Qdd")
_IDS = struct.Struct("<Qi")
_IDS_AT = _TIMES.size
_COUNT = struct.Struct("<i")
_COUNT_AT = _IDS_AT + _IDS.size
_MAX_WAIT = 32
_RANKS_AT = _COUNT_AT + _COUNT.size
_LENGTH = struct.Struct("<H")
_LENGTH_AT = _RANKS_AT + 4 * _MAX_WAIT
_TEXT_AT = _LENGTH_AT + _LENGTH.size
_SIZE = 512
_TEXT = _SIZE - _TEXT_AT


class Doing(NamedTuple):
    """What one rank is doing: ``state`` is ``"running"`` (Python code, no collective),
    ``"collective"`` (inside ``kind`` ``name`` since ``since``) or ``"waiting"`` (that, and
    waiting for ``waiting_for`` since ``waiting_since``). Times are ``time.time()``."""

    state: str
    kind: str = ""
    name: str = ""
    since: float = 0.0
    waiting_for: tuple[int, ...] = ()
    waiting_since: float = 0.0
    pid: int = 0
    main_thread: int = 0

    def describe(self, now: float | None = None) -> str:
        """``inside allreduce 'grad' for 3.2 s, waiting for rank(s) 1 for 3.1 s``, or ``running``."""
        if self.state == "running":
            return "running (not in a collective)"
        now = time.time() if now is None else now
        text = f"inside {self.kind} '{self.name}' for {max(0.0, now - self.since):.1f} s"
        if self.waiting_for:
            ranks = ", ".join(map(str, self.waiting_for))
            text += f", waiting for rank(s) {ranks} for {max(0.0, now - self.waiting_since):.1f} s"
        return text


class Activity:
    """This process's current collective, mirrored into a file another process can read.

    The runtime calls ``begin`` (agreement starts), ``waiting`` (a wait outlasts the spin) and
    ``end``; each is one record copy into the map when armed, a few attribute stores when not.
    """

    def __init__(self) -> None:
        # None right after arm(): the new map holds no text yet, the next begin writes it
        self.kind: str | None = ""
        self.name: str | None = ""
        self.since = 0.0
        self.waiting_for: tuple[int, ...] = ()
        self.waiting_since = 0.0
        self._map: mmap.mmap | None = None
        self._seq = 0
        self._stacks: IO[bytes] | None = None  # the file faulthandler writes to (it must stay open)
        self._main = threading.main_thread().ident or 0
        self._pid = os.getpid()

    def begin(self, kind: str, name: str) -> None:
        # a loop's collectives repeat their kind and name: the text in the map is written only
        # when it changes (identity: the same str objects), the rest is the times' one pack_into
        self.since = time.time()
        if self.waiting_for:
            self.waiting_for, self.waiting_since = (), 0.0
            if self._map is not None:
                _COUNT.pack_into(self._map, _COUNT_AT, 0)
        if name is not self.name or kind is not self.kind:
            self.kind, self.name = kind, name
            if self._map is not None:
                text = f"{kind}\t{name}".encode("utf-8", "replace")[:_TEXT]
                _LENGTH.pack_into(self._map, _LENGTH_AT, len(text))
                self._map[_TEXT_AT:_TEXT_AT + len(text)] = text
        if self._map is not None:
            self._stamp()

    def waiting(self, ranks: Iterable[int]) -> None:
        ranks = tuple(ranks)
        if ranks != self.waiting_for:
            self.waiting_for, self.waiting_since = ranks, time.time()
            if self._map is not None:
                shown = ranks[:_MAX_WAIT]
                struct.pack_into(f"<{len(shown)}i", self._map, _RANKS_AT, *shown)
                _COUNT.pack_into(self._map, _COUNT_AT, len(shown))
                self._stamp()

    def end(self) -> None:
        # kind, name and the ranks waited on stay until the next begin: not read while since is 0
        if self.since:
            self.since = 0.0
            if self._map is not None:
                self._stamp()

    def _stamp(self) -> None:
        # written last: a reader compares two reads of the record to skip a torn one
        self._seq += 1
        if self._map is not None:  # (the callers check: only an armed record is stamped)
            _TIMES.pack_into(self._map, 0, self._seq, self.since, self.waiting_since)

    def doing(self) -> Doing:
        """The :class:`Doing` record of this process, now."""
        if not self.since:
            return Doing("running", pid=self._pid, main_thread=self._main)
        # kind and name are str while since is set (None only between arm() and the next begin)
        return Doing("waiting" if self.waiting_for else "collective", self.kind or "", self.name or "",
                     self.since, self.waiting_for, self.waiting_since, self._pid, self._main)

    # ------------------------------------------------------------------ arming
    def arm(self, directory: str, rank: int) -> None:
        """Mirror the record into ``directory/rank<r>.doing`` and dump every thread's stack into
        ``directory/rank<r>.stacks`` on ``WHERE_SIGNAL``. Files are created owner-only."""
        self.disarm()
        self._pid = os.getpid()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(doing_path(directory, rank), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        _IDS.pack_into(self._map, _IDS_AT, self._main, self._pid)
        kind, name, since = self.kind, self.name, self.since
        self.waiting_for, waiting = (), self.waiting_for
        self.kind = self.name = None  # the new map holds no text yet: the next begin writes it
        if since:  # armed mid-collective: write what is known
            self.begin(kind or "", name or "")  # str: since is set
            self.since = since
            self.waiting(waiting)
        self._stamp()
        fd = os.open(stack_path(directory, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                     0o600)
        self._stacks = os.fdopen(fd, "wb", buffering=0)
        # chain=False: the default action of SIGUSR2 (terminate) must never run
        faulthandler.register(WHERE_SIGNAL, file=self._stacks, all_threads=True, chain=False)

    def disarm(self) -> None:
        """Stop mirroring the record and dumping stacks on ``WHERE_SIGNAL`` (files stay)."""
        if self._stacks is not None:
            faulthandler.unregister(WHERE_SIGNAL)
            self._stacks.close()
            self._stacks = None
        if self._map is not None:
            self._map.close()
            self._map = None


# One per process, like the process's runtime: the runtime marks collectives on it, the engine
# setup arms it once (it outlives shutdown()/init()).
activity = Activity()


def doing() -> Doing:
    """What this rank is doing now (a :class:`Doing`): the runtime's collective in progress and the
    ranks it waits on, or ``running``."""
    return activity.doing()


def arm(directory: str, rank: int) -> None:
    """Make this rank's stacks and :func:`doing` readable from outside (see :class:`Activity`)."""
    activity.arm(directory, rank)


def disarm() -> None:
    """Undo :func:`arm`."""
    activity.disarm()


def stack_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.stacks")


def doing_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.doing")


def cells_path(directory: str, rank: int) -> str:
    """The folder of the rank's recent cells' sources (the Where? report's source lines)."""
    return os.path.join(directory, f"rank{rank}.cells")


def cell_source_name(code_name: str) -> str:
    """The file in :func:`cells_path` holding the source of the cell IPython compiled as
    ``code_name`` (``/tmp/ipykernel_42/123.py``, ``<ipython-input-3-ab>``)."""
    return re.sub(r"[^\w.-]", "_", os.path.basename(code_name.strip("<>")))[-100:] or "cell"


# ---------------------------------------------------------------------- readers (other processes)
def read_doing(path: str) -> Doing | None:
    """The :class:`Doing` record a rank keeps in ``path``; None when it is not there."""
    try:
        with open(path, "rb") as fh:
            for _attempt in range(20):
                fh.seek(0)
                first = fh.read(_SIZE)
                fh.seek(0)
                if len(first) < _SIZE or first == fh.read(_SIZE):
                    break
    except OSError:
        return None
    if len(first) < _SIZE:
        return None
    _seq, since, waiting_since = _TIMES.unpack_from(first)
    main, pid = _IDS.unpack_from(first, _IDS_AT)
    if not since:
        return Doing("running", pid=pid, main_thread=main)
    count = min(max(_COUNT.unpack_from(first, _COUNT_AT)[0], 0), _MAX_WAIT)
    ranks = struct.unpack_from(f"<{count}i", first, _RANKS_AT)
    length = min(_LENGTH.unpack_from(first, _LENGTH_AT)[0], _TEXT)
    kind, _, name = first[_TEXT_AT:_TEXT_AT + length].decode("utf-8", "replace").partition("\t")
    return Doing("waiting" if ranks else "collective", kind, name, since, ranks, waiting_since, pid,
                 main)


class Frame(NamedTuple):
    """One frame of a stack, as faulthandler writes it (no source text)."""

    file: str
    line: int
    function: str


class ThreadStack(NamedTuple):
    """One thread's stack, innermost frame first (faulthandler's order)."""

    thread: int
    current: bool       # the thread the signal was delivered to
    frames: tuple[Frame, ...]


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')


def parse_stacks(text: str) -> list[ThreadStack]:
    """faulthandler's all-threads dump as a list of :class:`ThreadStack`."""
    threads: list[ThreadStack] = []
    frames: list[list[Frame]] = []  # of each thread in threads, as they are read
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            threads.append(ThreadStack(int(head.group(2), 16), head.group(1) == "Current thread", ()))
            frames.append([])
            continue
        frame = _FRAME.match(line)
        if frame and frames:
            number = frame.group(2)
            frames[-1].append(Frame(frame.group(1), int(number) if number.isdigit() else 0,
                                    frame.group(3).strip()))
    return [t._replace(frames=tuple(f)) for t, f in zip(threads, frames)]

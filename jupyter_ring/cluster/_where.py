"""``%ring where``: every rank's Python stack and collective, read from outside the ranks.

Each rank keeps two files in the cluster's where folder (``runtime/_observe/where.py`` arms them at
``%ring start``): ``rank<r>.doing``, a record of its collective in progress rewritten by the
runtime, and ``rank<r>.stacks``, to which faulthandler appends every thread's stack when the rank
gets ``WHERE_SIGNAL``. This module sends the signal (through the nannies, like an interrupt),
waits for each rank's dump to land, and reads both: no rank's main thread has to run a line of
Python, so a rank stuck in C code that holds the GIL or blocks SIGINT answers too.

A rank on another host writes its files on that host: they reach this kernel when the folder is on
a shared file system (the profile under a shared home, as on most Slurm clusters); otherwise the
rank is reported as unreadable, with the ``py-spy dump`` command that reads it on its host.
"""

import linecache
import os
import re
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from ..engines._setup import RankRow
from ..runtime.internal import read_held
from ..runtime.internal import (WHERE_SIGNAL, Doing, Frame, ThreadStack, cell_source_name, cells_path,
                              doing_path, parse_stacks, read_doing, stack_path)
from ._sidecar import SidecarRank

__all__ = ["RankWhere", "where_dir", "collect_where", "format_where", "where_json", "rank_ranges"]

# Frames of the engine's plumbing (the kernel's event loop, ipyparallel, IPython running the
# cell): hidden below the user's frames, counted in one line.
_PLUMBING = ("/IPython/", "/ipykernel/", "/ipyparallel/", "/tornado/", "/asyncio/", "/zmq/",
             "/traitlets/", "/jupyter_client/", "<frozen runpy>", "/threading.py",
             "/concurrent/futures/", "/selectors.py")

# jupyter_ring's own frames (the runtime waiting inside a collective, the engine's cell runner):
# a run of them innermost, above the user's call, is hidden in one line as in tracebacks (the
# state line already says which collective and whom it waits for).
_OWN = re.compile(r"[/\\]jupyter_ring[/\\](runtime|engines)[/\\]")

# How long a dump must stay the same size to count as complete: faulthandler writes it from one
# signal handler, in well under a millisecond unless the process is descheduled.
_SETTLE = 0.015


class RankWhere(NamedTuple):
    """One rank's answer: its record, its threads (main thread first) or why there is none."""

    rank: int
    host: str
    pid: int
    doing: Doing | None
    threads: tuple[ThreadStack, ...]  # the rank's main thread first
    problem: str        # "" when the stacks were read
    seconds: float      # from the signal to the dump read
    debugger: str = ""  # where it is stopped, while the rank is held in a debugger (issue 35)
    cells: str = ""     # the folder of the rank's recent cells' sources (runtime._observe.where.cells_path)

    def source(self, frame: Frame) -> str:
        """The frame's source line: from the file where this host can read it, else (a cell's
        frame) from the rank's record of its recent cells; "" when neither has it."""
        if not frame.line:
            return ""
        line = linecache.getline(frame.file, frame.line)
        if not line and self.cells:
            # read directly, not through linecache: these files go with the cluster, and an entry
            # for a vanished file in the process-wide cache races linecache.checkcache in other
            # threads (pdb calls it; a KeyError was seen in one)
            try:
                with open(os.path.join(self.cells, cell_source_name(frame.file))) as fh:
                    lines = fh.read().splitlines()
            except OSError:
                return ""
            line = lines[frame.line - 1] if 0 < frame.line <= len(lines) else ""
        return line.strip()


def where_dir(profile_dir: str, cluster_id: str) -> str:
    """The folder of cluster ``cluster_id``'s where files (owner-only, beside its sidecar)."""
    return os.path.join(profile_dir, "security", f"jupyter_ring-{cluster_id}-where")


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def collect_where(directory: str, rows: Iterable[RankRow | SidecarRank],
                  send: Callable[[list[int], signal.Signals], object],
                  ranks: Iterable[int] | None = None, timeout: float = 3.0) -> list[RankWhere]:
    """Signal ``ranks`` (default: every row's) with ``send(ranks, WHERE_SIGNAL)`` and read their
    stacks and records; a :class:`RankWhere` per rank, in the order of ``ranks``.

    ``rows`` are the ranks' start rows (rank, host, pid). A rank whose dump has not landed within
    ``timeout`` seconds (stopped, dead, its signal blocked in every thread) says so.
    """
    by_rank = {row["rank"]: row for row in rows}
    ranks = list(by_rank) if ranks is None else [r for r in ranks if r in by_rank]
    before = {r: _size(stack_path(directory, r)) for r in ranks}
    # read as the signal leaves, so that each record and its stack describe the same moment
    records = {r: read_doing(doing_path(directory, r)) for r in ranks}
    held = {r: read_held(directory, r) or "" for r in ranks}
    sent = time.monotonic()
    send([r for r in ranks if before[r] is not None], WHERE_SIGNAL)
    seen, done = _wait_for_dumps(directory, before, sent, sent + timeout)
    out = []
    for r in ranks:
        row = by_rank[r]
        doing = records[r]
        problem = ""
        threads: Sequence[ThreadStack] = ()
        if before[r] is None:
            problem = (f"no stack file {stack_path(directory, r)} here" +
                       (f": rank {r} runs on {row['host']}, whose files reach this host only "
                        f"through a shared file system; on {row['host']} run "
                        f"`py-spy dump --pid {row['pid']}`" if _remote(row) else
                        ": the rank was not armed (started before %ring where existed?); "
                        "%ring restart arms it"))
        elif r not in done:
            if r in seen:  # it grew but kept growing: read what is there
                done[r] = time.monotonic() - sent
            else:
                problem = (f"no stack dump within {timeout:g} s of {WHERE_SIGNAL.name}: the process "
                           "is stopped, dead, or blocks the signal in every thread; "
                           f"`py-spy dump --pid {row['pid']}` on {row['host']} reads it from outside")
        if not problem:
            with open(stack_path(directory, r), "rb") as fh:
                fh.seek(before[r] or 0)  # not None: a rank without a stack file has a problem
                text = fh.read().decode("utf-8", "replace")
            threads = _main_first(parse_stacks(text), doing)
        out.append(RankWhere(r, row["host"], row["pid"], doing, tuple(threads), problem,
                             done.get(r, 0.0), held[r], cells_path(directory, r)))
    return out


def _wait_for_dumps(directory: str, before: dict[int, int | None], sent: float,
                    deadline: float) -> tuple[dict[int, tuple[int, float]], dict[int, float]]:
    """Wait until each signalled rank's stack file has grown and then stopped growing for
    ``_SETTLE`` seconds, or ``deadline``. Returns (rank -> (size, when) of those seen growing,
    rank -> seconds from ``sent`` to its dump for those done)."""
    seen: dict[int, tuple[int, float]] = {}
    done: dict[int, float] = {}
    waiting = [r for r, start in before.items() if start is not None]
    while waiting and time.monotonic() < deadline:
        time.sleep(0.003)
        now = time.monotonic()
        for r in list(waiting):
            size, start = _size(stack_path(directory, r)), before[r]
            if size is None or start is None or size <= start:
                continue
            last = seen.get(r)
            if last is None or last[0] != size:
                seen[r] = (size, now)
            elif now - last[1] >= _SETTLE:
                done[r] = now - sent
                waiting.remove(r)
    return seen, done


def _remote(row: RankRow | SidecarRank) -> bool:
    import socket

    return row["host"] not in (socket.gethostname(), "localhost")


def _main_first(threads: Iterable[ThreadStack], doing: Doing | None) -> list[ThreadStack]:
    main = doing.main_thread if doing is not None else 0
    return sorted(threads, key=lambda t: t.thread != main)


def _plumbing(frame: Frame) -> bool:
    return any(part in frame.file for part in _PLUMBING)


def _user_frames(thread: ThreadStack, main: bool) -> tuple[list[Frame], int, int]:
    """The thread's frames without the engine's plumbing and without jupyter_ring's own innermost
    frames (innermost first), how many plumbing frames hid, and how many of jupyter_ring's.

    A thread with nothing but jupyter_ring's frames is one of ours (the progress engine, the
    torch monitor): none of it is the user's. Except the main thread, which keeps them: what it
    runs is the user's cell."""
    kept = [f for f in thread.frames if not _plumbing(f)]
    own = 0
    while own < len(kept) and _OWN.search(kept[own].file):
        own += 1
    if own == len(kept) and main:
        own = 0
    return kept[own:], len(thread.frames) - len(kept), own


# From this many ranks on, ranks whose state and frames read the same are shown as one block
# (``ranks 0-2, 4-63 @ host: ...``): at 64 ranks a wait names its culprit in a few blocks instead
# of 64. Below it every rank keeps its own block, with its pid for py-spy.
GROUP_FROM = 5

_DEBUGPY = " (debugpy)"  # how a rank held by debugpy ends its mark's "where"


def _in_debugger(where: str) -> str:
    """The state of a rank held in a debugger at ``where`` (its held mark): pdb's prompt in the
    cell, or debugpy (engines/_debugpy.py)."""
    tool = "pdb"
    if where.endswith(_DEBUGPY):
        where, tool = where[:-len(_DEBUGPY)], "debugpy"
    return f"in the debugger ({tool}), stopped at {where}"


def _state_line(item: RankWhere, now: float) -> str:
    head = f"rank {item.rank} @ {item.host} (pid {item.pid})"
    if item.debugger:
        return f"{head}: {_in_debugger(item.debugger)}"
    if item.doing is None:
        return f"{head}: (no collective record)"
    return f"{head}: {item.doing.describe(now)}"


def rank_ranges(ranks: Iterable[int]) -> str:
    """``0-2, 4, 6-63``: sorted ranks with runs of consecutive ones as ranges."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _span(values: Sequence[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f}"


def _group_state_line(group: Sequence[RankWhere], now: float) -> str:
    """The state line of ranks that read the same: their ranks, hosts and the span of their times."""
    hosts = sorted({item.host for item in group})
    where = hosts[0] if len(hosts) == 1 else f"{len(hosts)} hosts"
    head = f"ranks {rank_ranges(item.rank for item in group)} @ {where}"
    first = group[0]
    if first.debugger:
        return f"{head}: {_in_debugger(first.debugger)}"
    if first.doing is None:
        return f"{head}: (no collective record)"
    doings = [item.doing for item in group if item.doing is not None]
    if first.doing.state == "running":
        return f"{head}: {first.doing.describe(now)}"
    text = (f"{head}: inside {first.doing.kind} '{first.doing.name}' for "
            f"{_span([max(0.0, now - d.since) for d in doings])} s")
    if first.doing.waiting_for:
        text += (f", waiting for rank(s) {', '.join(map(str, first.doing.waiting_for))} for "
                 f"{_span([max(0.0, now - d.waiting_since) for d in doings])} s")
    return text


def _thread_lines(item: RankWhere, all_threads: bool) -> list[str]:
    """The rank's threads, main thread first, each with its frames innermost first."""
    lines = []
    if item.problem:
        lines.append(f"    {item.problem}")
    for index, thread in enumerate(item.threads):
        main = index == 0 and item.doing is not None and thread.thread == item.doing.main_thread
        frames, hidden, own = _user_frames(thread, main)
        if not main and not all_threads and not frames:
            continue  # plumbing, or one of ours (heartbeat, monitor): only with --all-threads
        if all_threads:
            frames, hidden, own = list(thread.frames), 0, 0
        label = "main thread" if main else f"thread 0x{thread.thread:x}"
        if not frames:
            lines.append(f"  {label}: idle (waiting for a cell)")
            continue
        lines.append(f"  {label}, innermost frame first:")
        if own:
            lines.append(f"    ... {own} frame(s) inside jupyter_ring above (--all-threads "
                         "shows them)")
        for frame in frames:
            lines.append(f'    File "{frame.file}", line {frame.line}, in {frame.function}')
            source = item.source(frame)
            if source:
                lines.append(f"      {source}")
        if hidden:
            lines.append(f"    ... {hidden} frame(s) of the engine (IPython, ipyparallel) below")
    return lines


def _same_key(item: RankWhere, body: list[str]) -> tuple[object, ...]:
    """What must be equal for two ranks to share a block: the state without times, the frames."""
    doing = item.doing
    state = None if doing is None else (doing.state, doing.kind, doing.name, tuple(doing.waiting_for))
    # thread ids differ between processes: a secondary thread's label is left out of the key
    return (item.debugger, state, tuple(re.sub(r"thread 0x[0-9a-f]+", "thread", line) for line in body))


def format_where(items: Iterable[RankWhere], all_threads: bool = False,
                 now: float | None = None) -> str:
    """Plain text: a block per rank, its state line then its main thread's frames, innermost
    first, each with its source line where this host can read the file. From ``GROUP_FROM``
    ranks on, ranks whose state and frames read the same share one block (``ranks 0-2, 5 @``),
    in the order of their first rank."""
    now = time.time() if now is None else now
    items = list(items)
    bodies = [_thread_lines(item, all_threads) for item in items]
    if len(items) < GROUP_FROM:
        return "\n".join("\n".join([_state_line(item, now)] + body) for item, body in zip(items, bodies))
    groups: dict[tuple[object, ...], list[tuple[RankWhere, list[str]]]] = {}
    for item, body in zip(items, bodies):
        groups.setdefault(_same_key(item, body), []).append((item, body))
    blocks = []
    for members in groups.values():
        ranks = [item for item, _ in members]
        head = _state_line(ranks[0], now) if len(ranks) == 1 else _group_state_line(ranks, now)
        blocks.append("\n".join([head] + members[0][1]))
    return "\n".join(blocks)


def where_json(items: Iterable[RankWhere], now: float | None = None) -> list[dict[str, object]]:
    """The same for the Ring panel's route: a dict per rank (frames innermost first)."""
    now = time.time() if now is None else now
    out = []
    for item in items:
        threads = []
        for index, thread in enumerate(item.threads):
            main = index == 0 and item.doing is not None and thread.thread == item.doing.main_thread
            frames, hidden, own = _user_frames(thread, main)
            if not main and not frames:
                continue
            threads.append({"thread": f"0x{thread.thread:x}", "main": main, "hidden": hidden,
                            "hidden_inside": own,
                            "frames": [{"file": f.file, "line": f.line, "function": f.function,
                                        "source": item.source(f)} for f in frames]})
        doing = item.doing
        out.append({"rank": item.rank, "host": item.host, "pid": item.pid,
                    "state": doing.state if doing else "unknown",
                    "doing": doing.describe(now) if doing else "",
                    "kind": doing.kind if doing else "", "name": doing.name if doing else "",
                    "waiting_for": list(doing.waiting_for) if doing else [],
                    "problem": item.problem, "threads": threads, "debugger": item.debugger,
                    "seconds": round(item.seconds, 4)})
    return out

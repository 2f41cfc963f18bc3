"""A rank held in a debugger, and the records its prompt travels in between rank and notebook.

Everything lives in the cluster's where folder (``<profile>/security/jupyter_ring-<id>-where``,
0700, beside the ``%ring where`` files; ``cluster/_where.where_dir``), one small file per fact:

- ``rank<r>.held``: exists while rank r is inside its debugger's interaction (at the prompt, or
  running a command typed there): its pid, host and where it stopped. Peers waiting in a
  collective list the folder every 0.25 s (``Runtime.poll``): a rank held in a debugger is not a
  stall (unless its process is gone: a killed rank's mark holds nobody).
- ``rank<r>.prompt``: a :class:`Prompt`, written by the rank when its debugger wants a line.
- ``rank<r>.reply``: a :class:`Reply`, written by the notebook kernel; the rank takes it and
  removes both files.
- no file: before writing its prompt the rank publishes a display of the MIME type ``MARK``
  (``{"seq": n}``), which travels behind what it printed: the kernel takes it out of the cell's
  output and asks only once it came, so that the rank's last lines show above its prompt.
- ``listening``: written by the kernel while a ``%%distributed`` cell that can answer runs; a
  ``breakpoint()`` without it is skipped (as before), since nobody would answer.

Each record is written under a temporary name and renamed into place, so a reader never sees half
of one; files are created 0600 in a 0700 folder. No socket, no port: nothing another user of the
machine can reach, and it works through a shared file system for a rank on another host.
Pure standard library: the runtime (the stall clock), the ranks' debugger
(``engines/_debugger.py``) and the kernel (``_debug.py``) all read these names from here.
"""

from __future__ import annotations

import json
import os
import socket
from typing import TypedDict

__all__ = ["MARK", "Prompt", "Reply", "Hold", "hold", "held_path", "prompt_path", "reply_path",
           "listening_path", "write_record", "read_record", "remove", "held_ranks", "read_held",
           "waiting_prompts"]

_HELD = ".held"

# The display a rank publishes before each prompt (see above); never shown.
MARK = "application/vnd.jupyter-ring.debug-prompt+json"
_PROMPT = ".prompt"


class Prompt(TypedDict):
    """A rank's debugger waiting for a line: the output since its last line, then the prompt."""

    seq: int      # increases with every prompt of the process: a reply names the one it answers
    pid: int
    text: str     # what the debugger printed since the last line it read (its prompt cut off)
    where: str    # "12.py:3 in <module>": where the rank is stopped


class Reply(TypedDict):
    """The line typed for prompt ``seq``."""

    seq: int
    line: str


def held_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}{_HELD}")


def prompt_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}{_PROMPT}")


def reply_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.reply")


def listening_path(directory: str) -> str:
    return os.path.join(directory, "listening")


def write_record(path: str, record: object) -> None:
    """Write ``record`` as JSON to ``path`` at once (a temporary name renamed into place), 0600."""
    temporary = f"{path}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(record, fh)
    os.replace(temporary, path)


def read_record(path: str) -> dict[str, object] | None:
    """The JSON record at ``path``, or None when there is none (or not a whole one)."""
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _ranks_with(directory: str, suffix: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for name in names:
        if name.startswith("rank") and name.endswith(suffix):
            number = name[4:-len(suffix)]
            if number.isdigit():
                out.append(int(number))
    return sorted(out)


def held_ranks(directory: str) -> list[int]:
    """The ranks held in a debugger now: one listing of the folder (a few µs when none is), then
    each mark read: a mark whose process died on this host is left by a killed rank, not held
    (it would keep its peers from ever stalling)."""
    here = socket.gethostname()
    out = []
    for rank in _ranks_with(directory, _HELD):
        record = read_record(held_path(directory, rank))
        if record is None:
            continue
        pid = record.get("pid")
        if record.get("host") == here and isinstance(pid, int) and not _alive(pid):
            continue
        out.append(rank)
    return out


def read_held(directory: str, rank: int) -> str | None:
    """Where rank ``rank`` is held ("12.py:3 in <module>"), or None when it is not."""
    record = read_record(held_path(directory, rank))
    return None if record is None else str(record.get("where") or "?")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process took the number: not ours, but alive
        return True
    return True


def waiting_prompts(directory: str) -> dict[int, Prompt]:
    """The prompts the ranks wait at now, by rank (a rank's record is read only if it is there)."""
    out: dict[int, Prompt] = {}
    for rank in _ranks_with(directory, _PROMPT):
        record = read_record(prompt_path(directory, rank)) or {}
        seq, pid = record.get("seq"), record.get("pid")
        if isinstance(seq, int):
            out[rank] = Prompt(seq=seq, pid=pid if isinstance(pid, int) else 0,
                               text=str(record.get("text") or ""),
                               where=str(record.get("where") or ""))
    return out


class Hold:
    """This process's mark "held in a debugger", and its view of the peers' marks.

    Armed by the engine's setup with the where folder and this rank's number; unarmed (a plain
    ``mpiexec`` run) it marks nothing and sees no peer held.
    """

    def __init__(self) -> None:
        self.directory: str | None = None
        self.rank = -1

    def arm(self, directory: str, rank: int) -> None:
        self.directory, self.rank = directory, rank
        self.leave()  # a mark left by a process this one replaces

    def enter(self, where: str) -> None:
        """Mark this rank held (its debugger's prompt is up, or a command typed there runs)."""
        if self.directory is None:
            return
        write_record(held_path(self.directory, self.rank),
                     {"pid": os.getpid(), "host": socket.gethostname(), "where": where})

    def leave(self) -> None:
        if self.directory is not None:
            remove(held_path(self.directory, self.rank))

    def anyone(self) -> bool:
        """Whether any rank (this one included) is held in a debugger now."""
        return self.directory is not None and bool(held_ranks(self.directory))

    def peers(self) -> list[int]:
        """The other ranks held in a debugger now (``[]`` unarmed)."""
        if self.directory is None:
            return []
        return [r for r in held_ranks(self.directory) if r != self.rank]


# One per process, like ``_where.activity``: the engine's setup arms it, the debugger marks it,
# the runtime's waits read it.
hold = Hold()

"""The kernel's end of the ranks' debuggers during one ``%%distributed`` cell.

A rank that stops in ``breakpoint()`` (``engines/_debugger.py``) writes a ``Prompt`` record into
the cluster's where folder and waits for a ``Reply`` (``runtime/_observe/debugger.py``). ``CellRun``'s
wait loop asks :meth:`Debuggers.attend` at every tick; it shows the rank's pdb output in the
cell, asks the user with the kernel's own ``input()`` (an ``input_request`` on the stdin
channel: JupyterLab, Notebook 7, VS Code and ``jupyter console`` all answer it) and hands the line
back. A few lines are the notebook's own, not pdb's (Monarch's debug client has the same)::

    ranks            the ranks of the cell: at a prompt (where), in the debugger, running
    rank N           talk to rank N's prompt from now on
    cast 0,2 CMD     send CMD to ranks 0 and 2 (``cast all CMD``: every rank at a prompt)
"""

from __future__ import annotations

import builtins
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence

from .runtime.internal import debugger as records

__all__ = ["Debuggers"]

# After sending a line, how long to wait for the rank's next prompt before going back to the
# cell's loop (which shows the rank's output, checks health and asks again at its next tick):
# `p x` answers in milliseconds, `c` never does.
_ANSWER_WAIT = 0.3
_ANSWER_NAP = 0.005

_RANK = re.compile(r"rank\s+(\d+)$")
_CAST = re.compile(r"cast\s+(all|\d+(?:\s*,\s*\d+)*)\s+(.+)$")

HELP = ("`ranks` lists them, `rank N` switches, `cast 0,1 CMD` or `cast all CMD` sends a command "
        "to several")


def _input(prompt: str) -> str:
    return builtins.input(prompt)  # looked up at each call: ipykernel replaces it during a cell


class Debuggers:
    """The prompts of the cell's ranks (``ranks``), served through ``ask`` and ``show``.

    ``directory`` is the cluster's where folder. ``ask`` defaults to the kernel's ``input()``,
    ``show`` to writing on the kernel's stdout (the cell's output, below the rank tabs);
    ``before_ask(rank, seq)`` runs before each question to ``rank`` at its prompt ``seq`` (the
    cell shows what the ranks printed before they stopped).
    """

    def __init__(self, directory: str, ranks: Sequence[int],
                 ask: Callable[[str], str] | None = None,
                 show: Callable[[str], None] | None = None,
                 before_ask: Callable[[int, int], None] | None = None) -> None:
        self.directory = directory
        self.ranks = list(ranks)
        self.ask = ask or _input
        self.show = show or _write
        self.before_ask = before_ask
        self.current: int | None = None
        self.answered: dict[int, int] = {}  # rank -> the seq of the last prompt answered
        self.shown: dict[int, int] = {}     # rank -> the seq of the last prompt whose text was shown
        self.announced: tuple[int, ...] = ()
        self.can_ask = True

    # ------------------------------------------------------------------ the cell's lifetime
    def listen(self) -> None:
        """Tell the ranks a cell is there to answer (before the cell's requests leave)."""
        try:
            records.write_record(records.listening_path(self.directory), {"pid": os.getpid()})
        except OSError:  # no folder (a cluster from before this existed): breakpoints are skipped
            pass

    def close(self) -> None:
        records.remove(records.listening_path(self.directory))

    # ------------------------------------------------------------------ what the ranks say
    def waiting(self) -> dict[int, records.Prompt]:
        """The cell's ranks at a prompt not answered yet (one listing of the folder)."""
        out = {}
        for rank, prompt in records.waiting_prompts(self.directory).items():
            if rank in self.ranks and prompt["seq"] > self.answered.get(rank, 0):
                out[rank] = prompt
        return out

    def held(self) -> list[int]:
        """The cell's ranks in a debugger now (at its prompt, or running a command typed there)."""
        return [r for r in records.held_ranks(self.directory) if r in self.ranks]

    # ------------------------------------------------------------------ the conversation
    def attend(self) -> float:
        """Serve the ranks' prompts until none waits; the seconds spent (0.0: nobody waited)."""
        waiting = self.waiting()
        if not waiting:
            return 0.0
        started = time.monotonic()
        while waiting:
            if not self.can_ask:
                self._continue_all(waiting)
            else:
                rank = self.current if self.current in waiting else min(waiting)
                if self.before_ask is not None:
                    self.before_ask(rank, waiting[rank]["seq"])
                self._announce(rank, waiting)
                self.current = rank
                self._show_prompt_text(rank, waiting[rank])
                try:
                    line = self.ask(self._label(rank, waiting))
                except EOFError:  # Ctrl-D in a terminal: pdb's own meaning, quit
                    line = "EOF"
                except NotImplementedError:  # StdinNotImplementedError: the front end takes no input
                    self.can_ask = False
                    self.show("(this front end does not answer input requests: the ranks at a "
                              "breakpoint go on, as `c` would)\n")
                    continue
                self._handle(line, waiting)
            waiting = self.waiting()
        return time.monotonic() - started

    def _label(self, rank: int, waiting: dict[int, records.Prompt]) -> str:
        if len(waiting) == 1:
            return f"(Pdb rank {rank}) "
        return f"(Pdb rank {rank}; stopped: {','.join(map(str, sorted(waiting)))}) "

    def _announce(self, rank: int, waiting: dict[int, records.Prompt]) -> None:
        """Say which ranks are stopped and where, when that changes."""
        stopped = tuple(sorted(waiting))
        if stopped == self.announced and rank == self.current:
            return
        self.announced = stopped
        if len(stopped) == 1:
            self.show(f"rank {rank} stopped in the debugger at {waiting[rank]['where']}\n")
        else:
            where = "; ".join(f"{r} at {waiting[r]['where']}" for r in stopped)
            self.show(f"ranks stopped in the debugger: {where}. Talking to rank {rank}: {HELP}.\n")

    def _show_prompt_text(self, rank: int, prompt: records.Prompt) -> None:
        if self.shown.get(rank) != prompt["seq"]:
            self.shown[rank] = prompt["seq"]
            if prompt["text"]:
                self.show(_ended(prompt["text"]))

    def _handle(self, line: str, waiting: dict[int, records.Prompt]) -> None:
        command = line.strip()
        if command == "ranks":
            self.show(self._listing(waiting))
            return
        switch = _RANK.match(command)
        if switch:
            self._switch(int(switch.group(1)), waiting)
            return
        cast = _CAST.match(command)
        if cast:
            self._cast(cast.group(1), cast.group(2), waiting)
            return
        if self.current in waiting:  # always: attend asked for it
            self._send({self.current: line}, waiting)

    def _listing(self, waiting: dict[int, records.Prompt]) -> str:
        held = set(self.held())
        lines = []
        for rank in self.ranks:
            if rank in waiting:
                state = f"at the prompt, {waiting[rank]['where']}"
            elif rank in held:
                state = "in the debugger, running a command"
            else:
                state = "running"
            mark = "  <- this prompt" if rank == self.current else ""
            lines.append(f"  rank {rank}: {state}{mark}\n")
        return "".join(lines)

    def _switch(self, rank: int, waiting: dict[int, records.Prompt]) -> None:
        if rank in waiting:
            self.current = rank
            self.shown.pop(rank, None)  # show where it stands again
            return
        if rank in self.ranks:
            state = "in the debugger, running a command" if rank in self.held() else "running"
            self.show(f"rank {rank} is not at a debugger prompt ({state})\n")
        else:
            self.show(f"no rank {rank} in this cell (ranks {_spans(self.ranks)})\n")

    def _cast(self, spec: str, command: str, waiting: dict[int, records.Prompt]) -> None:
        targets = sorted(waiting) if spec == "all" else _parse_ranks(spec)
        absent = [r for r in targets if r not in waiting]
        if absent:
            self.show(f"(not at a prompt, skipped: rank(s) {_spans(absent)})\n")
        self._send({r: command for r in targets if r in waiting}, waiting, labelled=True)

    def _send(self, lines: dict[int, str], waiting: dict[int, records.Prompt],
              labelled: bool = False) -> None:
        """Answer each rank's prompt; wait briefly for their next prompts. ``labelled`` (a cast):
        show what each said under its rank's label, here; else the next prompt shows it."""
        for rank, line in lines.items():
            seq = waiting[rank]["seq"]
            records.write_record(records.reply_path(self.directory, rank),
                                 records.Reply(seq=seq, line=line))
            self.answered[rank] = seq
        if not lines:
            return
        deadline = time.monotonic() + _ANSWER_WAIT
        pending = set(lines)
        while pending and time.monotonic() < deadline:
            time.sleep(_ANSWER_NAP)
            now = self.waiting()
            for rank in sorted(pending & set(now)):
                pending.discard(rank)
                prompt = now[rank]
                if labelled:
                    self.shown[rank] = prompt["seq"]
                    self.show(f"[rank {rank}]\n" + _ended(prompt["text"]) if prompt["text"] else
                              f"[rank {rank}] (nothing printed)\n")
            if not pending:
                return

    def _continue_all(self, waiting: dict[int, records.Prompt]) -> None:
        self._send({rank: "c" for rank in waiting}, waiting, labelled=True)


def _ended(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _parse_ranks(spec: str) -> list[int]:
    return sorted({int(part) for part in spec.split(",") if part.strip()})


def _spans(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, ranks))

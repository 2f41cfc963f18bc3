"""``breakpoint()`` and ``pdb.set_trace()`` on a rank: a pdb whose terminal is the notebook.

An engine's stdin is closed (pdb would read EOF and go on), so ``install`` (``%ring start``'s
setup) puts :meth:`RankDebugger.breakpointhook` in ``sys.breakpointhook`` (and its ``set_trace``
in ``pdb.set_trace``). It stops
the rank in a :class:`RankPdb`, a ``pdb.Pdb`` whose stdin and stdout are a :class:`PromptChannel`:
what pdb prints is kept, and when pdb reads a line the rank writes a ``Prompt`` record (the text,
where it stands) into the cluster's where folder and waits for the kernel's ``Reply``
(``runtime/_observe/debugger.py`` has the records; ``jupyter_ring/_debug.py`` is the kernel's end, which
asks the user with the kernel's own ``input()``).

While pdb has the rank (its prompt up, or a command typed there running) the rank is marked held
(``hold``): peers waiting in a collective for it do not stall. An interrupt at the prompt quits
the debugger and raises ``KeyboardInterrupt`` in the cell, as on every other rank.
"""

from __future__ import annotations

import os
import pdb
import sys
import time
from types import FrameType, TracebackType
from typing import IO, cast

from ..runtime.internal import debugger as records
from ..runtime.internal import hold

__all__ = ["PromptChannel", "RankPdb", "RankDebugger", "install"]

# Seconds between two looks for the kernel's reply while the prompt is up: a person types; the
# rank is stopped anyway, and 50 looks a second cost it well under 1 % of a core.
_REPLY_NAP = 0.02


class RankDebugger:
    """This rank's end of the notebook's debugger: where its records go, and their numbering."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory = directory
        self.rank = rank
        self.seq = 0  # for the whole process: a reply never answers a prompt of an earlier stop

    def clear(self) -> None:
        """Remove this rank's prompt and reply records (left by a process this one replaces)."""
        records.remove(records.prompt_path(self.directory, self.rank))
        records.remove(records.reply_path(self.directory, self.rank))

    def listened(self) -> bool:
        """Whether a notebook cell is there to answer a prompt."""
        return os.path.exists(records.listening_path(self.directory))

    def stop(self, frame: FrameType | None, header: str | None = None) -> None:
        """Stop in ``frame`` (the caller of ``breakpoint()``) with the notebook as terminal."""
        if not self.listened():
            print(f"(breakpoint() on rank {self.rank} skipped: no %%distributed cell of the notebook "
                  "is there to show its prompt)", file=sys.stderr)
            return
        debugger = RankPdb(self)
        if header is not None:
            debugger.message(header)
        debugger.set_trace(frame)

    def breakpointhook(self, *args: object, **kwargs: object) -> None:
        """``sys.breakpointhook`` on this rank: stop in the notebook's debugger.

        ``PYTHONBREAKPOINT`` is honoured as by Python's own hook: ``0`` skips, another debugger's
        ``set_trace`` is called instead."""
        setting = os.environ.get("PYTHONBREAKPOINT", "")
        if setting == "0":
            return
        if setting not in ("", "pdb.set_trace"):
            sys.__breakpointhook__(*args, **kwargs)
            return
        header = kwargs.get("header")
        self.stop(sys._getframe(1), header if isinstance(header, str) else None)

    def set_trace(self, *, header: str | None = None) -> None:
        """``pdb.set_trace()`` on this rank: the same stop as ``breakpoint()``."""
        self.stop(sys._getframe(1), header)

    def ask(self, text: str, where: str) -> str:
        """Publish ``text`` and the prompt, then wait for the kernel's line (interruptible)."""
        self.seq += 1
        seq = self.seq
        prompt = records.prompt_path(self.directory, self.rank)
        reply = records.reply_path(self.directory, self.rank)
        _mark_output(seq)
        records.write_record(prompt, records.Prompt(seq=seq, pid=os.getpid(), text=text, where=where))
        try:
            while True:
                record = records.read_record(reply)
                if record is not None and record.get("seq") == seq:
                    records.remove(reply)
                    return str(record.get("line") or "")
                time.sleep(_REPLY_NAP)  # SIGINT raises KeyboardInterrupt here
        finally:
            records.remove(prompt)


class PromptChannel:
    """pdb's stdin and stdout: output is kept until pdb reads a line, which goes to the notebook."""

    def __init__(self, debugger: RankDebugger, prompt: str) -> None:
        self.debugger = debugger
        self.prompt = prompt
        self.pdb: RankPdb | None = None
        self._out: list[str] = []

    def write(self, text: str) -> int:
        self._out.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        text = "".join(self._out)
        self._out.clear()
        # pdb writes its prompt just before reading: the kernel shows its own, with the rank
        text = text[:-len(self.prompt)] if text.endswith(self.prompt) else text
        _flush_output()  # what a stepped line printed goes out before the prompt
        return self.debugger.ask(text, self.where()) + "\n"

    def where(self) -> str:
        frame = self.pdb.curframe if self.pdb is not None else None
        return _where(frame) if frame is not None else "?"

    def drain(self) -> None:
        """What pdb printed after the last line it read (``c`` prints nothing, a ``--Return--``
        might): to the cell's stdout, where the rank's output goes on."""
        text = "".join(self._out)
        self._out.clear()
        if text:
            sys.stdout.write(text)


class RankPdb(pdb.Pdb):
    """pdb with the notebook as terminal, the rank in its prompt, interrupts that end it."""

    def __init__(self, debugger: RankDebugger) -> None:
        self.channel = PromptChannel(debugger, f"(Pdb rank {debugger.rank}) ")
        # nosigint: pdb's own SIGINT handler (installed by `c`) would turn the notebook's
        # interrupt into a stop at the next line instead of ending the cell
        # (pdb uses only write, flush and readline of them: the channel is file-like enough)
        stream = cast("IO[str]", self.channel)
        super().__init__(stdin=stream, stdout=stream, nosigint=True)
        self.channel.pdb = self
        self.prompt = self.channel.prompt

    def interaction(self, frame: FrameType | None, traceback: TracebackType | None) -> None:
        shown = frame if frame is not None else (traceback.tb_frame if traceback else None)
        hold.enter(_where(shown) if shown is not None else "?")
        try:
            super().interaction(frame, traceback)
        finally:
            hold.leave()
            self.channel.drain()

    def _cmdloop(self) -> None:
        # pdb's own loop turns KeyboardInterrupt into "--KeyboardInterrupt--" and asks again: the
        # notebook's interrupt must instead end the cell on this rank as on the others
        try:
            self.cmdloop()
        except KeyboardInterrupt:
            self.set_quit()  # no more tracing: the exception goes up through the user's frames
            raise


def _where(frame: FrameType) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _mark_output(seq: int) -> None:
    """Publish the prompt's mark behind what the rank printed (``runtime/_debugger.MARK``): the
    kernel asks once it came, so the rank's last lines are shown above the prompt."""
    try:
        from IPython.display import publish_display_data

        publish_display_data({records.MARK: {"seq": seq}})  # flushes stdout and stderr first
    except Exception:  # no IPython display here (a plain process): the kernel waits a little
        pass


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or odd stream must not keep the debugger from starting
            pass


def install(directory: str, rank: int) -> None:
    """Make ``breakpoint()`` and ``pdb.set_trace()`` on this rank open a prompt in the notebook."""
    hold.arm(directory, rank)
    debugger = RankDebugger(directory, rank)
    debugger.clear()
    sys.breakpointhook = debugger.breakpointhook
    pdb.set_trace = debugger.set_trace

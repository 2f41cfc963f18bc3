"""The engine's background thread: it runs queued rounds while the caller computes.

Woken by the first entry queued, it waits ``cycle_ms`` for more entries to fuse (or less:
``flush()``, or when ``fusion_threshold`` bytes are queued), then runs rounds. After ``_IDLE``
seconds without work it blocks until the next ``submit`` rings.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .progress import Engine

__all__ = ["Background"]

_IDLE = 0.2  # seconds without work after which the background thread sleeps until a doorbell
_NAP = 20e-6  # seconds the background thread sleeps between polls while the caller computes


def _low_timer_slack() -> None:
    """Let this thread's short sleeps be short (Linux rounds them up by 50 µs by default)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns: this thread only
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


class Background:
    """The background thread of one engine, started by its first ``submit``, and its doorbell
    (``wake``: ``submit`` rings it for the first entry while the thread sleeps, or for a full
    fusion buffer)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.wake = threading.Event()          # the doorbell
        self.thread: threading.Thread | None = None
        self.flush_now = False
        self.sleeping = True                   # the thread waits for a doorbell

    def start(self) -> None:
        """Start the thread (the engine's first ``submit`` does)."""
        self.thread = threading.Thread(target=self._loop, name="jupyter_ring-engine", daemon=True)
        self.thread.start()

    def flush(self) -> None:
        """Run what is queued now, without waiting for more."""
        self.flush_now = True
        self.wake.set()

    def stop(self) -> None:
        """Stop the thread (the engine is closed), giving up the round it runs."""
        self.wake.set()
        thread = self.thread
        rt = self.engine.rt
        if thread is not None and thread is not threading.current_thread():
            rt.abort = "the runtime is shutting down"
            thread.join(10.0)
            rt.abort = None
        self.thread = None

    def _loop(self) -> None:
        """Every cycle while there is work, run what has waited a cycle; sleep when idle.

        An entry runs here once it is ``cycle_ms`` old (a caller that synchronizes at once runs it
        itself, without a hand-off), or at once after ``flush()`` or a full fusion buffer. After
        ``_IDLE`` seconds without work the thread blocks until the next ``submit`` rings.
        """
        _low_timer_slack()
        engine = self.engine
        queue = engine.queue
        config = engine.config
        wake = self.wake
        idle_since = time.perf_counter()
        while not engine.closed:
            if self.sleeping:
                wake.wait()
            else:  # at most _IDLE: a cycle_ms changed meanwhile takes effect by then
                wake.wait(min(config.cycle_ms / 1000.0, _IDLE))
            wake.clear()
            self.sleeping = False
            if engine.closed:
                break
            cycle = config.cycle_ms / 1000.0  # read after the wait: the value set now counts
            now = time.perf_counter()
            if not queue.entries:
                if now - idle_since > _IDLE:
                    self.sleeping = True
                    if queue.entries:  # queued before it could see sleeping: do not block
                        self.sleeping = False
                continue
            idle_since = now
            if not (self.flush_now or now - queue.since >= cycle
                    or queue.backlog() >= config.fusion_threshold):
                continue
            self.flush_now = False
            self._run_rounds()

    def _run_rounds(self) -> None:
        """Run rounds while entries are queued, unless a caller holds the executor lock (it runs
        them itself)."""
        engine = self.engine
        if not engine.lock.take():
            return
        engine.rt.waits.nap = 0.0 if engine.waiting else _NAP
        try:
            while engine.queue.entries and not engine.closed:
                try:
                    engine.rounds.run()
                except BaseException:  # noqa: BLE001 - recorded in the results by Rounds.run
                    pass
        finally:
            engine.lock.give_back()

"""One ``%%distributed`` execution: submit, show output as it arrives, watch for failures,
interrupt, report.

The output path: each rank's iopub messages reach :class:`jupyter_ring._ipp.CellExecution` on
ipyparallel's IO thread, which wakes this thread at once; stream text is cut into whole lines
(each rank's and stream's last partial line held back until its newline or the end) and handed
to the sink (rank tabs or tagged text), rich outputs as they come, results at the end. Between
arrivals the loop wakes every ``_TICK`` seconds for what is due by the clock: the health check,
peer interrupts, ``--timeout``, the live views' redraws.
"""

import argparse
import re
import signal
import sys
import time
import contextlib
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from . import _live
from ._debug import Debuggers
from ._ipp import REPLY_GRACE, CellExecution
from .runtime.internal import MARK
from .errors import (CellInterrupted, ClusterError, DeadRankError, DistributedError, _ename, _first_line,
                     trim_traceback, where_stopped)

if TYPE_CHECKING:  # the front end's modules import this one
    from .cluster import RingCluster
    from .engines._interrupts import CellId
    from .magics import RingMagics
    from .widgets._tabs import RankTabs, TextSink
    from .widgets.live import LiveDashboard

__all__ = ["CellRun", "routes_to_ranks"]

# Errors on other ranks that are usually consequences of the first failure, never the headline.
_SECONDARY = {"KeyboardInterrupt", "StallError", "EngineError"}

# Seconds between the loop's wake-ups when nothing arrives: output wakes it at once; this is for
# redraws that were throttled (rank tabs every 0.1 s) and for the clock's deadlines.
_TICK = 0.1

# Before a rank's debugger prompt is asked, the seconds its output may take to come (it is
# waited for only until the prompt's mark comes behind it: milliseconds).
_SETTLE_MAX = 1.0

# Seconds an interrupted rank may keep running before the cell shows where every rank is.
_WHERE_AFTER = 1.0

# Seconds between two looks for a reopened notebook's request for the cell's live view (_live).
_ATTACH_EVERY = 0.25

# StallError's message names the ranks that never arrived: "... waited 2.0 s for rank(s) [1, 3]"
_STALL_RANKS = re.compile(r"for rank\(s\) \[([0-9, ]*)\]")

# Line magics that keep an auto-mode cell in the notebook kernel when they open it.
_LOCAL_LINE_MAGICS = ("ring", "load_ext", "reload_ext", "unload_ext")

# A carriage return not followed by a newline rewrites the line (progress bars): keep what comes
# after the last one, as a terminal (and ipyparallel's own output buffer) does.
_CR = re.compile(r".*\r(?=[^\n])")


class CellRun:
    """One cell on ``ranks`` of ``cluster``, shown through ``sink`` (see ``widgets._tabs``)."""

    def __init__(self, magics: "RingMagics", cluster: "RingCluster", ranks: list[int], cell: str,
                 args: argparse.Namespace, sink: "RankTabs | TextSink") -> None:
        self.magics = magics
        self.cluster = cluster
        self.ranks = ranks
        self.cell = cell
        self.timeout = args.timeout
        self.only_rank = ranks[0] if args.rank0_output else None
        self.sink = sink
        # the dashboard is made only when a rank has published a snapshot: trivial cells stay light
        self.want_dashboard = magics.held.dashboard_ready and not args.no_dashboard
        self.dashboard: "LiveDashboard | None" = None
        # the CellExecution once the cell's requests are sent (run() checks; the rest runs after)
        self.execution: CellExecution = None  # type: ignore[assignment]
        self._steps_noted = -float("inf")
        self.partial: dict[tuple[int, str], str] = {}  # (rank, stream) -> text after the last newline, not shown yet
        self.results: dict[int, dict[str, Any]] = {}   # rank -> execute_result content (shown after the output)
        self.interrupted: dict[int, str] = {}          # rank -> why it was interrupted
        self.interrupted_at: dict[int, float] = {}     # rank -> time.monotonic() of its interrupt
        self.where_shown = False  # the ranks' stacks are shown once per cell, unasked
        self.cell_id: "CellId | None" = None  # the id the cell's requests carry, which its interrupts name
        self.answers: dict[int, Any] = {}  # rank -> the future of its answer to the cell's interrupt
        self.waiting_noted: set[int] = set()  # ranks named as not begun yet (once each)
        self.lost_noted = False   # ranks that went idle without a reply are named once
        self.interrupts = _DeferredInterrupt()  # SIGINT while the cell runs: see the class
        self.debuggers: Debuggers | None = None  # the ranks' breakpoint() prompts, asked here
        self._next_attach_look = 0.0  # when to look for a request for the live view again
        self.marks: dict[int, int] = {}  # rank -> seq of the last debugger prompt mark that came

    def run(self) -> None:
        stopping = None
        try:
            self._run()
        except BaseException as exc:
            # The kernel is going away (restart, shutdown): its children, the cluster, are being
            # terminated under the cell, which fails for that reason alone.
            stopping = kernel_stopping(self.magics.shell)
            if stopping is None:
                # a torch.distributed group aborted on some rank (it was blocked in a collective
                # when interrupted or stalled; the rank said so on stderr) is re-created on every
                # rank before the next cell
                if not isinstance(exc, DeadRankError) and self._torch_aborted():
                    note = self.cluster.repair_torch(self.magics.interrupt_grace)
                    if note:
                        print(note, file=sys.stderr)
                raise
        finally:
            # also on error and interrupt: the dashboard and the tabs become static
            if self.dashboard is None and self.execution is not None and self.magics.held.dashboard_ready:
                # snapshots that reported no work would pile up in the client's metadata
                from .widgets import live

                live.discard_snapshots(self.execution.ar)
            if self.dashboard is not None:
                try:
                    self.dashboard.finish(self.execution and self.execution.ar, self._outcomes())
                    self._note_steps()
                except Exception as exc:  # never hide the cell's own outcome
                    print(f"(the dashboard could not finish: {exc})", file=sys.stderr)
            self.sink.finish()
        stopping = stopping or kernel_stopping(self.magics.shell)
        if stopping is not None:
            print(f"(cut off: the kernel is {stopping}; the ranks of this cell stopped with "
                  "it, and their variables are gone)", file=sys.stderr)
            _await_the_end()

    def _torch_aborted(self):
        from .engines._torch import ABORT_NOTE

        return self.execution is not None and any(
            ABORT_NOTE in text for text in self.execution.stderr())

    def _run(self) -> None:
        cluster = self.cluster
        note = cluster.torch_repair_note()  # the previous cell's, if it came late
        if note:
            print(f"(after the previous cell) {note}", file=sys.stderr)
        debuggers = self.debuggers = Debuggers(cluster.where_dir, self.ranks,
                                               before_ask=self._show_output)
        debuggers.listen()  # before the requests leave: a breakpoint() on a rank gets a prompt
        where = cluster.where_dir
        _live.note_running_cell(where, _parent_request(self.magics.shell),
                                self.magics.cells.cell_number())
        try:
            with _DeferredInterrupt() as self.interrupts:
                self._run_cell(cluster, debuggers)
        finally:
            _live.clear_running_cell(where)
            debuggers.close()

    def _run_cell(self, cluster: "RingCluster", debuggers: Debuggers) -> None:
        # An interrupt while the requests go out is the cell's (self.interrupts notes it): raised
        # in the try below, where the ranks that got theirs are interrupted too (raised here, it
        # left them running the whole cell)
        from .engines._interrupts import METADATA

        cell_id = self.cell_id = cluster.new_cell()
        execution = self.execution = CellExecution(
            cluster.client, [cluster.engine_ids[r] for r in self.ranks], self.ranks, self.cell,
            metadata={METADATA: cell_id.wire()})
        magics = self.magics
        t0 = time.monotonic()
        first_failure = None
        next_health_check = t0 + magics.health_interval
        try:
            self.interrupts.raise_pending()
            while not execution.done():
                execution.wait(min(_TICK, max(0.0, next_health_check - time.monotonic())))
                self.interrupts.raise_pending()
                if execution.done():
                    break  # every rank replied: what is left is the output's end, below
                if kernel_stopping(magics.shell) is not None:
                    return  # run() ends the output, says so and waits for the end
                self._deliver()
                now = time.monotonic()
                if now >= next_health_check or self._engine_failed():
                    next_health_check = now + magics.health_interval
                    if self._check_dead():  # replaced under elastic.run: the cell goes on
                        first_failure = None
                for rank in self.ranks:
                    if execution.error(rank) is not None:
                        if first_failure is None:
                            first_failure = now
                        self.sink.fail(rank)  # live: the tab is marked and selected at once
                self.sink.flush()
                self._poll_dashboard()
                self._serve_attach(now)
                if debuggers.waiting():
                    # a rank at a breakpoint: the prompt is the user's; the time spent there does
                    # not count towards --timeout
                    with self.interrupts.immediate():  # the kernel's input() ends on an interrupt
                        t0 += debuggers.attend()
                    now = time.monotonic()
                pending = execution.pending()
                if (first_failure is not None and magics.interrupt_peers and pending
                        and now - first_failure >= magics.peer_interrupt_delay):
                    # a rank held in a debugger is left to the user (its next step may be `c`)
                    held = debuggers.held()
                    self._interrupt([r for r in pending if r not in held], "a peer rank failed")
                if self.timeout is not None and now - t0 > self.timeout and pending:
                    self._interrupt(pending, f"--timeout {self.timeout:g} s")
                self._note_waiting()
                self._where_if_stuck(pending, now)
        except KeyboardInterrupt:
            unstopped = self._interrupt_all()
            errors = {r: execution.error(r) for r in self.ranks if r not in unstopped}
            self._show_interrupted(errors)
            raise CellInterrupted("you", errors, unstopped) from None
        self._note_lost()
        self._wait_for_output()
        self._deliver(final=True)
        self._poll_dashboard()  # a cell that ended before the first poll still gets its dashboard
        self._show_results()
        self._raise_errors()

    def _show_output(self, rank: int, seq: int) -> None:
        """Show the ranks' output before ``rank``'s debugger prompt ``seq``, at once (the kernel
        shows nothing more while the prompt waits): what the rank printed before it stopped is
        there once the prompt's mark (``runtime/_debugger.MARK``) has come behind it; the output
        travels through the controller while the prompt is a file. At most ``_SETTLE_MAX`` s."""
        deadline = time.monotonic() + _SETTLE_MAX
        self._deliver()
        while self.marks.get(rank, 0) < seq and time.monotonic() < deadline:
            self.execution.wait(0.01)
            self._deliver()
        self.sink.flush(force=True)

    def _wait_for_output(self):
        """Wait for the ranks' last output (their IOPub idle), showing it as it comes.

        The replies can arrive well before the output (10,000 printed lines take seconds to
        travel): wait as long as output keeps arriving, and give up only after
        ``output_grace`` seconds without any, saying that the output may be cut short.
        """
        execution, grace = self.execution, self.magics.output_grace
        started = time.monotonic()
        while not execution.output_done():
            execution.wait(min(_TICK, grace))
            self.interrupts.raise_pending()
            self._deliver()
            self.sink.flush()
            if time.monotonic() - max(started, execution.last_arrival) >= grace:
                late = [str(r) for r in self.ranks if not execution.output_done(r)]
                print(f"(no end of output from rank(s) {', '.join(late) or '?'} {grace:g} s after "
                      "the cell finished; what they printed last may be missing)", file=sys.stderr)
                return

    def _engine_failed(self) -> bool:
        """Whether the controller failed a rank's request because its engine went away: the
        death is checked at once, before the peers are interrupted for that failure."""
        errors = (self.execution.error(r) for r in self.ranks)
        return any(e is not None and _ename(e) == "EngineError" for e in errors)

    def _check_dead(self) -> bool:
        """A rank that died mid-cell never replies: report it now instead of waiting forever.
        True when it was replaced and the cell goes on (``elastic.run``, :meth:`_go_on_elastic`)."""
        dead = self.cluster.dead_ranks()
        if not dead:
            return False
        if self._go_on_elastic(dead):
            return True
        self.execution.ar.wait(0.2)  # let ipyparallel deliver what it has
        self._deliver(final=True)
        self._raise_dead(dead)
        return False  # (not reached: _raise_dead raises)

    def _go_on_elastic(self, dead: list[int]) -> bool:
        """A rank died while every other rank runs ``elastic.run`` in this cell: replace it in
        place and let the cell go on (issue 34, item 2). The survivors give their step up, go
        back to their last commit and re-form the world from inside ``run``; the new rank runs
        this cell from its start, and its ``run`` takes the state from them. False where it
        does not apply (the cell fails with DeadRankError, as without elastic code)."""
        cluster, magics = self.cluster, self.magics
        if (sorted(self.ranks) != list(range(cluster.size)) or not cluster.can_respawn(dead)
                or not cluster.elastic_survivors(dead)):
            return False
        from .cluster import elastic_note

        head = cluster.describe_death(dead, fix="").rstrip()
        try:
            done = cluster.respawn(dead, elastic=True)
        except ClusterError as exc:
            raise DeadRankError(f"{head} Replacing it in place failed: {exc}", dead) from None
        magics.held.new_rank_dashboard(cluster, done.ranks)
        for rank in done.ranks:
            self.execution.resubmit(rank, cluster.engine_ids[rank])
            self.interrupted.pop(rank, None)
        print(f"{head} {elastic_note(done, cluster.restarts, cluster.max_restarts)}", file=sys.stderr)
        return True

    def _raise_dead(self, dead):
        """Mark the dead ranks' tabs, then raise the DeadRankError that names them."""
        # MPI ends the job's other ranks: name every rank lost ("MPI then ended rank(s) 0")
        dead = self.cluster.dead_ranks_settled(dead)
        # replaced in place (the survivors keep their variables) unless --max-restarts says no
        message = self.magics.held.replace_dead(self.cluster, dead)
        for rank in dead:
            if rank in self.ranks:
                self.sink.error(rank, DeadRankError(message, dead))
                self.sink.fail(rank, "✗ dead")
        raise DeadRankError(message, dead)

    def _interrupt(self, ranks: list[int], why: str) -> None:
        todo = [r for r in ranks if r not in self.interrupted]
        if not todo:
            return
        now = time.monotonic()
        for r in todo:
            self.interrupted[r] = why
            self.interrupted_at[r] = now
        self._signal(todo)

    def _signal(self, ranks: list[int]) -> None:
        """Interrupt this cell on ``ranks``: each rank stops it if it runs, or as it begins, and
        never the cell after it (``engines/_interrupts``; ``RingCluster.interrupt_cell``).

        Not a bare SIGINT: an engine ignores SIGINT between requests, and one still busy with an
        earlier request (a completion, a pull, or only slow to start on a loaded host) took it
        there. Signalled again once it began, a rank that had already ended the cell took that
        second signal in the next cell (a CI rehearsal across two hosts saw it).
        """
        if self.cell_id is not None:  # None: no request has left yet
            self.answers.update(self.cluster.interrupt_cell(self.cell_id, ranks))

    def _note_waiting(self) -> None:
        """Name, once, the interrupted ranks that had not begun the cell yet: they stop as they
        begin it, once the earlier request that holds them ends."""
        pending = set(self.execution.pending())
        waiting = []
        for rank, answer in self.answers.items():
            if rank in self.waiting_noted or rank not in pending or not answer.done():
                continue
            try:
                state = answer.result()["content"].get("state")
            except Exception:  # the client closed under the cell: its own error says so
                continue
            if state == "waiting":
                self.waiting_noted.add(rank)
                waiting.append(rank)
        if waiting:
            print(f"(rank(s) {_join(waiting)} had not begun the cell when interrupted (busy with "
                  "an earlier request, or slow to start): they stop as they begin it, running "
                  "none of its code)", file=sys.stderr)

    def _where_if_stuck(self, pending: list[int], now: float) -> None:
        """Show where the ranks are, once, when a collective stalled (the missing ranks first)
        or an interrupted rank still runs a second later: which line each one is on. A rank
        whose engine went idle is not running, only its reply is late (see ``_note_lost``)."""
        if self.where_shown or not pending:
            return
        missing = []
        for rank in self.ranks:
            error = self.execution.error(rank)
            if error is not None and _ename(error) == "StallError":
                missing += [r for r in _stall_ranks(error) if r not in missing]
        running = self.execution.running()
        late = [r for r in pending
                if r in running and now - self.interrupted_at.get(r, now) >= _WHERE_AFTER]
        if missing:
            why = (f"a collective stalled waiting for rank(s) {_join(missing)}; where the ranks "
                   "are (innermost frame first):")
        elif late:
            why = (f"rank(s) {_join(late)} still running {_WHERE_AFTER:g} s after the interrupt; "
                   "where the ranks are (innermost frame first):")
        else:
            return
        self._show_where(missing or late, why)

    def _show_where(self, first, why):
        self.where_shown = True
        from .cluster import format_where

        order = list(first) + [r for r in self.ranks if r not in first]
        try:
            text = format_where(self.cluster.where(order, timeout=2.0))
        except Exception as exc:  # never hide the cell's own outcome
            text = f"(the ranks' stacks could not be read: {type(exc).__name__}: {exc})"
        print(f"{why}\n{text}", file=sys.stderr)

    def _interrupt_all(self) -> list[int]:
        """Ctrl-C in the notebook: interrupt the cell on every rank, give them a moment, show what
        they said.
        The ranks that did not stop, in a list: a rank that went idle without a reply stopped."""
        execution = self.execution
        self._signal(list(range(self.cluster.size)))
        grace = self.magics.interrupt_grace
        finished = self._await_ranks(min(_WHERE_AFTER, grace))
        if not finished:
            late = execution.running()
            if late and not self.where_shown:
                self._show_where(late, f"rank(s) {_join(late)} still running {_WHERE_AFTER:g} s "
                                       "after the interrupt; where the ranks are (innermost frame "
                                       "first):")
            finished = self._await_ranks(max(0.0, grace - _WHERE_AFTER))
            if not finished and not execution.running():
                # every rank left went idle: its reply is late or lost (lost REPLY_GRACE s later)
                finished = self._await_ranks(REPLY_GRACE)
        try:
            execution.ar.wait_for_output(1.0)
        except Exception:
            pass
        self._deliver(final=True)
        self._note_lost()
        pending = [] if finished else execution.pending()  # some may have just stopped
        if pending:
            print(f"rank(s) {', '.join(map(str, pending))} did not stop within "
                  f"{self.magics.interrupt_grace:g} s of SIGINT; they may be stuck outside Python. "
                  "%ring status shows them; %ring restart replaces the cluster.", file=sys.stderr)
        return pending

    def _await_ranks(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for every rank's reply, naming those that had not begun the
        cell; True if all came."""
        deadline = time.monotonic() + seconds
        while not self.execution.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.execution.wait(min(_TICK, left))
            self._note_waiting()
        return True

    def _note_lost(self) -> None:
        """Name, once, the ranks whose cell ended without a reply (their engine went idle)."""
        lost = self.execution.lost()
        if lost and not self.lost_noted:
            self.lost_noted = True
            print(f"(rank(s) {_join(lost)} finished the cell but never sent its reply, which an "
                  "interrupt outside the cell's code can cost an engine; what they raised, if "
                  "anything, is read from their output. The ranks are fine.)", file=sys.stderr)

    # ----------------------------------------------------------------------------- output
    def _deliver(self, final=False):
        """Hand what arrived to the sink; ``final``: the partial last lines too."""
        for rank, kind, content in self.execution.take():
            if kind == "stream":
                if self.only_rank is None or rank == self.only_rank:
                    self._stream_text(rank, content["name"], content["text"])
            elif kind == "display_data":
                mark = (content.get("data") or {}).get(MARK)
                if mark is not None:  # not output: a debugger prompt's mark (_show_output)
                    self.marks[rank] = max(self.marks.get(rank, 0), int(mark.get("seq", 0)))
                    continue
                metadata = dict(content.get("metadata") or {})
                metadata["jupyter_ring_rank"] = rank
                self.sink.display(rank, content.get("data") or {}, metadata)
            elif kind == "execute_result":
                self.results[rank] = content
        if final:
            partial, self.partial = self.partial, {}
            for (rank, name), rest in partial.items():
                if rest:
                    self.sink.text(rank, name, [_CR.sub("", rest)])

    def _stream_text(self, rank, name, text):
        key = (rank, name)
        lines = (self.partial.get(key, "") + text).split("\n")
        # after the last newline: held back until the line is complete (or the cell ends)
        self.partial[key] = lines.pop()
        if lines:
            self.sink.text(rank, name, [_CR.sub("", line) if "\r" in line else line
                                        for line in lines])

    def _show_results(self):
        for rank in self.ranks:
            result = self.results.get(rank)
            if result:
                self.sink.result(rank, result.get("data") or {}, result.get("metadata") or {})

    # -------------------------------------------------------------------------- dashboard
    def _serve_attach(self, now: float) -> None:
        """A notebook reopened while this cell runs asked (the Ring panel's "Show live view",
        through the server: see ``_live``) for the cell's live view: show the dashboard and the
        rank tabs again, as new widgets fed from the same state. The page knows no widget of
        this cell (the kernel announced them to the page that was closed), and puts whatever
        this cell shows from now on into its cell."""
        if now < self._next_attach_look:
            return
        self._next_attach_look = now + _ATTACH_EVERY
        if not _live.take_attach_request(self.cluster.where_dir):
            return
        if self.dashboard is not None:
            self.dashboard.attach()
        self.sink.attach()

    def _poll_dashboard(self):
        ar = self.execution.ar
        if self.dashboard is None:
            if not self.magics.held.dashboard_ready:  # no publisher on the ranks (e.g. a terminal)
                return
            from .widgets import live

            if not self.want_dashboard:
                # --no-dashboard: drop the ranks' snapshots, which would otherwise pile up in
                # the client's metadata for the rest of the session
                live.discard_snapshots(ar)
                return
            # made once a rank reports work (a step, a metric, a stall): a cell that only sets a
            # total, or only runs collectives, gets no widgets at all (copies keys: safe
            # against the IO thread)
            if not live.has_snapshots(ar, work=True):
                return
            self.dashboard = live.LiveDashboard(self.ranks)
        self.dashboard.poll(ar)
        now = time.monotonic()
        if now - self._steps_noted >= 1.0:  # the Ring panel's step column, at most once a second
            self._steps_noted = now
            self._note_steps()

    def _outcomes(self) -> dict[int, str]:
        """How the cell ended on each rank where it did not end well, for the frozen dashboard:
        its row shows that at the rank's last step, never "done" with a full bar."""
        execution = self.execution
        if execution is None:
            return {}
        try:
            dead = set(self.cluster.dead_ranks())
        except Exception:  # the cluster is going away: the ranks' own replies still tell
            dead = set()
        pending = set(execution.pending())
        outcomes = {}
        for rank in self.ranks:
            error = execution.error(rank)
            if rank in dead:
                outcomes[rank] = "died"
            elif rank in pending:
                outcomes[rank] = "no reply"
            elif error is None:
                continue
            elif _ename(error) == "KeyboardInterrupt":
                outcomes[rank] = "interrupted"
            elif _ename(error) == "StallError":
                outcomes[rank] = "stalled"
            elif _ename(error) == "EngineError":
                outcomes[rank] = "died"
            else:
                outcomes[rank] = "failed"
        return outcomes

    def _note_steps(self):
        state = self.dashboard.state
        self.cluster.record_steps({r: {"step": s.step, "total": s.total}
                                   for r, s in state.ranks.items() if s.seen})

    # ----------------------------------------------------------------------------- errors
    def _show_interrupted(self, errors: dict[int, BaseException | None]) -> None:
        """Each interrupted rank's tab says where the rank stopped, and the tab selected is a rank
        that was running its own code (the one the others waited for), not merely the first one
        whose interrupt came back: after an interrupt, "rank 0 ✗" with "(no output)" explained
        nothing while rank 1 sat in time.sleep."""
        places = {r: where_stopped(e) for r, e in sorted(errors.items()) if e is not None}
        for r, place in places.items():
            self.sink.error(r, errors[r], "", lines=[f"KeyboardInterrupt: stopped {place}"])
            self.sink.fail(r)
        explains = [r for r, place in places.items() if place.startswith("at line")]
        if explains or places:
            self.sink.select((explains or list(places))[0])

    def _raise_errors(self):
        execution = self.execution
        failures = [(rank, execution.finished_at(rank), execution.error(rank))
                    for rank in self.ranks if execution.error(rank) is not None]
        if not failures:
            return
        dead = self.cluster.dead_ranks()
        if not dead and any(_ename(e) == "EngineError" for _, _, e in failures):
            # the controller failed the tasks of a dead engine; the client hears of the
            # unregistration a moment later
            deadline = time.monotonic() + 1.0
            while not dead and time.monotonic() < deadline:
                time.sleep(0.05)
                dead = self.cluster.dead_ranks()
        if dead and all(r in dead or _ename(e) in _SECONDARY for r, _, e in failures):
            # a dead engine is the story, not the errors it caused: report it by rank
            self._raise_dead(dead)

        if not dead and not self.interrupted and all(
                _ename(e) == "KeyboardInterrupt" for _, _, e in failures):
            # every failed rank was interrupted, and not by this kernel: the Ring panel's Interrupt
            errors = {r: execution.error(r) for r in self.ranks}
            self._show_interrupted(errors)
            raise CellInterrupted("the Ring panel's Interrupt (a SIGINT from outside the notebook)",
                                  errors)

        def order(item):
            rank, completed, exc = item
            secondary = _ename(exc) in _SECONDARY or rank in self.interrupted or rank in dead
            return (secondary, completed is None, completed or 0, rank)

        failures.sort(key=order)
        host = {row["rank"]: row["host"] for row in self.cluster.ranks}
        rank, _, exc = failures[0]
        others = [(r, host.get(r, "?"), e) for r, _, e in failures[1:]]
        full = self.magics.full_traceback
        headline = DistributedError(rank, host.get(rank, "?"), exc, others, full_traceback=full)
        below = {r for r, _ in headline.same}
        for r, _, e in sorted(failures, key=lambda item: item[0]):
            why = self.interrupted.get(r)
            if r in below:  # one traceback per rank: this one is in the error below the tabs
                lines = [f"{_ename(e)}: {_first_line(getattr(e, 'evalue', e))}",
                         "(the traceback is below the tabs)"]
            else:
                lines = trim_traceback(str(getattr(e, "traceback", "") or ""), full) or None
            self.sink.error(r, e, f"interrupted: {why}" if why else "", lines=lines)
            self.sink.fail(r)
        self.sink.select(rank)  # the headline rank's tab, not merely the first one noticed
        notes = []
        if self.interrupted:
            by_why = {}
            for r, why in sorted(self.interrupted.items()):
                by_why.setdefault(why, []).append(str(r))
            notes += [f"interrupted rank(s) {', '.join(rs)}: {why}" for why, rs in by_why.items()]
        if dead:
            notes.append(self.cluster.describe_death(dead))
        raise DistributedError(rank, host.get(rank, "?"), exc, others, "\n".join(notes),
                               reasons=self.interrupted, full_traceback=full)


class _DeferredInterrupt:
    """While a cell runs: SIGINT (the toolbar's interrupt) is noted, and raised as
    KeyboardInterrupt where the loop checks (``raise_pending``), not at whatever line it lands.

    Raised anywhere, it can leave a lock that ipyparallel's IO thread needs held for ever:
    ``threading.Condition.__enter__`` is Python code, and an exception between its acquire and
    the ``with`` body skips the release (CPython's bpo-29988). A Future's condition left held
    while this thread polled ``done()`` stopped the client's IO thread in its next
    ``set_result``: no reply, output or signal got through again, the ranks never heard the
    interrupt or Where?, and the cell said they "did not stop". One still pending when the cell
    ends is raised then. Off the main thread (no signal handler can be set) nothing changes.
    """

    def __init__(self) -> None:
        self.pending = False
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None
        self._installed = False

    def __enter__(self) -> "_DeferredInterrupt":
        try:
            self._previous = signal.signal(signal.SIGINT, self._note)
            self._installed = True
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, kind: type | None, *_rest: object) -> None:
        if self._installed:
            previous = self._previous
            signal.signal(signal.SIGINT, signal.default_int_handler if previous is None
                          else previous)
            self._installed = False
        if kind is None:
            self.raise_pending()

    def _note(self, _signum: int, _frame: FrameType | None) -> None:
        self.pending = True

    def raise_pending(self) -> None:
        """Raise KeyboardInterrupt if SIGINT came since the last call."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def immediate(self) -> Iterator[None]:
        """Within the block SIGINT raises at once, as it usually does: a prompt the user answers
        (the kernel's ``input()`` for a rank's debugger) must end on an interrupt, and no
        ipyparallel future is polled there."""
        if not self._installed:
            yield
            return
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.raise_pending()
            yield
        finally:
            signal.signal(signal.SIGINT, self._note)


def _parent_request(shell: Any) -> dict[str, Any] | None:
    """The execute request of the running cell (its header and metadata), or None outside a
    kernel."""
    kernel = getattr(shell, "kernel", None)
    try:
        parent = kernel.get_parent("shell") if kernel is not None else None
    except Exception:  # an ipykernel without get_parent(channel)
        parent = getattr(shell, "parent_header", None)
    return parent if isinstance(parent, dict) else None


def _stall_ranks(error: object) -> list[int]:
    match = _STALL_RANKS.search(str(getattr(error, "evalue", "") or error))
    return [int(r) for r in match.group(1).split(",") if r.strip()] if match else []


def _join(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, ranks))


def kernel_stopping(shell: Any) -> str | None:  # IPython's shell; ipykernel's has .kernel
    """``"restarting"`` or ``"shutting down"`` once the kernel has been asked to, else None.

    ipykernel sets ``shell.exit_now`` on a shutdown request (restart or not) before it
    terminates its child processes, which are the cluster's controller, mpiexec and engines.
    """
    if not getattr(shell, "exit_now", False):
        return None
    try:
        restart = shell.kernel.get_parent("control")["content"]["restart"]
    except Exception:  # no ipykernel (a terminal IPython), or no request to read
        return "shutting down"
    return "restarting" if restart else "shutting down"


def _await_the_end(limit: float = 30.0) -> None:
    """Hold the cell until the kernel's process ends (the server terminates it within seconds).

    The cell's reply cannot go out any more: ipykernel closes the shell's socket when it shuts
    down, and a reply sent then is a ZMQError traceback in the server's log. Its output, on
    IOPub, still does: flushed first.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.1)


def routes_to_ranks(lines: Iterable[str]) -> bool:
    """Whether an auto-mode cell goes to the ranks: not blank, not opened by a cell magic or by
    one of the local line magics (``%ring``, ``%load_ext`` ...)."""
    for line in lines:
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("%%"):
            return False
        if stripped.startswith("%"):
            name = stripped[1:].split(None, 1)[0] if len(stripped) > 1 else ""
            return name not in _LOCAL_LINE_MAGICS
        return True
    return False

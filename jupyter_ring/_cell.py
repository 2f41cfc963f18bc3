"""One ``%%distributed`` execution: submit, show output as it arrives, watch for failures,
interrupt, report.

:class:`CellRun` runs the cell's loop: each rank's iopub messages reach
:class:`jupyter_ring._ipp.CellExecution` on ipyparallel's IO thread, which wakes this thread at
once; what arrived goes to the cell's output (``_cell_output.CellOutput``: whole lines to the
rank tabs or tagged text, rich outputs as they come, results at the end). Between arrivals the
loop wakes every ``TICK`` seconds for what is due by the clock: the health check, peer
interrupts and ``--timeout`` (``_cell_interrupts.CellInterrupts``), the live views' redraws
(``_cell_output.CellDashboard``). At the end it raises the cell's failure.
"""

import argparse
import sys
import time
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

from . import _live
from ._cell_interrupts import CellInterrupts, DeferredInterrupt
from ._cell_output import TICK, CellDashboard, CellOutput
from ._debug import Debuggers
from ._ipp import CellExecution
from .errors import (CellInterrupted, ClusterError, DeadRankError, DistributedError, _ename, _first_line,
                     _rank_list, trim_traceback, where_stopped)

if TYPE_CHECKING:  # the front end's modules import this one
    from ._follow import Follower
    from .cluster import RingCluster
    from .cluster._elastic_resize import ElasticResize
    from .magics import RingMagics
    from .widgets._tabs import RankTabs, TextSink

__all__ = ["CellRun", "routes_to_ranks"]

# Errors on other ranks that are usually consequences of the first failure, never the headline.
_SECONDARY = {"KeyboardInterrupt", "StallError", "EngineError"}

# A rank's failure: the rank, when its cell ended (None: unknown), what it raised.
_Failure = tuple[int, datetime | None, BaseException]

# Seconds RingMagics.interrupt_grace grows for each rank beyond the cores on one host: each
# interrupted rank formats its KeyboardInterrupt on a core it queues for (64 ranks on 2 cores
# at load 90: 4.3 s from the interrupt to the cell's end, against the 5 s grace).
_GRACE_PER_CROWDED_RANK = 0.1

# Line magics that keep an auto-mode cell in the notebook kernel when they open it.
_LOCAL_LINE_MAGICS = ("ring", "load_ext", "reload_ext", "unload_ext")


class CellRun:
    """One cell on ``ranks`` of ``cluster``, shown through ``sink`` (see ``widgets._tabs``): its
    output (:class:`CellOutput`), live dashboard (:class:`CellDashboard`) and interrupts
    (:class:`CellInterrupts`) are collaborators; this class runs the loop, notices dead ranks
    and reports the failure."""

    def __init__(self, magics: "RingMagics", cluster: "RingCluster", ranks: list[int], cell: str,
                 args: argparse.Namespace, sink: "RankTabs | TextSink") -> None:
        self.magics = magics
        self.cluster = cluster
        self.ranks = ranks
        self.cell = cell
        self.timeout = args.timeout
        self.sink = sink
        self.output = CellOutput(ranks, sink, ranks[0] if args.rank0_output else None)
        self.dashboard = CellDashboard(cluster, ranks, sink, magics.held.dashboard_ready,
                                       wanted=not args.no_dashboard)
        self.interrupts = CellInterrupts(cluster, ranks, self.output.deliver)
        # the CellExecution once the cell's requests are sent (run() checks; the rest runs after)
        self.execution: CellExecution | None = None
        self.sigint = DeferredInterrupt()  # SIGINT while the cell runs: see the class
        self.debuggers: Debuggers | None = None  # the ranks' breakpoint() prompts, asked here
        self.resize: "ElasticResize | None" = None  # host discovery's resize at the next commit
        self.left: set[int] = set()  # ranks that left the world in this cell (a shrink)
        self.leaving: "ElasticResize | None" = None  # a shrink whose leavers' processes still exit

    def run(self) -> None:
        """Run the cell to its end, showing its output; raises DistributedError, CellInterrupted
        or DeadRankError as it ended."""
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
            self.dashboard.finish(self.execution)
            self.sink.finish()
        stopping = stopping or kernel_stopping(self.magics.shell)
        if stopping is not None:
            print(f"(cut off: the kernel is {stopping}; the ranks of this cell stopped with "
                  "it, and their variables are gone)", file=sys.stderr)
            _await_the_end()

    def _torch_aborted(self) -> bool:
        from .engines._torch import ABORT_NOTE

        return self.execution is not None and any(
            ABORT_NOTE in text for text in self.execution.stderr())

    def _run(self) -> None:
        cluster = self.cluster
        note = cluster.torch_repair_note()  # the previous cell's, if it came late
        if note:
            print(f"(after the previous cell) {note}", file=sys.stderr)
        debuggers = self.debuggers = Debuggers(cluster.where_dir, self.ranks,
                                               before_ask=self.output.before_prompt)
        debuggers.listen()  # before the requests leave: a breakpoint() on a rank gets a prompt
        where = cluster.where_dir
        _live.note_running_cell(where, _parent_request(self.magics.shell),
                                self.magics.cells.cell_number())
        try:
            with DeferredInterrupt() as self.sigint:
                self._run_cell(cluster, debuggers)
        finally:
            self._cancel_resize()
            self._leavers_gone(wait=True)  # the next cell begins with them gone
            _live.clear_running_cell(where)
            debuggers.close()

    def _run_cell(self, cluster: "RingCluster", debuggers: Debuggers) -> None:
        # An interrupt while the requests go out is the cell's (self.sigint notes it): raised
        # in the try below, where the ranks that got theirs are interrupted too (raised here, it
        # left them running the whole cell)
        from .engines._interrupts import METADATA

        cell_id = self.interrupts.cell_id = cluster.new_cell()
        execution = self.execution = CellExecution(
            cluster.client, [cluster.engine_ids[r] for r in self.ranks], self.ranks, self.cell,
            metadata={METADATA: cell_id.wire()})
        self.output.execution = self.interrupts.execution = execution
        try:
            self.sigint.raise_pending()
            if not self._watch(execution, debuggers):
                return  # the kernel is stopping: run() ends the output, says so and waits for the end
        except KeyboardInterrupt:
            plan = cluster.plan_used
            crowded = plan.crowded if plan is not None else 0.0
            unstopped = self.interrupts.interrupt_all(
                self.magics.interrupt_grace + _GRACE_PER_CROWDED_RANK * crowded)
            errors = {r: execution.error(r) for r in self.ranks if r not in unstopped}
            self._show_interrupted(errors)
            raise CellInterrupted("you", errors, unstopped) from None
        if self.resize is not None and not self.resize.grows:  # the leavers replied as the cell ended
            follow = self.magics.held.follow
            if follow is not None:
                self._drive_resize(execution, follow)
        self.interrupts.note_lost()
        self.output.wait_for_end(self.magics.output_grace, self.sigint.raise_pending)
        self.output.deliver(final=True)
        self.dashboard.poll(execution)  # a cell that ended before the first poll still gets its dashboard
        self.output.show_results()
        self._raise_errors(execution)

    def _watch(self, execution: CellExecution, debuggers: Debuggers) -> bool:
        """Show the output as it comes, and do what is due by the clock (health checks, peer
        interrupts, ``--timeout``, redraws, a rank's debugger prompt) until every rank has
        replied; False if the kernel began to stop meanwhile."""
        magics = self.magics
        t0 = time.monotonic()
        first_failure = None
        next_health_check = t0 + magics.health_interval
        while not execution.done():
            execution.wait(min(TICK, max(0.0, next_health_check - time.monotonic())))
            self.sigint.raise_pending()
            if execution.done():
                break  # every rank replied: what is left is the output's end (_run_cell)
            if kernel_stopping(magics.shell) is not None:
                return False
            self.output.deliver()
            now = time.monotonic()
            if now >= next_health_check or self._engine_failed(execution):
                next_health_check = now + magics.health_interval
                if self._check_dead(execution):  # replaced under elastic.run: the cell goes on
                    first_failure = None
                self._follow_discovery(execution)
            for rank in self.ranks:
                if execution.error(rank) is not None and not self._left(rank, execution):
                    if first_failure is None:
                        first_failure = now
                    self.sink.fail(rank)  # live: the tab is marked and selected at once
            self.sink.flush()
            self.dashboard.poll(execution)
            self.dashboard.serve_attach(now)
            if debuggers.waiting():
                # a rank at a breakpoint: the prompt is the user's; the time spent there does
                # not count towards --timeout
                with self.sigint.immediate():  # the kernel's input() ends on an interrupt
                    t0 += debuggers.attend()
                now = time.monotonic()
            self._interrupt_when_due(execution, debuggers, first_failure, now - t0, now)
        return True

    def _interrupt_when_due(self, execution: CellExecution, debuggers: Debuggers,
                            first_failure: float | None, running_for: float, now: float) -> None:
        """Interrupt the ranks still running once a peer failed (after ``peer_interrupt_delay``)
        or ``--timeout`` passed; say which ranks had not begun, and where stuck ranks are."""
        magics = self.magics
        pending = execution.pending()
        if (first_failure is not None and magics.interrupt_peers and pending
                and now - first_failure >= magics.peer_interrupt_delay):
            # a rank held in a debugger is left to the user (its next step may be `c`)
            held = debuggers.held()
            self.interrupts.interrupt([r for r in pending if r not in held], "a peer rank failed")
        if self.timeout is not None and running_for > self.timeout and pending:
            self.interrupts.interrupt(pending, f"--timeout {self.timeout:g} s")
        self.interrupts.note_waiting()
        self.interrupts.where_if_stuck(pending, now)

    def _engine_failed(self, execution: CellExecution) -> bool:
        """Whether the controller failed a rank's request because its engine went away: the
        death is checked at once, before the peers are interrupted for that failure."""
        errors = (execution.error(r) for r in self.ranks)
        return any(e is not None and _ename(e) == "EngineError" for e in errors)

    def _check_dead(self, execution: CellExecution) -> bool:
        """A rank that died mid-cell never replies: report it now instead of waiting forever.
        True when it was replaced and the cell goes on (``elastic.run``, :meth:`_go_on_elastic`)."""
        dead = self.cluster.dead_ranks()
        if not dead:
            return False
        self._cancel_resize()  # (the resize is done between cells, after the replacement)
        if self._go_on_elastic(execution, dead):
            return True
        execution.ar.wait(0.2)  # let ipyparallel deliver what it has
        self.output.deliver(final=True)
        self._raise_dead(dead)

    def _go_on_elastic(self, execution: CellExecution, dead: list[int]) -> bool:
        """A rank died while every other rank runs ``elastic.run`` in this cell: replace it in
        place and let the cell go on (issue 34, item 2). The survivors give their step up, go
        back to their last commit and re-form the world from inside ``run``; the new rank runs
        this cell from its start, and its ``run`` takes the state from them. False where it
        does not apply (the cell fails with DeadRankError, as without elastic code)."""
        cluster, magics = self.cluster, self.magics
        if (self._world() != list(range(cluster.size)) or not cluster.can_respawn(dead)
                or not cluster.elastic_survivors(dead)):
            return False
        from .cluster import elastic_note

        head = cluster.describe_death(dead, fix="").rstrip()
        try:
            done = cluster.respawn(dead, elastic=True)
        except ClusterError as exc:
            raise DeadRankError(f"{head} Replacing it in place failed: {exc}", dead) from None
        magics.held.new_rank_dashboard(cluster, done.ranks)
        self.dashboard.new_engines(execution, done.ranks, "replaced")  # (before the resubmit)
        for rank in done.ranks:
            execution.resubmit(rank, cluster.engine_ids[rank])
            self.interrupts.interrupted.pop(rank, None)
        print(f"{head} {elastic_note(done, cluster.restarts, cluster.max_restarts)}", file=sys.stderr)
        return True

    def _follow_discovery(self, execution: CellExecution) -> None:
        """``--host-discovery`` asks for another size while this cell runs: under ``elastic.run``
        on every rank the world is resized at the next commit (``cluster._elastic_resize``, one
        step a tick); any other cell runs on undisturbed, the resize waits for its end
        (``_follow``)."""
        follow = self.magics.held.follow
        if follow is None or follow.cluster is not self.cluster:
            return
        if self.resize is not None:
            self._drive_resize(execution, follow)
            return
        if not self._leavers_gone():
            return  # no other resize while a shrink's leavers still exit
        n = follow.target()
        if n is None:
            return
        cluster = self.cluster
        if self._world() != list(range(cluster.size)) or not cluster.elastic_survivors([]):
            follow.wait_for_cell(n)
            return
        from .cluster._elastic_resize import ElasticResize
        from .cluster._scale import ScaleRefused
        from .cluster._start import SETUP_CODE

        resize = ElasticResize(cluster, n, SETUP_CODE, follow.discovery.latest().slots)
        try:
            resize.begin()
        except ScaleRefused as exc:
            follow.say(f"(host discovery asks for {n} ranks; not now: {exc})")
            return
        except ClusterError as exc:  # the newcomers did not start: the cell goes on as it is
            resize.cancel()
            follow.gave_up = n
            follow.say(f"(host discovery asks for {n} ranks: starting the new rank(s) failed: {exc}; "
                       f"this cell goes on on {cluster.size} ranks, the resize is tried again after it)")
            return
        except BaseException:
            resize.cancel()
            raise
        self.resize = resize
        follow.resizing(n)

    def _drive_resize(self, execution: CellExecution, follow: "Follower") -> None:
        """The resize's next step, once the ranks have taken theirs (see ``_elastic_resize``)."""
        resize, cluster = self.resize, self.cluster
        assert resize is not None
        notes: list[str] = []
        if resize.grows:
            port = resize.port()
            if port is None:
                return  # the ranks have not reached their next commit yet
            self.resize = None
            try:
                joined = resize.join(port)
            except ClusterError:
                cluster.replace_failed = True  # the old ranks may wait in the new world: %ring restart
                raise
            # the dashboard's publisher first: a request sent after the cell waits for its end
            self.magics.held.new_rank_dashboard(cluster, resize.added)
            self.dashboard.new_engines(execution, sorted(joined), "joined")  # (before the cell is sent)
            for rank, engine_id in sorted(joined.items()):
                execution.add(rank, engine_id)
                if rank in self.left:  # it left the world earlier in this cell
                    self.left.discard(rank)
                    self.interrupts.interrupted.pop(rank, None)
                else:
                    self.ranks.append(rank)
                    self.sink.add_rank(rank)
        else:
            pending = execution.pending()
            if any(rank in pending for rank in resize.removed):
                return  # a leaving rank is still in the old world
            if not all(self._left(rank, execution) for rank in resize.removed):
                return  # their run ended before a commit: taken back (_cancel_resize) at the cell's end
            self.resize = None
            resize.stop_leavers()  # their processes exit meanwhile: _leavers_gone follows them
            self.leaving = resize
            self.left.update(resize.removed)
        follow.resized(resize)
        print(" ".join([resize.note(), *notes]), file=sys.stderr)

    def _leavers_gone(self, wait: bool = False) -> bool:
        """Whether no shrink's leavers are still exiting (``wait``: wait for them, bounded);
        once they are gone, says which had to be killed, if any."""
        leaving = self.leaving
        if leaving is None:
            return True
        notes = leaving.leavers_gone(wait)
        if notes is None:
            return False
        self.leaving = None
        if notes:
            print(" ".join(notes), file=sys.stderr)
        return True

    def _cancel_resize(self) -> None:
        """A resize not done by the end of the cell (or before a replacement) is taken back: it
        is done between cells."""
        resize, self.resize = self.resize, None
        if resize is not None:
            resize.cancel()

    def _world(self) -> list[int]:
        """The cell's ranks that are in the world now (not those that left it in a shrink)."""
        return sorted(r for r in self.ranks if r not in self.left)

    def _left(self, rank: int, execution: CellExecution) -> bool:
        """Whether ``rank`` ended this cell by leaving the world in a shrink (its
        ``LeftTheWorld``: no failure of the cell)."""
        error = execution.error(rank)
        return error is not None and _ename(error) == "LeftTheWorld" and (
            rank in self.left or (self.resize is not None and rank in self.resize.removed))

    def _raise_dead(self, dead: list[int]) -> NoReturn:
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

    def _dead_after(self, failures: list["_Failure"]) -> list[int]:
        """The dead ranks, given the cell's ``failures``: after an EngineError (the controller
        failed the tasks of a dead engine) the client hears of the unregistration a moment
        later, so up to a second more."""
        dead = self.cluster.dead_ranks()
        if not dead and any(_ename(e) == "EngineError" for _, _, e in failures):
            deadline = time.monotonic() + 1.0
            while not dead and time.monotonic() < deadline:
                time.sleep(0.05)
                dead = self.cluster.dead_ranks()
        return dead

    def _raise_errors(self, execution: CellExecution) -> None:
        """Raise the cell's failure, if any rank failed: DeadRankError when dead ranks are the
        story, CellInterrupted for an interrupt from outside, else DistributedError with the
        headline rank first; each failed rank's tab shows its part."""
        failures: list[_Failure] = [(rank, execution.finished_at(rank), error)
                    for rank in self.ranks if (error := execution.error(rank)) is not None
                    and not self._left(rank, execution)]
        if not failures:
            return
        dead = self._dead_after(failures)
        if dead and all(r in dead or _ename(e) in _SECONDARY for r, _, e in failures):
            # a dead engine is the story, not the errors it caused: report it by rank
            self._raise_dead(dead)

        interrupted = self.interrupts.interrupted
        if not dead and not interrupted and all(
                _ename(e) == "KeyboardInterrupt" for _, _, e in failures):
            # every failed rank was interrupted, and not by this kernel: the Ring panel's Interrupt
            errors = {r: execution.error(r) for r in self.ranks}
            self._show_interrupted(errors)
            raise CellInterrupted("the Ring panel's Interrupt (a SIGINT from outside the notebook)",
                                  errors)

        def order(item: _Failure) -> tuple[bool, bool, datetime | int, int]:
            rank, completed, exc = item
            secondary = _ename(exc) in _SECONDARY or rank in interrupted or rank in dead
            return (secondary, completed is None, completed or 0, rank)

        failures.sort(key=order)
        host = {row["rank"]: row["host"] for row in self.cluster.ranks}
        rank, _, exc = failures[0]
        others = [(r, host.get(r, "?"), e) for r, _, e in failures[1:]]
        full = self.magics.full_traceback
        headline = DistributedError(rank, host.get(rank, "?"), exc, others, full_traceback=full)
        below = {r for r, _ in headline.same}
        for r, _, e in sorted(failures, key=lambda item: item[0]):
            why = interrupted.get(r)
            lines: list[str] | None
            if r in below:  # one traceback per rank: this one is in the error below the tabs
                lines = [f"{_ename(e)}: {_first_line(getattr(e, 'evalue', e))}",
                         "(the traceback is below the tabs)"]
            else:
                lines = trim_traceback(str(getattr(e, "traceback", "") or ""), full) or None
            self.sink.error(r, e, f"interrupted: {why}" if why else "", lines=lines)
            self.sink.fail(r)
        self.sink.select(rank)  # the headline rank's tab, not merely the first one noticed
        notes = []
        if interrupted:
            by_why: dict[str, list[int]] = {}
            for r, why in sorted(interrupted.items()):
                by_why.setdefault(why, []).append(r)
            notes += [f"interrupted rank(s) {_rank_list(rs)}: {why}" for why, rs in by_why.items()]
        if dead:
            notes.append(self.cluster.describe_death(dead))
        raise DistributedError(rank, host.get(rank, "?"), exc, others, "\n".join(notes),
                               reasons=interrupted, full_traceback=full)


def _parent_request(shell: Any) -> dict[str, Any] | None:
    """The execute request of the running cell (its header and metadata), or None outside a
    kernel."""
    kernel = getattr(shell, "kernel", None)
    try:
        parent = kernel.get_parent("shell") if kernel is not None else None
    except Exception:  # an ipykernel without get_parent(channel)
        parent = getattr(shell, "parent_header", None)
    return parent if isinstance(parent, dict) else None


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

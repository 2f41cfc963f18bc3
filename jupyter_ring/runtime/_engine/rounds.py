"""The executor's rounds: what runs, with the executor lock held, when an engine's queue is run.

A round takes every entry queued at its start, splits it into batches (``plan_batches``: fusion)
and runs them in order. Ranks may cut rounds at different points (timing): every header carries
the number of entries of the sender's round from that collective on, and when those differ every
rank gets ``Recut`` from the same exchange and all rerun it with the shortest round. Headers that
name other collectives (``Disagree``) make the ranks settle by name (``settling``) what the
round runs; a resync since the round was planned (``Replan``) makes every rank plan again. Errors
of a batch fail that batch and the rest of its round (every rank alike) and surface at
``synchronize()``; an interrupt or ``Abandoned`` drops the queue.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from . import collectives
from .control import Abandoned, Disagree, Recut, Replan
from .entries import Batch, Call, Entry, Reduce, plan_batches
from .errors import RingError

if TYPE_CHECKING:
    from .progress import Engine

__all__ = ["Rounds", "cancelled"]


def cancelled(exc: BaseException) -> RingError:
    """The error of entries given up because of ``exc`` (an interrupt, ``Abandoned``, a failure of
    the engine itself: then the entries say so rather than wait forever)."""
    if isinstance(exc, Abandoned):
        return RingError(f"cancelled: {exc}")
    if isinstance(exc, KeyboardInterrupt):
        return RingError("cancelled: the collective was interrupted")
    error = RingError(f"cancelled: the engine failed ({type(exc).__name__}: {exc})")
    error.__cause__ = exc
    return error


class Rounds:
    """The rounds of one engine (executor lock held): their entries' results land in the
    engine's ``results``, and the entries leave its queue."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.rt = engine.rt

    def alone(self, entry: Entry) -> object:
        """One entry as a round of its own: a blocking call on an idle engine runs it at once in
        the caller's thread (the short path), and so does a round of one entry."""
        rt = self.rt
        rt.pending = 1
        if type(entry) is not Reduce:
            while True:
                rt.negotiable = True
                try:
                    return rt.run(entry.run, rt)
                except Recut:
                    continue  # a peer proposed a longer round; it reruns with this one alone
        src = entry.src
        plan = entry.plan
        key = (entry.explicit, entry.shape, plan.serial)
        agreements = self.engine.agreements
        own = agreements.get(key)
        if own is None:  # the response cache: a signature's agreement is packed once
            if len(agreements) > 4096:
                agreements.clear()
            own = agreements[key] = rt.agreement.own("allreduce", plan.dtype, plan.op, -1, src.size,
                                                     entry.describe())
        body: Callable[..., collectives.Array]
        args: tuple[object, ...]
        if src.nbytes <= rt.headers.eager_limit:  # the payload rides in the agreement message
            body, args = collectives.eager_one, (rt, src, entry.dst, plan, entry.name, entry.describe, own)
        else:
            body, args = collectives.allreduce_one, (rt, collectives.Member(src, entry.dst), plan, entry.name, entry.describe, own)
        while True:
            rt.negotiable = True
            try:
                out = rt.run(body, *args)
            except Recut:
                continue
            return entry.result if entry.result is not None else out.reshape(entry.shape)

    def run(self, settle: int | None = None) -> None:
        """Run every entry queued now, fused into batches; their results land in ``results``.

        When the ranks' headers disagree (``Disagree``, every rank alike), or ``settle`` (the
        generation of the exchange that disagreed) says they did, the ranks first settle by name
        what runs (``Settler.settle``); that round runs as agreed.
        """
        engine = self.engine
        queue = engine.queue
        todo: list[Entry] | None = queue.snapshot()
        if not todo:
            return
        if len(todo) == 1 and settle is None:
            return self._one(todo[0])
        rt = self.rt
        finished: set[int] = set()
        settled = False
        plan = rt.gen  # the generation this round's plan holds in (see Replan)
        try:
            while todo or settle is not None:
                if settle is not None:
                    todo = engine.settler.settle(finished, settle)
                    settle, settled = None, todo is not None
                    if todo is None:  # a resync came first: start over, on the new generation
                        todo, plan = queue.unfinished(finished), rt.gen
                    if not todo:
                        break
                try:
                    todo = self._batches(todo, finished, settled, plan)
                except Recut as recut:
                    # every rank runs the shortest round proposed; the rest waits for the next
                    todo = [e for e in todo if e.handle not in finished][:recut.count]
                except Disagree as disagree:
                    settle = disagree.gen
                except Replan:
                    # a rank gave up a collective of this plan (or dropped the round) and every
                    # rank resynced: every rank plans again from its queue, as a new round
                    todo, plan, settled = queue.unfinished(finished), rt.gen, False
        except BaseException as exc:
            for entry in todo:  # type: ignore[union-attr]  # (a list: None from settle is replaced at once)
                engine.results.setdefault(entry.handle, cancelled(exc))
            self.drop_queue(exc)
            raise
        finally:
            rt.plan = -1
            if finished:
                queue.remove(finished)
            engine.notify()

    def _batches(self, todo: list[Entry], finished: set[int], settled: bool, plan: int) -> list[Entry]:
        """Run ``todo`` as the batches it fuses into, in order, adding their handles to
        ``finished``; returns what is left of the round to run (nothing, once it ran or failed)."""
        rt = self.rt
        results = self.engine.results
        batches = plan_batches(todo, self.engine.config.fusion_threshold)
        left = len(todo)
        for index, batch in enumerate(batches):
            if rt.abort is not None:
                raise Abandoned(rt.abort)
            rt.pending = left  # entries of this round from this batch on
            rt.negotiable = not settled
            rt.plan = plan
            try:
                self._run_batch(batch)
            except (Recut, Disagree, Replan, Abandoned, KeyboardInterrupt):
                raise
            except Exception as exc:  # noqa: BLE001 - surfaces at synchronize()
                # the batch and the rest of the round fail alike on every rank
                for rest in batches[index:]:
                    for entry in rest.entries:
                        results.setdefault(entry.handle, exc)
                        finished.add(entry.handle)
                return []
            for entry in batch.entries:
                finished.add(entry.handle)
            left -= len(batch.entries)
        return []

    def _one(self, entry: Entry) -> None:
        """A round of one entry (nothing else queued): ``alone``, settled by name on ``Disagree``."""
        engine = self.engine
        handle = entry.handle
        try:
            if self.rt.abort is not None:
                raise Abandoned(self.rt.abort)
            result = self.alone(entry)
        except Disagree as disagree:
            result = disagree
        except Exception as exc:  # noqa: BLE001 - surfaces at synchronize()
            result = exc
        except BaseException as exc:
            engine.results.setdefault(handle, cancelled(exc))
            self.drop_queue(exc)
            raise
        if type(result) is Disagree:  # settled outside the handler: no chain to Disagree
            return self.run(settle=result.gen)
        engine.results.setdefault(handle, result)
        engine.queue.remove({handle})
        engine.notify()

    def drop_queue(self, exc: BaseException) -> None:
        """Interrupted (this thread) or abandoned (another): the queue is gone, the rest cancelled.

        The peers may be in the round this rank drops (they settled it with this rank, or cut it
        with it): the runtime resyncs at its next collective, which makes them plan again
        (``Replan``) instead of waiting in a round that this rank left.
        """
        self.engine.fail_queued(cancelled(exc))
        self.rt.dirty = True
        if isinstance(exc, Abandoned):
            self.rt.abort = None
        self.engine.notify()

    def _run_batch(self, batch: Batch) -> None:
        """One batch: a ``Call`` alone, or ``Reduce`` entries fused into one allreduce."""
        rt = self.rt
        entries = batch.entries
        results = self.engine.results
        first = entries[0]
        if type(first) is Call:
            results.setdefault(first.handle, rt.run(first.run, rt))
            return
        plan = first.plan
        # (a batch whose first entry is a Reduce holds Reduces only (plan_batches): the ignores below)
        if len(entries) == 1:
            desc = collectives.allreduce_desc(first.explicit, first.shape, plan.prescale, plan.postscale)
            name = first.name
        else:
            members = tuple((e.explicit, e.shape) for e in entries)  # type: ignore[union-attr]
            desc = collectives.allreduce_desc(None, (sum(e.src.size for e in entries),),  # type: ignore[union-attr, misc]
                                              plan.prescale, plan.postscale, members)
            name = f"fused[{first.name} +{len(entries) - 1}]"
        outs = rt.run(collectives.allreduce, rt, [collectives.Member(e.src, e.dst) for e in entries],  # type: ignore[union-attr]
                      plan, name, desc)
        for entry, out in zip(entries, outs):
            results.setdefault(entry.handle,
                               entry.result if entry.result is not None  # type: ignore[union-attr]
                               else out.reshape(entry.shape))  # type: ignore[union-attr]

"""Agreement: the header exchange every collective starts with, and what it settles.

Each rank sends every other rank a 56-byte header (kind, dtype, op, root, count, a fingerprint of
name/shape/scales: ``wire``) and, when the payload is small, the payload itself in the same
message. Every rank compares all headers, so every rank sees a disagreement and raises alike: a
peer's poison (``PeerError``), rounds of different lengths (``Recut``), different collectives
(``Disagree`` where the engine may settle them by name, else ``CollectiveMismatchError``,
explained by ``mismatch``). Small collectives finish here: one round trip. Joins (``join``) are
announced by a header too. The buffers and requests are ``headers``'.

From ``LOG_AGREEMENT_RANKS`` ranks on (or ``JUPYTER_RING_AGREEMENT=log``) the same headers travel
in ⌈log2 n⌉ steps instead (``log_agreement``: Bruck's allgather, headers only, every rank of the
communicator relaying, joined ones too); the checks read the gathered table and mean the same.
Prepared lanes need the direct exchange (one persistent message a peer): there they are not made.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from . import algorithm_choice
from .control import Disagree, Recut, Restart
from .errors import CollectiveMismatchError, PeerError
from .log_agreement import HeaderAllgather
from .mismatch import collective_title, explain_mismatch
from .wire import (AGREE, AGREE_END, DTYPE_CODE, FLAG_PAYLOAD, HEADER_BYTES, JOIN, KIND_CODE, POISON,
                   TAG_HEADER, TAG_POISON, TAIL, Desc, JoinNote, PeerMsg, Prepared, fingerprint)
from .._observe.where import activity

if TYPE_CHECKING:
    from mpi4py import MPI

    from .core import Runtime

__all__ = ["Agreement"]


class Agreement:
    """The header exchanges of one runtime: ``negotiate`` (and its prepared form), joins, poison,
    and the cache of packed agreements per signature."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._cache: dict[tuple[str, np.dtype | None, int, int, int, Desc], bytes] = {}
        # "all" (direct, to every peer) or "log" (relayed in log2(n) steps): fixed for the runtime
        self.mode = algorithm_choice.agreement(rt.config.agreement, rt.size)
        self.gather = HeaderAllgather(rt) if self.mode == "log" else None
        # relayed exchanges, header bytes sent, seconds: ring.stats()["agreement[log]"] (the direct
        # exchanges are counted by rt.seq from seq_base on, untimed: nothing added to the hot path)
        self.tally = [0, 0, 0.0]
        self.seq_base = 0

    def own(self, kind: str, dtype: np.dtype | None, op: int, root: int, count: int, desc: Desc) -> bytes:
        """The 24 bytes every rank must send alike for this collective (cached per signature)."""
        key = (kind, dtype, op, root, count, desc)
        own = self._cache.get(key)
        if own is None:
            if len(self._cache) > 4096:
                self._cache.clear()
            dtype_code = DTYPE_CODE.get(dtype, 255) if dtype is not None else 255
            own = self._cache[key] = AGREE.pack(KIND_CODE[kind], dtype_code, op, root, count,
                                                fingerprint(*desc))
        return own

    def prepare(self, own: bytes, nbytes: int, aux: int = 0,
                peers: Mapping[int, tuple[int, int]] | None = None) -> Prepared | None:
        """The header exchange of an eager collective whose agreement is ``own``, made once for a
        prepared lane: this rank sends ``aux`` and a payload of ``nbytes`` (-1: none), and
        ``peers`` maps each active peer to the (aux, payload bytes) it sends (None: what this rank
        sends). None when it cannot be made (a peer has joined, the payload does not fit
        ``eager_bytes``)."""
        rt = self.rt
        h = rt.headers
        if rt.joined or nbytes > h.eager_limit or self.gather is not None:
            return None
        message = h.message(h.sendbuf, own, aux, None, 1, 0, preset=nbytes)
        header = bytes(message[:HEADER_BYTES])
        sends = h.sends.get(len(message))
        if sends is None:
            sends = h.sends_for(message)
        recvs = list(h.recvs)
        views = tuple(memoryview(h.eager[p])[:HEADER_BYTES] for p in rt.active)
        if peers is None:
            expected = (header,) * len(rt.active)
        else:
            expected = tuple(self.peer_header(header, *peers[p]) for p in rt.active)
        return Prepared(h.wiring, header, recvs + sends, sends, views, expected)

    def peer_header(self, header: bytes, aux: int, nbytes: int) -> bytes:
        """The whole header a peer sends on the prepared exchange whose own header is ``header``
        when its ``aux`` and payload size (-1: none) are these (``prepare``'s ``peers``)."""
        rt = self.rt
        flags = FLAG_PAYLOAD if 0 <= nbytes <= rt.headers.eager_limit else 0
        return header[:AGREE_END] + TAIL.pack(flags, rt.gen, 1, aux, 0)

    def run_prepared(self, prep: Prepared, kind: str, name: str, dtype: np.dtype | None, op: int, root: int,
                     desc: Desc | Callable[[], Desc]) -> dict[int, PeerMsg] | None:
        """``negotiate`` for a prepared exchange (the caller wrote the payload into
        ``payload_view()``): the same messages, the same waits, the same checks.

        Returns None when every peer sent the header the lane expects of it (the lane's case);
        else the peers' headers went through every check of ``negotiate`` (which raise as
        there) and the peer -> ``PeerMsg`` dict says what they sent instead (another allgather
        row count, a peer's join notice: reduce over ``participants`` then).
        """
        activity.begin(kind, name)
        rt = self.rt
        h = rt.headers
        header = prep.header
        h.sendbuf[:HEADER_BYTES] = header
        rt.seq += 1
        reqs = prep.reqs
        if reqs:
            MPI = rt.MPI
            MPI.Prequest.Startall(reqs)
            rt.inflight = prep.sends  # the persistent receives are cancelled by resync, not Recovery.abandon
            if not MPI.Request.Testall(reqs):
                rt.waits.wait(reqs, lambda: f"{kind} '{name}'", h.waits_on)
        if prep.peer_headers == prep.expected:  # views against bytes: compared byte for byte
            rt.negotiable = False
            return None
        return self._check_headers(kind, name, dtype, op, root, desc, header[:AGREE_END], 1)

    def negotiate(self, kind: str, name: str, dtype: np.dtype | None, op: int, root: int, count: int,
                  desc: Desc | Callable[[], Desc], aux: int = 0, payload: npt.NDArray[np.uint8] | None = None,
                  per_peer: Mapping[int, tuple[int, npt.NDArray[np.uint8] | None]] | None = None,
                  pending: int | None = None, own: bytes | None = None, region: int = 0,
                  preset: int | None = None) -> dict[int, PeerMsg]:
        """Exchange headers (and eager payloads) with every peer and check agreement.

        ``desc`` is the tuple fingerprinted for agreement (shape, scales, explicit name ...), or
        ``own`` its packed agreement when the caller cached it. ``payload`` is a byte view sent
        along when it fits ``eager_bytes`` (or ``preset`` the size of one the caller wrote into
        ``payload_view()`` already); ``per_peer`` maps a peer to its own ``(aux, payload)``
        (alltoall). ``pending`` is the number of entries of the engine's round from this one on:
        ranks whose rounds differ raise ``Recut`` with the shortest (every rank sees every
        header, so every rank raises it). Returns a dict peer -> ``PeerMsg`` for every peer
        taking part (peers that called ``join()`` are left out once their notice arrives).
        """
        activity.begin(kind, name)
        rt = self.rt
        h = rt.headers
        comm = rt.comm
        if own is None:  # a caller that passes a function for desc passes own too
            own = self.own(kind, dtype, op, root, count, cast(Desc, desc))
        if pending is None:
            pending = rt.pending
        if self.gather is not None:
            # headers only (eager is off at these worlds); alltoall's per-peer headers go directly
            # after it, as they do at every size
            result = self._negotiate_log(kind, name, dtype, op, root, desc, own, aux, pending, region)
            if per_peer is None:
                return result
        rt.seq += 1
        peers = rt.active
        recvs = h.recvs
        rt.MPI.Prequest.Startall(recvs)
        # the cached persistent sends (Prequest), or this call's own Isends
        sends: Sequence[MPI.Request] | None
        message: memoryview | None
        if per_peer is None:
            message = h.message(h.sendbuf, own, aux, payload, pending, region, preset)
            sends = h.sends.get(len(message))
            if sends is None:
                sends = h.sends_for(message)
            rt.MPI.Prequest.Startall(sends)
        else:
            sends = []
            for p in peers:
                peer_aux, data = per_peer[p]
                buf = bytearray(HEADER_BYTES + (data.nbytes if data is not None else 0))
                rt.keep.append(buf)
                sends.append(comm.Isend(h.message(buf, own, peer_aux, data, pending), p, TAG_HEADER))
            # (a bytearray here; numpy's stubs give ndarray, also Kept, __buffer__ on Python 3.12+ only)
            message = memoryview(rt.keep[-1])[:HEADER_BYTES] if rt.keep else None  # type: ignore[arg-type]
        if rt.joined and self.gather is None:
            # joined ranks reply to nothing, but see that this rank still runs collectives
            header = memoryview(h.sendbuf)[:HEADER_BYTES] if per_peer is None else message
            sends = sends + [comm.Isend(header, p, TAG_HEADER) for p in rt.joined]  # not the cached list
        reqs = recvs + sends
        rt.inflight = sends  # the persistent receives are cancelled by resync, not Recovery.abandon
        rt.waits.wait(reqs, lambda: f"{kind} '{name}'", h.waits_on)
        if rt.keep:
            rt.keep.clear()
        return self._check_headers(kind, name, dtype, op, root, desc, own, pending)

    def _negotiate_log(self, kind: str, name: str, dtype: np.dtype | None, op: int, root: int,
                       desc: Desc | Callable[[], Desc], own: bytes, aux: int, pending: int,
                       region: int) -> dict[int, PeerMsg]:
        """``negotiate``'s agreement in ⌈log2 n⌉ steps (``log_agreement``): the header alone,
        relayed by every rank, then the same checks on the gathered table. A peer's poison met on
        the way raises its ``PeerError`` (the exchange is abandoned: a resync comes next)."""
        rt = self.rt
        gather = self.gather
        assert gather is not None  # only called in log mode
        h = rt.headers
        if gather.pending is not None:  # a poison for this collective, found at the resync
            peer, poison = gather.pending
            gather.pending = None
            self._raise_poison(kind, name, {peer: poison})
        rt.seq += 1
        start = time.perf_counter()
        message = h.message(h.sendbuf, own, aux, None, pending, region)
        if not gather.run(message, lambda: f"{kind} '{name}'"):
            self._raise_poison(kind, name, {gather.poisoned: h.eager[gather.poisoned]})
        tally = self.tally
        tally[0] += 1
        tally[1] += gather.sent_bytes
        tally[2] += time.perf_counter() - start
        return self._check_headers(kind, name, dtype, op, root, desc, own, pending, gather.rows)

    def counts(self) -> dict[str, float]:
        """``ring.stats()``'s ``agreement[all]`` or ``agreement[log]``: exchanges since init or
        ``reset_counts``, header bytes this rank sent (the direct exchange's estimated as one header to each
        peer), seconds (relayed only: the direct exchange is not timed)."""
        if self.gather is not None:
            count, nbytes, seconds = self.tally
        else:
            count = self.rt.seq - self.seq_base
            nbytes, seconds = count * HEADER_BYTES * (self.rt.size - 1), 0.0
        return {"count": count, "bytes": nbytes, "time_s": seconds, "algbw": 0.0, "busbw": 0.0}

    def reset_counts(self) -> None:
        """Start ``counts`` again from zero."""
        self.tally[:] = [0, 0, 0.0]
        self.seq_base = self.rt.seq

    def _check_headers(self, kind: str, name: str, dtype: np.dtype | None, op: int, root: int,
                       desc: Desc | Callable[[], Desc], own: bytes, pending: int,
                       rows: Mapping[int, memoryview] | None = None) -> dict[int, PeerMsg]:
        """Read every active peer's header of the exchange just completed: joins, poison, a
        mismatch (``Disagree`` where negotiable, else explained), rounds of other lengths
        (``Recut``). ``rows`` holds every peer's header where the agreement was relayed
        (joined peers' too: their JOIN notices), else the eager buffers are read. Returns
        peer -> ``PeerMsg``."""
        rt = self.rt
        eager: Mapping[int, bytearray | memoryview] = rt.headers.eager if rows is None else rows
        peers = rt.active if rows is None else rt.peers
        result: dict[int, PeerMsg] = {}
        mismatch = False
        cut = pending            # every rank runs the shortest round proposed
        recut = False
        newly_joined = False
        for p in peers:
            buf = eager[p]
            code = buf[0]
            if code == JOIN:
                if p not in rt.joined:  # (relayed: a joined peer's notice comes every exchange)
                    flags, _gen, tick, collectives, _region = TAIL.unpack_from(buf, AGREE_END)
                    rt.joined[p] = JoinNote(collectives, tick)
                    newly_joined = True
                continue
            view = memoryview(buf)
            if view[:AGREE_END] != own:
                mismatch = True
            flags, _gen, peer_pending, peer_aux, peer_region = TAIL.unpack_from(buf, AGREE_END)
            if code != POISON and peer_pending != pending:
                recut = True
                cut = min(cut, peer_pending)
            result[p] = PeerMsg(peer_aux, view[HEADER_BYTES:] if flags & FLAG_PAYLOAD else None, peer_region)
        if newly_joined:
            rt.set_participants()
        negotiable, rt.negotiable = rt.negotiable, False
        if mismatch:
            if rows is None:  # (relayed: a poison never comes as a header, see _negotiate_log)
                self._raise_poison(kind, name, {p: eager[p] for p in peers})
            if negotiable and not rt.joined:
                # different collectives at this place: the engines match their queues by name
                raise Disagree(rt.gen)
        if recut:
            # rounds of different lengths fuse different batches: not a mismatch; every rank
            # (the one with the shortest round too) runs the exchange again for the shortest
            raise Recut(cut)
        if mismatch:
            explain_mismatch(rt, kind, name, dtype, op, root, desc() if callable(desc) else desc)
        if rt.joined and kind != "allreduce":
            # a mismatch (join against another collective), raised on every active rank after every
            # header was consumed: no resync, so the collective still counts for join's last rank
            joined = rt.name_of(sorted(rt.joined))
            raise CollectiveMismatchError(
                f"{kind} '{name}': rank(s) {joined} called join() and wait for the others to join; "
                "only allreduce can run until every rank has joined (as in Horovod). Call join() on "
                "this rank too, or run this collective before any rank joins.")
        return result

    def join(self, name: str) -> int:
        """This rank has no more data: serve as a left-out peer until every rank has joined.

        Sends a JOIN notice (its collective count and shared-memory tick) to every peer: peers in a
        collective take it as this rank's header and leave it out of the data; joined peers wait for
        it. Then receives the headers of the peers still running collectives (ignored: they reduce
        without this rank) until every peer's JOIN has arrived. Returns the last rank to join
        (most collectives run since the previous join; the highest rank among equals), the same
        on every rank.
        """
        rt = self.rt
        h = rt.headers
        MPI = rt.MPI
        comm = rt.comm
        tick = rt.shm.ticks(rt.gen) if rt.shm is not None else 0
        rt.seq += 1
        # collectives since the last join completed, the same starting point on every rank (seq
        # itself differs by the collectives some ranks ran while others had joined)
        count = rt.seq - rt.join_base
        own = AGREE.pack(JOIN, 255, 0, -1, 0, 0)
        message = h.message(h.sendbuf, own, count, None, tick)
        if self.gather is not None:
            return self._join_log(name, message, JoinNote(count, tick))
        sends = [comm.Isend(message, p, TAG_HEADER) for p in rt.peers]
        waiting = [p for p in rt.peers if p not in rt.joined]
        reqs = {p: h.recv[p] for p in waiting}
        MPI.Prequest.Startall(list(reqs.values()))
        rt.inflight = sends
        progress = [False]

        def arrived() -> bool:
            for p in list(reqs):
                if not reqs[p].Test():
                    continue
                progress[0] = True
                buf = h.eager[p]
                if buf[0] == JOIN:
                    _flags, _gen, peer_tick, collectives, _region = TAIL.unpack_from(buf, AGREE_END)
                    rt.joined[p] = JoinNote(collectives, peer_tick)
                    del reqs[p]
                else:  # a peer still running collectives: its header, sent to a joined rank
                    reqs[p].Start()
            return not reqs or progress[0]

        while reqs:
            progress[0] = False
            rt.waits.poll(arrived, f"join '{name}' (waiting for every rank to join)", lambda: sorted(reqs))
        rt.waits.wait(sends, f"join '{name}'", rt.peers)
        notes = dict(rt.joined)
        notes[rt.rank] = JoinNote(count, tick)
        return self._joined(notes)

    def _join_log(self, name: str, message: memoryview, mine: JoinNote) -> int:
        """``join`` where the agreement is relayed: this rank takes part in every exchange with
        its JOIN notice as its header (the peers still running collectives read it there and
        leave it out) until an exchange in which every rank's header is a JOIN notice, the same
        exchange on every rank. A poison met on the way (a running peer raised) is no concern of
        a joined rank: it resyncs with the others and joins again on the fresh communicator."""
        rt = self.rt
        gather = self.gather
        assert gather is not None
        header = bytes(message)
        gather.pending = None  # a poison kept at a resync on the way here: no concern of a joined rank
        while True:
            if not gather.run(header, lambda: f"join '{name}' (waiting for every rank to join)"):
                raise Restart()  # abandoned: Runtime.run resyncs, then this join runs again
            notes = {rt.rank: mine}
            for p in rt.peers:
                row = gather.rows[p]
                if row[0] == JOIN:
                    _flags, _gen, tick, collectives, _region = TAIL.unpack_from(row, AGREE_END)
                    notes[p] = JoinNote(collectives, tick)
            if len(notes) == rt.size:
                break
        return self._joined(notes)

    def _joined(self, notes: dict[int, JoinNote]) -> int:
        """Every rank has joined (``notes``: each one's notice, this rank's too): the last one to
        join, the same on every rank; the runtime's joins are reset."""
        rt = self.rt
        last = max(notes, key=lambda q: (notes[q].collectives, q))
        if rt.shm is not None:
            rt.shm.align(rt.gen, max(note.tick for note in notes.values()) + 1)
        rt.joined = {}
        rt.join_base = rt.seq
        rt.set_participants()
        return rt.world[last]

    def poison(self, kind: str, name: str, exc: BaseException) -> None:
        """This rank cannot join ``kind`` (bad arguments): tell every peer why, without waiting.

        Peers waiting in the collective raise ``PeerError`` at once instead of stalling. Their
        headers for it are drained by receives posted now: MPI matches a source's messages to
        receives in posting order, so the next collective's receives get the next headers and
        the communicator stays clean without a resync.
        """
        rt = self.rt
        if rt.size == 1:
            return
        rt.completed -= 1  # (finished() counts this call, which completes no collective on any peer)
        h = rt.headers
        drains = rt.recovery.drains = [req for req in rt.recovery.drains if not req.Test()]
        text = f"{type(exc).__name__}: {exc}".encode()[:len(h.sendbuf) - HEADER_BYTES]
        own = AGREE.pack(POISON, 255, 0, -1, 0, fingerprint(kind, name))
        rt.seq += 1
        buf = bytearray(HEADER_BYTES + len(text))
        message = h.message(buf, own, len(text), np.frombuffer(text, np.uint8), -1)
        if self.gather is not None and self.gather.pending is not None:
            # this rank resynced on its way here and kept a peer's poison for this very collective:
            # every rank has it already (met while waiting, kept at its resync, or sent it), so
            # this rank's own would reach ranks that are past it on the fresh communicator
            self.gather.pending = None
            return
        if self.gather is not None:
            # Relayed headers cannot carry it (this rank relays nothing of this collective): it
            # goes to every peer directly, joined ones too (they relay). Peers' rows sent to this
            # rank for it stay unreceived: this rank resyncs before its next collective, as the
            # peers do once they have met the poison (log_agreement).
            buf[HEADER_BYTES:] = text  # (no eager payload here: the header's packing leaves it out)
            drains.extend(rt.comm.Isend(buf, p, TAG_POISON) for p in rt.peers)
            rt.dirty = True
            return
        capacity = len(h.sendbuf)
        for p in rt.active:
            drains.append(rt.comm.Isend(message, p, TAG_HEADER))
            drains.append(rt.comm.Irecv(bytearray(capacity), p, TAG_HEADER))

    def _raise_poison(self, kind: str, name: str, bufs: Mapping[int, bytearray | memoryview | bytes]) -> None:
        """A peer sent poison in place of its header (``bufs``: peer -> what it sent): raise its
        reason (``PeerError``)."""
        rt = self.rt
        for p, buf in bufs.items():
            if buf[0] == POISON:
                _flags, _gen, _pending, nbytes, _region = TAIL.unpack_from(buf, AGREE_END)
                reason = bytes(buf[HEADER_BYTES:HEADER_BYTES + nbytes]).decode(errors="replace")
                q = rt.world[p]
                raise PeerError(
                    f"{collective_title(kind, name)}: rank {q} could not join this collective and "
                    f"raised {reason}. Fix the call on rank {q}; every rank raises here so that none "
                    "is left waiting.", q, reason)


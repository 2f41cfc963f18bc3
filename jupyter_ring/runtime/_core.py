"""The ring runtime: agreement, interruptible waits, resynchronisation and the ring algorithms.

One ``Runtime`` object per process holds the communicators. Every collective goes through
``Runtime.run``:

1. **Agreement.** Each rank sends every other rank a 48-byte header (kind, dtype, op, root,
   count, a fingerprint of name/shape/scales) and, when the payload is small, the payload itself
   in the same message. Every rank compares all headers, so every rank sees a disagreement and
   raises the same ``CollectiveMismatchError``. Small collectives finish here: one round trip.
2. **Data.** Larger payloads move over point-to-point messages: a pipelined ring reduce-scatter +
   allgather for allreduce, direct sends for the rest. When every rank is on one host, an
   allreduce above ``shm_threshold`` goes through shared-memory slots instead (``_shm``), if
   every rank offers its slot in the agreement message.
3. **Waiting.** Every wait is a nonblocking request (or a shared-memory counter) polled from
   Python: spin briefly, then back off. SIGINT therefore raises KeyboardInterrupt within
   milliseconds, a rank that never arrives raises ``StallError`` after ``stall_timeout``.
4. **Recovery.** An abandoned collective (interrupt, stall, error) can leave messages in flight.
   The rank marks itself dirty; at its next collective it tells every peer (a RESYNC notice on a
   control communicator) and all ranks switch to a fresh data communicator made by a polled
   ``Idup``. Messages of the abandoned collective stay on the old communicator and can never
   match a later receive. A clean rank that receives a notice while waiting joins the resync and
   retries its collective on the fresh communicator.
"""

import logging
import os
import pickle
import socket
import struct
import time
import zlib

import numpy as np

from . import _shm
from ._config import Config
from ._errors import CollectiveMismatchError, PeerError, RingError, StallError
from ._report import reporter
from ._trace import Trace
from ._where import activity

__all__ = ["Runtime", "Sum", "Average", "Min", "Max", "Product", "Adasum", "OP_NAMES"]

log = logging.getLogger(__name__)

# Reduce ops (Horovod's names; Adasum is named so that ported code gets a clear error).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

KINDS = ("allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "barrier",
         "broadcast_object", "allgather_object", "resync", "timeline", "error")
POISON = 10  # KIND_CODE["error"]: "I failed before I could join; here is why"
KIND_CODE = {kind: code for code, kind in enumerate(KINDS)}

DTYPES = [np.dtype(t) for t in (
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128)]
DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}

# kind, dtype, op, pad, root, count, fingerprint: the region every rank must agree on ...
_AGREE = struct.Struct("<BBBxiqQ")
# ... then flags, generation, sequence number, aux (per-rank value: rows, bytes).
_HEADER = struct.Struct("<BBBxiqQBxxxIqq")
_TAIL = struct.Struct("<BxxxIqq")
HEADER_BYTES = _HEADER.size
_AGREE_END = _AGREE.size
FLAG_PAYLOAD = 1

TAG_HEADER, TAG_DATA, TAG_DESC, TAG_RESYNC = 11, 12, 13, 14
_SPIN_SECONDS = 0.002
_DESC_BYTES = 1 << 16


class _Restart(Exception):
    """A peer asked for a resync while this rank waited: retry the collective on a fresh comm."""


def _fingerprint(*parts):
    text = repr(parts).encode()
    return (zlib.crc32(text) << 32) | zlib.adler32(text)


def _reducer(op, dtype):
    """The elementwise numpy function for ``op`` on ``dtype`` (checked, with a clear error)."""
    if op == Adasum:
        raise ValueError("op=Adasum is not supported by jupyter_ring; use op=Average or op=Sum")
    if op not in OP_NAMES:
        raise ValueError(f"unknown reduce op {op!r}; use one of ring.Sum, Average, Min, Max, Product")
    if dtype.kind == "b":
        if op in (Min, Product):
            return np.logical_and
        if op == Max:
            return np.logical_or
        raise TypeError(f"op={OP_NAMES[op]} is not defined for bool arrays; cast to uint8 or use op=Max (any) / Min (all)")
    if dtype.kind == "c" and op in (Min, Max):
        raise TypeError(f"op={OP_NAMES[op]} is not defined for complex arrays ({dtype}); use Sum, Average or Product")
    if op in (Sum, Average):
        return np.add
    return {Min: np.minimum, Max: np.maximum, Product: np.multiply}[op]


class Runtime:
    """The communicators, topology, trace and pending work of one initialised runtime."""

    def __init__(self, comm, config):
        from mpi4py import MPI

        self.MPI = MPI
        self.config = config
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.peers = [p for p in range(self.size) if p != self.rank]
        self.trace = Trace(self.rank, self.size, config.trace_records)
        self.seq = 0
        self.gen = 0
        self.dirty = False
        self.partial = False      # the collective in progress has written into its caller's input
        self._inflight = []       # requests of the collective in progress
        self._abandoned = []      # (requests, buffers) of collectives given up, freed at resync
        self._keep = []           # send buffers that must outlive their requests
        self._pending_dup = None  # (newcomm, request) of a resync in progress
        self._notices = {}        # resync target -> set of ranks that announced it
        self._notice_sends = []
        self._drains = []         # poison sends and the receives that drain peers' headers
        self._scratch = None
        self._eager = None
        self._sendbuf = None
        self._header_recvs = []
        self._agree_cache = {}

        # The control communicator carries only RESYNC notices and Idup, so its collective order
        # can never be disturbed by an abandoned data collective.
        self.ctl = self._poll_dup(comm, "init")
        self._notice_buf = np.zeros(1, np.int64)
        self._notice_req = self.ctl.Irecv([self._notice_buf, MPI.INT64_T], MPI.ANY_SOURCE, TAG_RESYNC)
        self.comm = self._poll_dup(self.ctl, "init")
        self.hosts = self._exchange_hostnames()
        self._set_topology()
        self._eager_buffers()
        self.shm = self._shared_slots()

    # ------------------------------------------------------------------ set-up
    def _poll_dup(self, comm, what):
        newcomm, req = comm.Idup()
        self._wait([req], what, self.peers, check_notices=False)
        return newcomm

    def _exchange_hostnames(self):
        MPI = self.MPI
        name = socket.gethostname().encode()[:255].ljust(256, b"\0")
        out = bytearray(256 * self.size)
        req = self.ctl.Iallgather([name, MPI.BYTE], [out, MPI.BYTE])
        self._wait([req], "init", self.peers, check_notices=False)
        return [bytes(out[i * 256:(i + 1) * 256]).rstrip(b"\0").decode() for i in range(self.size)]

    def _shared_slots(self):
        """``SharedSlots`` when every rank is on this host and sees the others' /dev/shm files.

        Every rank makes a probe file and checks the peers'; one more exchange of the verdicts
        makes every rank decide alike (a "host" name shared by separate containers fails here).
        """
        MPI = self.MPI
        if self.size == 1 or self.local_size != self.size:
            return None
        slots = None
        if _shm.supported():
            try:
                slots = _shm.SharedSlots(self.rank, self.size)
            except OSError as exc:
                log.info("jupyter_ring: no shared-memory allreduce on rank %d: %s", self.rank, exc)
        tokens = np.zeros(self.size, np.int64)
        mine = np.array([slots.token if slots else 0], np.int64)
        req = self.ctl.Iallgather([mine, MPI.INT64_T], [tokens, MPI.INT64_T])
        self._wait([req], "init", self.peers, check_notices=False)
        ok = np.array([bool(slots and all(tokens) and slots.sees(tokens.tolist()))], np.int8)
        verdicts = np.zeros(self.size, np.int8)
        req = self.ctl.Iallgather([ok, MPI.INT8_T], [verdicts, MPI.INT8_T])
        self._wait([req], "init", self.peers, check_notices=False)
        if slots is not None:
            slots.remove_probe()  # every rank has looked at it
            if not verdicts.all():
                slots.close()
                slots = None
        return slots

    def _set_topology(self):
        hosts = self.hosts
        me = hosts[self.rank]
        self.local_rank = sum(1 for r in range(self.rank) if hosts[r] == me)
        self.local_size = hosts.count(me)
        local_ranks = [sum(1 for q in range(r) if hosts[q] == hosts[r]) for r in range(self.size)]
        same_local = [r for r in range(self.size) if local_ranks[r] == self.local_rank]
        self.cross_rank = same_local.index(self.rank)
        self.cross_size = len(same_local)
        # The ring visits each host's ranks together (hosts in order of their first rank, ranks
        # in order within a host), so it crosses the network once per host whatever the
        # launcher's placement (Hydra's -hosts a,b deals ranks round-robin: 0,2 on a, 1,3 on b).
        first = {}
        for r, host in enumerate(hosts):
            first.setdefault(host, r)
        self.ring_order = sorted(range(self.size), key=lambda r: (first[hosts[r]], r))
        self.ring_pos = self.ring_order.index(self.rank)

    def _eager_buffers(self):
        # Receive buffers (one per peer) and the send buffer of the agreement message. Reused by
        # every collective: negotiate() returns only after its sends completed, and callers
        # consume the received payloads before the next collective.
        capacity = HEADER_BYTES + self.config.eager_bytes
        self._eager = {p: bytearray(capacity) for p in self.peers}
        self._sendbuf = bytearray(capacity)
        # Persistent receives for the headers: started by every collective, rebuilt at resync.
        self._free_persistent()
        self._header_recvs = [self.comm.Recv_init(self._eager[p], p, TAG_HEADER) for p in self.peers]

    def _free_persistent(self):
        for req in getattr(self, "_header_recvs", ()):
            try:
                if not req.Test():
                    req.Cancel()
                    req.Wait()
                req.Free()
            except self.MPI.Exception:  # pragma: no cover - already freed with its communicator
                pass
        self._header_recvs = []

    def close(self):
        """Release the communicators (local in MPICH and Open MPI: it does not wait for peers)."""
        MPI = self.MPI
        for req in [self._notice_req] + self._notice_sends + self._inflight + self._drains:
            self._discard(req)
        for reqs, _ in self._abandoned:
            for req in reqs:
                self._discard(req)
        self._abandoned.clear()
        self._free_persistent()
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        for comm in (self.comm, self.ctl):
            if comm != MPI.COMM_NULL:
                try:
                    comm.Free()
                except MPI.Exception:  # pragma: no cover - freeing is best effort at shutdown
                    pass

    # ------------------------------------------------------------------ waiting
    def _wait(self, reqs, what, peers_of, check_notices=True, missing=None):
        """Wait for every request, polling from Python so that signals are handled.

        ``peers_of[i]`` is the rank request ``i`` waits on, used to name missing ranks, unless
        ``missing`` (a function returning the ranks) says better.
        """
        Testall = self.MPI.Request.Testall
        if Testall(reqs):
            return
        if missing is None:
            missing = lambda: self._missing(reqs, peers_of)  # noqa: E731
        self.poll(lambda: Testall(reqs), what, missing, check_notices)

    def poll(self, done, what, missing, check_notices=True, spin_yield=False):
        """Call ``done()`` until it is true: spin briefly, then back off (signals are handled).

        A peer's RESYNC notice raises ``_Restart``; after ``stall_timeout`` ``StallError`` names
        the ranks that ``missing()`` returns.
        """
        start = time.perf_counter()
        spin_until = start + _SPIN_SECONDS
        while time.perf_counter() < spin_until:
            if done():
                return
            if spin_yield:
                os.sched_yield()
        config = self.config
        warned = False
        delay = 1e-5
        named = -1.0  # when the ranks waited on were last told to the activity record (%ring where)
        while True:
            if done():
                if warned:
                    reporter.stalled(None, (), 0.0)
                activity.waiting(())
                return
            if check_notices and self._poll_notices() > self.gen:
                raise _Restart()
            waited = time.perf_counter() - start
            if waited - named >= 0.25:
                named = waited
                activity.waiting(missing())
            if waited > config.stall_warning and not warned:
                warned = True
                absent = missing()
                log.warning("jupyter_ring: rank %d has waited %.0f s in %s for rank(s) %s",
                            self.rank, waited, what, absent)
                reporter.stalled(what, absent, waited)
            if waited > config.stall_timeout:
                absent = missing()
                reporter.stalled(None, (), 0.0)
                raise StallError(
                    f"{what}: rank {self.rank} waited {waited:.1f} s for rank(s) {absent}, which never "
                    f"arrived (stall timeout {config.stall_timeout:g} s). Every rank must call the same "
                    "collectives in the same order; a rank that raised, skipped a call or died leaves "
                    "the others waiting. Raise JUPYTER_RING_STALL_TIMEOUT if a rank is just slow.",
                    absent)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    @staticmethod
    def _missing(reqs, peers_of):
        return sorted({peers_of[i] for i, req in enumerate(reqs) if not req.Test()})

    def _poll_notices(self):
        """Collect RESYNC notices; return the highest generation any peer asked for."""
        MPI = self.MPI
        status = MPI.Status()
        while self._notice_req.Test(status):
            self._notices.setdefault(int(self._notice_buf[0]), set()).add(status.Get_source())
            self._notice_req = self.ctl.Irecv([self._notice_buf, MPI.INT64_T], MPI.ANY_SOURCE, TAG_RESYNC)
        return max(self._notices, default=0)

    def _discard(self, req):
        MPI = self.MPI
        if req == MPI.REQUEST_NULL:
            return
        try:
            if not req.Test():
                req.Cancel()
                req.Free()
        except MPI.Exception:  # pragma: no cover - a request that completed with an error
            pass

    # ------------------------------------------------------------------ resync
    def resync(self):
        """Move every rank to a fresh data communicator (polled Idup on the control comm)."""
        MPI = self.MPI
        target = self.gen + 1
        if self._pending_dup is None:
            note = np.array([target], np.int64)
            self._keep.append(note)
            self._notice_sends = [self.ctl.Isend([note, MPI.INT64_T], p, TAG_RESYNC) for p in self.peers]
            self._pending_dup = self.ctl.Idup()
        newcomm, req = self._pending_dup
        peers = self.peers
        def not_announced():
            self._poll_notices()
            return [p for p in peers if p not in self._notices.get(target, set())]

        try:
            self._wait([req], "resync after an abandoned collective", [], check_notices=False,
                       missing=not_announced)
        except StallError:
            self._poll_notices()
            arrived = self._notices.get(target, set())
            missing = [p for p in peers if p not in arrived]
            raise StallError(
                f"resync: rank {self.rank} waited for rank(s) {missing} to recover from the previous "
                "failed collective; they have not called a collective since. Call the next collective "
                "on every rank (or restart the cluster with %ring restart).", missing) from None
        self._pending_dup = None
        old = self.comm
        for reqs, _ in self._abandoned + [(self._drains, None)]:
            for r in reqs:
                self._discard(r)
        self._abandoned.clear()
        self._drains = []
        self._keep.clear()
        self.comm = newcomm
        self.gen = target
        self.dirty = False
        self._notices = {t: s for t, s in self._notices.items() if t > target}
        self._eager_buffers()
        try:
            old.Free()
        except MPI.Exception:  # pragma: no cover
            pass

    def _abandon(self):
        self._abandoned.append((self._inflight, self._keep[:]))
        self._inflight = []
        self.dirty = True

    def run(self, fn, *args):
        """Run one collective with agreement, recovery and retries after a peer's resync."""
        try:
            return self._run(fn, *args)
        finally:
            activity.end()

    def _run(self, fn, *args):
        for _attempt in range(5):
            if self.dirty or self._poll_notices() > self.gen:
                self.resync()
            self.partial = False
            try:
                result = fn(*args)
            except _Restart:
                self._abandon()
                if self.partial:
                    raise RingError(
                        "a peer gave up this collective (interrupted, failed or timed out) after this "
                        "rank had written part of the result into its input tensor (in place), so it "
                        "cannot be retried: the tensor now holds partial results. Recompute it and "
                        "call the collective again on every rank.") from None
                continue
            except (CollectiveMismatchError, PeerError):
                self._inflight = []  # every header and description was consumed: nothing in flight
                raise
            except BaseException:
                self._abandon()
                raise
            self._inflight = []
            return result
        raise RingError("a collective was restarted 5 times by peers' resyncs; the ranks are not "
                        "calling the same collectives. Restart the cluster (%ring restart).")

    # ------------------------------------------------------------------ agreement
    def negotiate(self, kind, name, array, op, root, count, desc, aux=0, payload=None, per_peer=None):
        """Exchange headers (and eager payloads) with every peer and check agreement.

        ``desc`` is the tuple fingerprinted for agreement (shape, scales, explicit name ...).
        ``payload`` is a byte view sent along when it fits ``eager_bytes``; ``per_peer`` maps a
        peer to its own ``(aux, payload)`` (alltoall). Returns a dict peer -> (aux, payload view
        or None) for every peer.
        """
        activity.begin(kind, name)
        comm = self.comm
        key = (kind, array.dtype if array is not None else None, op, root, count, desc)
        own = self._agree_cache.get(key)
        if own is None:
            if len(self._agree_cache) > 4096:
                self._agree_cache.clear()
            dtype_code = DTYPE_CODE.get(array.dtype, 255) if array is not None else 255
            own = self._agree_cache[key] = _AGREE.pack(KIND_CODE[kind], dtype_code, op, root, count,
                                                       _fingerprint(*desc))
        self.seq += 1
        peers = self.peers
        recvs = self._header_recvs
        self.MPI.Prequest.Startall(recvs)
        if per_peer is None:
            message = self._message(self._sendbuf, own, aux, payload)
            sends = [comm.Isend(message, p, TAG_HEADER) for p in peers]
        else:
            sends = []
            for p in peers:
                peer_aux, data = per_peer[p]
                buf = bytearray(HEADER_BYTES + (data.nbytes if data is not None else 0))
                self._keep.append(buf)
                sends.append(comm.Isend(self._message(buf, own, peer_aux, data), p, TAG_HEADER))
        reqs = recvs + sends
        self._inflight = sends  # the persistent receives are cancelled by resync, not _abandon
        self._wait(reqs, f"{kind} '{name}'", peers + peers)
        self._keep.clear()

        result = {}
        mismatch = False
        for p in self.peers:
            buf = self._eager[p]
            view = memoryview(buf)
            if view[:_AGREE_END] != own:
                mismatch = True
            flags, _gen, _seq, peer_aux = _TAIL.unpack_from(buf, _AGREE_END)
            result[p] = (peer_aux, view[HEADER_BYTES:] if flags & FLAG_PAYLOAD else None)
        if mismatch:
            self._raise_poison(kind, name)
            self._explain_mismatch(kind, name, array, op, root, desc)
        return result

    def poison(self, kind, name, exc):
        """This rank cannot join ``kind`` (bad arguments): tell every peer why, without waiting.

        Peers waiting in the collective raise ``PeerError`` at once instead of stalling. Their
        headers for it are drained by receives posted now: MPI matches a source's messages to
        receives in posting order, so the next collective's receives get the next headers and
        the communicator stays clean without a resync.
        """
        if self.size == 1:
            return
        self._drains = [req for req in self._drains if not req.Test()]
        text = f"{type(exc).__name__}: {exc}".encode()[:len(self._sendbuf) - HEADER_BYTES]
        own = _AGREE.pack(POISON, 255, 0, -1, 0, _fingerprint(kind, name))
        self.seq += 1
        buf = bytearray(HEADER_BYTES + len(text))
        message = self._message(buf, own, len(text), np.frombuffer(text, np.uint8))
        capacity = len(self._sendbuf)
        for p in self.peers:
            self._drains.append(self.comm.Isend(message, p, TAG_HEADER))
            self._drains.append(self.comm.Irecv(bytearray(capacity), p, TAG_HEADER))

    def _raise_poison(self, kind, name):
        for p in self.peers:
            buf = self._eager[p]
            if buf[0] == POISON:
                flags, _gen, _seq, nbytes = _TAIL.unpack_from(buf, _AGREE_END)
                reason = bytes(buf[HEADER_BYTES:HEADER_BYTES + nbytes]).decode(errors="replace")
                raise PeerError(
                    f"{collective_title(kind, name)}: rank {p} could not join this collective and raised {reason}. "
                    f"Fix the call on rank {p}; every rank raises here so that none is left waiting.",
                    p, reason)

    def fits_eager(self, nbytes):
        """Whether a payload travels inside the agreement message (capacity fixed at init/resync)."""
        return HEADER_BYTES + nbytes <= len(self._sendbuf)

    def _message(self, buf, own, aux, data):
        """Header (+ payload when it fits ``eager_bytes``) packed into ``buf``; a view to send."""
        # capacity was fixed at init/resync, the same on every rank
        flags = FLAG_PAYLOAD if data is not None and self.fits_eager(data.nbytes) else 0
        buf[:_AGREE_END] = own
        _TAIL.pack_into(buf, _AGREE_END, flags, self.gen, self.seq, aux)
        if not flags:
            return memoryview(buf)[:HEADER_BYTES]
        end = HEADER_BYTES + data.nbytes
        np.frombuffer(buf, np.uint8, data.nbytes, HEADER_BYTES)[:] = data
        return memoryview(buf)[:end]

    def _explain_mismatch(self, kind, name, array, op, root, desc):
        """Slow path: exchange full descriptions so every rank raises the same precise error."""
        mine = {"kind": kind, "name": name, "op": OP_NAMES.get(op, op), "root": root,
                "dtype": str(array.dtype) if array is not None else None, "desc": desc}
        comm = self.comm
        data = pickle.dumps(mine)
        if len(data) > _DESC_BYTES:  # a huge group: describe its first tensors only
            mine["desc"] = tuple((label, value if label != "tensors" else value[:100]) for label, value in desc)
            data = pickle.dumps(mine)[:_DESC_BYTES]
        bufs = {p: bytearray(_DESC_BYTES) for p in self.peers}
        recvs = [comm.Irecv(bufs[p], p, TAG_DESC) for p in self.peers]
        sends = [comm.Isend(data, p, TAG_DESC) for p in self.peers]
        self._inflight = recvs + sends
        self._keep.append(data)
        self._wait(recvs + sends, f"{kind} '{name}' (comparing descriptions)", self.peers + self.peers)
        descs = {self.rank: mine}
        for p in self.peers:
            descs[p] = pickle.loads(bufs[p])  # pickle stops at its STOP opcode: padding is ignored
        raise CollectiveMismatchError(describe_mismatch(descs))

    # ------------------------------------------------------------------ waits on data
    def _wait_data(self, reqs, what, peer):
        self._wait(reqs, what, [peer] * len(reqs))

    def scratch(self, nbytes):
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = np.empty(max(nbytes, 1), np.uint8)
        return self._scratch[:nbytes]


def collective_title(kind, name):
    """``allreduce 'fc1.weight'`` for a user's name; ``allreduce (unnamed)`` for the name the
    runtime made up (``allreduce.noname.3``), which only adds noise to a message."""
    if name.startswith(f"{kind}.noname."):
        return f"{kind} (unnamed)"
    return f"{kind} '{name}'"


def describe_mismatch(descs):
    """One message naming the op, the ranks and the values that differ."""
    ranks = sorted(descs)
    ref = descs[ranks[0]]
    title = collective_title(ref["kind"], ref["name"])
    for field, label in (("kind", "called"), ("name", "name"), ("dtype", "dtype"), ("op", "reduce op"),
                         ("root", "root rank")):
        values = {r: descs[r][field] for r in ranks}
        if len(set(map(repr, values.values()))) > 1:
            return _differ(title, label, values, _hint(label))
    # desc tuples: first element is a tuple of labelled fields
    for index, (label, _value) in enumerate(ref["desc"]):
        values = {}
        for r in ranks:
            entries = descs[r]["desc"]
            values[r] = entries[index][1] if index < len(entries) else None
        if len(set(map(repr, values.values()))) > 1:
            return _differ(title, label, values, _hint(label))
    lengths = {r: len(descs[r]["desc"]) for r in ranks}
    return _differ(title, "description length", lengths, _hint(""))


def _fmt(value):
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return "(" + ", ".join(map(str, value)) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, str):
        return value
    return repr(value)


def _differ(title, label, values, hint):
    groups = {}
    for r, value in values.items():
        groups.setdefault(_fmt(value), []).append(r)
    parts = [f"{value} on {_ranks(rs)}" for value, rs in groups.items()]
    text = f"{title}: {label} {parts[0]} but " + ", ".join(parts[1:])
    return text + ". " + hint


def _ranks(rs):
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _hint(field):
    return {
        "called": "Every rank must call the same collectives in the same order.",
        "name": "Every rank must pass the same name= to the same collective.",
        "dtype": "Cast the tensor to one dtype on every rank before the collective.",
        "shape": "Every rank must pass a tensor of the same shape (allgather: same trailing dims).",
        "number of tensors": "Every rank must pass the same number of tensors.",
        "root rank": "Pass the same root_rank on every rank.",
        "reduce op": "Pass the same op= on every rank.",
        "trailing shape": "allgather/alltoall tensors may differ in dim 0 only; the other dims must match.",
    }.get(field, "Every rank must call the collective with the same arguments.")

"""What travels in the agreement message: ops, kinds, dtypes, the header's layout and tags, and
the records read from it (``PeerMsg``, ``JoinNote``, ``Prepared``).

Every collective starts with a 56-byte header to every peer (``core``'s step 1): the 24 bytes of
``AGREE`` every rank must send alike (kind, dtype, op, root, count, fingerprint), then the
``TAIL`` each rank fills with its own values. The runtime's pieces (``headers``, ``agreement``,
``recovery``, ``core``) and the algorithm bodies read and write it through the names here.
"""

from __future__ import annotations

import struct
import zlib
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["Sum", "Average", "Min", "Max", "Product", "Adasum", "OP_NAMES", "KINDS", "KIND_CODE",
           "POISON", "JOIN", "HELD", "DTYPES", "DTYPE_CODE", "AGREE", "TAIL", "HEADER_BYTES",
           "AGREE_END", "FLAG_PAYLOAD", "TAG_HEADER", "TAG_DATA", "TAG_DESC", "TAG_RESYNC", "TAG_AGREE_LOG",
           "TAG_POISON", "TAG_PRESENT", "Desc",
           "Kept", "PeerMsg", "Prepared", "JoinNote", "fingerprint", "reducer"]

# Reduce ops (Horovod's names; Adasum is named so that ported code gets a clear error).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

KINDS = ("allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "barrier",
         "broadcast_object", "allgather_object", "resync", "timeline", "error", "join",
         "process_set")
POISON = 10  # KIND_CODE["error"]: "I failed before I could join; here is why"
JOIN = 11    # KIND_CODE["join"]: "I have called join(): leave me out until every rank has"
KIND_CODE = {kind: code for code, kind in enumerate(KINDS)}

# Requests given up while still active (persistent header sends: see Recovery.discard), kept
# with the buffers they send from until the process exits. A peer may still drain the message,
# or MPI_Finalize flush it, and MPI then reads the buffer; mpi4py frees a request's buffer with
# the request object, so dropping one (at close, or when the cached sends are rebuilt) let MPI
# read freed memory: a rank that had passed every check crashed at exit (SIGSEGV, seen once in
# CI after rt_abandon's abandoned rounds). A handful per abandoned round: never freed.
HELD: list[MPI.Prequest] = []

DTYPES = [np.dtype(t) for t in (
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128)]
DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}

# kind, dtype, op, pad, root, count, fingerprint: the region every rank must agree on ...
AGREE = struct.Struct("<BBBxiqQ")
# ... then flags, generation, pending (entries of the sender's round from this collective on:
# the engine's cut, see Recut; a JOIN notice puts its shared-memory tick here), aux (per-rank
# value: rows, bytes, shared-memory offer; a JOIN notice: its collective count) and region (an
# in-place allreduce of registered memory: where the tensor lies, for the peers to map; else 0).
HEADER = struct.Struct("<BBBxiqQBxxxIqqq")
TAIL = struct.Struct("<BxxxIqqq")
HEADER_BYTES = HEADER.size
AGREE_END = AGREE.size
FLAG_PAYLOAD = 1

TAG_HEADER, TAG_DATA, TAG_DESC, TAG_RESYNC = 11, 12, 13, 14
# the agreement in log2(n) steps (``log_agreement``): its relayed headers, the poison that goes
# to every peer directly there (a waiting rank probes for it), and the presence notes of a long wait
TAG_AGREE_LOG, TAG_POISON, TAG_PRESENT = 15, 16, 17

# What the ranks agree on, labelled (("name", ...), ("shape", ...)): fingerprinted into the
# header, and compared field by field to explain a mismatch. A collective may pass a function
# that makes it (only read on a mismatch) when it passes the packed agreement too.
Desc = tuple[tuple[str, object], ...]
# a send buffer kept until its request completes: a header, a pickled description, a notice
Kept = bytearray | bytes | npt.NDArray[np.int64]


class PeerMsg(NamedTuple):
    """What a peer sent in the agreement exchange, besides the agreed fields."""

    aux: int                 # per-rank value: rows (allgather), bytes, shared-memory offer
    payload: memoryview | None  # the eager payload, or None
    region: int              # the tensor's registered memory (SharedSlots.locate), or 0


class Prepared(NamedTuple):
    """The header exchange of one eager signature, made once (``Agreement.prepare``): what a
    prepared lane sends and where it finds the peers' headers, valid while ``wiring`` is the
    runtime's (a resync, a join or a change of the header requests makes a new wiring)."""

    wiring: int              # HeaderBuffers.wiring when prepared
    header: bytes            # the whole header this rank sends on this signature (pending 1)
    reqs: list[MPI.Prequest]  # the persistent header receives of the active peers, then the sends
    sends: list[MPI.Prequest]  # the persistent sends alone (what an interrupt abandons)
    peer_headers: tuple[memoryview, ...]  # each active peer's received header, a view into its eager buffer
    expected: tuple[bytes, ...]  # the whole header each active peer sends on it (allreduce: ``header``)

    @property
    def agreement(self) -> bytes:
        """The 24 bytes every rank sends alike on this exchange (``Agreement.own``)."""
        return self.header[:AGREE_END]


class JoinNote(NamedTuple):
    """A peer's join notice: how many collectives it had run since the last join, and its shared-memory tick."""

    collectives: int
    tick: int


def fingerprint(*parts: object) -> int:
    """64 bits of ``parts``' repr: the agreement's fingerprint of what else the ranks must agree on."""
    text = repr(parts).encode()
    return (zlib.crc32(text) << 32) | zlib.adler32(text)


def reducer(op: int, dtype: np.dtype) -> np.ufunc:
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


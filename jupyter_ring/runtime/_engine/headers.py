"""The agreement message's buffers and requests: one eager receive buffer per peer and the send
buffer, the persistent header receives and sends, packing a header (and its eager payload), and
numpy views of the payload regions.

Reused by every collective: ``Agreement.negotiate`` returns only after its sends completed, and
callers consume the received payloads before the next collective. Made at init and at every
resync (``build``); ``wiring`` counts the changes, so that a prepared exchange (``Prepared``)
knows when the requests it holds are no longer the runtime's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from .wire import AGREE_END, FLAG_PAYLOAD, HEADER_BYTES, HELD, TAG_HEADER, TAIL

if TYPE_CHECKING:
    from mpi4py import MPI

    from .core import Runtime

__all__ = ["HeaderBuffers"]


class HeaderBuffers:
    """The eager buffers and header requests of one runtime, on its present data communicator."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.eager: dict[int, bytearray] = {}  # peer -> its receive buffer (header + eager payload)
        self.sendbuf = bytearray()
        self.eager_limit = rt.config.eager_bytes
        self.recv: dict[int, MPI.Prequest] = {}  # peer -> persistent header receive
        self.recvs: list[MPI.Prequest] = []     # ... of the active peers
        # message length -> persistent sends of the header buffer, per active peer
        self.sends: dict[int, list[MPI.Prequest]] = {}
        self.waits_on = rt.peers + rt.peers  # the peer of each request of an exchange (receives, sends, joined)
        # numpy views of these buffers: (dtype, count) -> payload_view, (peer, dtype, count) -> peer_payload
        self._views: dict[tuple[np.dtype, int] | tuple[int, np.dtype, int], np.ndarray] = {}
        self.wiring = 0           # +1 whenever header buffers, requests or active peers change (Prepared)

    def build(self) -> None:
        """Make the buffers and the persistent receives on the runtime's data communicator (at
        init and at every resync): their capacity, ``eager_bytes``, is fixed until the next."""
        rt = self.rt
        capacity = HEADER_BYTES + rt.config.eager_bytes
        self.eager = {p: bytearray(capacity) for p in rt.peers}
        self.sendbuf = bytearray(capacity)
        # relayed headers carry no payload (log_agreement): small data goes by recursive doubling
        self.eager_limit = rt.config.eager_bytes if rt.agreement.gather is None else -1
        if rt.agreement.gather is not None:
            rt.agreement.gather.restart()
        self._views = {}
        # Persistent receives for the headers: started by every collective, rebuilt at resync.
        self.free()
        self.recv = {p: rt.comm.Recv_init(self.eager[p], p, TAG_HEADER) for p in rt.peers}
        self.recvs = [self.recv[p] for p in rt.active]

    def follow(self, active: list[int], joined: list[int]) -> None:
        """The active peers changed (a join, a resync): exchange headers with ``active`` only."""
        self.waits_on = active + active + joined  # negotiate's requests' peers
        self.recvs = [self.recv[p] for p in active]
        self.free_sends()

    def sends_for(self, message: memoryview) -> list[MPI.Prequest]:
        """Persistent sends of the header buffer's first ``len(message)`` bytes to every active
        peer, made once per message length (a loop's collectives reuse theirs: no request is
        built per call) and freed when the buffers or the active peers change."""
        if len(self.sends) >= 64:
            self.free_sends()
        sends = self.sends[len(message)] = [self.rt.comm.Send_init(message, p, TAG_HEADER)
                                            for p in self.rt.active]
        return sends

    def free_sends(self) -> None:
        """Free the persistent sends (an active one, an abandoned round's, is held: see wire.HELD)."""
        # every prepared exchange holds these requests (or the buffers and peers they follow)
        self.wiring += 1
        MPI = self.rt.MPI
        for sends in self.sends.values():
            for req in sends:
                try:
                    if req.Test():
                        req.Free()
                    else:  # an abandoned round's, still active: its buffer must outlive it
                        HELD.append(req)
                except MPI.Exception:  # pragma: no cover - freed with its communicator
                    pass
        self.sends = {}

    def free(self) -> None:
        """Cancel and free the persistent receives, and free the sends."""
        MPI = self.rt.MPI
        for req in self.recv.values():
            try:
                if not req.Test():
                    req.Cancel()
                    req.Wait()
                req.Free()
            except MPI.Exception:  # pragma: no cover - already freed with its communicator
                pass
        self.recvs = []
        self.recv = {}
        self.free_sends()

    def fits_eager(self, nbytes: int) -> bool:
        """Whether a payload travels inside the agreement message (capacity fixed at init/resync)."""
        return nbytes <= self.eager_limit

    def message(self, buf: bytearray, own: bytes, aux: int, data: npt.NDArray[np.uint8] | None,
                pending: int = 1, region: int = 0, preset: int | None = None) -> memoryview:
        """Header (+ payload when it fits ``eager_bytes``) packed into ``buf``; a view to send.

        ``data`` is a byte array copied in; or ``preset`` is the size of a payload the caller wrote
        into ``payload_view()`` already (a fused batch gathers its members there, no extra copy).
        """
        nbytes = preset if preset is not None else (data.nbytes if data is not None else -1)
        # capacity was fixed at init/resync, the same on every rank
        flags = FLAG_PAYLOAD if 0 <= nbytes <= self.eager_limit else 0
        buf[:AGREE_END] = own
        TAIL.pack_into(buf, AGREE_END, flags, self.rt.gen, pending, aux, region)
        if not flags:
            return memoryview(buf)[:HEADER_BYTES]
        if preset is None:
            assert data is not None  # nbytes is data's (a payload is flagged)
            np.frombuffer(buf, np.uint8, nbytes, HEADER_BYTES)[:] = data
        return memoryview(buf)[:HEADER_BYTES + nbytes]

    def payload_view(self, dtype: np.dtype, count: int) -> np.ndarray:
        """The send buffer's payload region as ``count`` items of ``dtype`` (for ``preset``).

        Views are kept per (dtype, count) until the buffers change (resync): an allreduce made in
        a loop does not build its views again.
        """
        key = (dtype, count)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 256:
                self._views.clear()
            view = self._views[key] = np.frombuffer(self.sendbuf, dtype, count, HEADER_BYTES)
        return view

    def peer_payload(self, peer: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Peer ``peer``'s eager payload as ``count`` items of ``dtype`` (kept like payload_view)."""
        key = (peer, dtype, count)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 256:
                self._views.clear()
            view = self._views[key] = np.frombuffer(self.eager[peer], dtype, count, HEADER_BYTES)
        return view

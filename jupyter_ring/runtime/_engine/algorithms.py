"""Allreduce algorithms over point-to-point messages besides the ring: recursive doubling and the
hierarchy of hosts (issue 33, item 2; which one runs is ``_algorithm_choice``'s).

Each body runs after the header-only agreement of ``_collectives._large``, on the data
communicator, with every wait through ``Waiter.wait`` (interruptible, stall-checked, its
requests in ``rt.inflight`` so that an abandoned collective's messages are left behind with the
old communicator at the resync). Each element is computed once, or by both ranks of a pair in the
same order (IEEE addition, multiplication, min and max are commutative), so every rank ends
bit-identical, as on the other paths; the order of the terms differs from the eager path's rank
order, so results of different algorithms may differ in the last bits of a float.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import numpy.typing as npt

from . import algorithm_choice as choice
from .core import Runtime
from .wire import TAG_DATA

if TYPE_CHECKING:  # importing mpi4py.MPI initialises MPI: the runtime does that itself
    from mpi4py import MPI

__all__ = ["recursive_doubling", "hierarchical", "group_ring", "uniform_hosts", "eager_limit", "algorithm", "BODIES"]

Array: TypeAlias = npt.NDArray[Any]
Phases: TypeAlias = dict[str, tuple[float, float]]

# Tags of their own: a message of one algorithm never matches a receive of another
TAG_RD, TAG_RS, TAG_AG = TAG_DATA + 30, TAG_DATA + 31, TAG_DATA + 32
_TAG_STEP = 3  # a group_ring of the cross-host step adds this to its tags (the local ring's differ)


def _bytes(arr: Array) -> npt.NDArray[np.uint8]:
    return arr.view(np.uint8)


def _finish(arr: Array, postscale: float, divisor: int) -> None:
    if postscale != 1.0:
        np.multiply(arr, arr.dtype.type(postscale), out=arr)
    if divisor != 1:
        np.floor_divide(arr, divisor, out=arr)


def _exchange(rt: Runtime, send: Array | None, recv: Array | None, peer: int, tag: int, what: str) -> None:
    """Send ``send`` to and/or receive ``recv`` from ``peer``, waiting for both (interruptible)."""
    comm = rt.comm
    reqs: list[MPI.Request] = []
    if recv is not None:
        reqs.append(comm.Irecv(_bytes(recv), peer, tag))
    if send is not None:
        reqs.append(comm.Isend(_bytes(send), peer, tag))
    _track(rt, reqs)
    rt.waits.wait(reqs, what, [peer] * len(reqs))


def _track(rt: Runtime, reqs: list[MPI.Request]) -> None:
    """Count ``reqs`` among the collective's requests (an interrupt abandons them at the resync)."""
    inflight = rt.inflight
    if isinstance(inflight, list):  # this collective's own (``_start``): grown in place
        inflight.extend(reqs)
    else:
        rt.inflight = [*inflight, *reqs]


def _start(rt: Runtime, src: Array, dst: Array, aliased: bool) -> None:
    """``dst`` holds this rank's (prescaled) input; from here on the caller's memory is written."""
    rt.inflight = []
    if src is not dst:
        np.copyto(dst, src)
    rt.partial = aliased  # dst is the caller's input in place: no retry (Runtime.run)


def recursive_doubling(rt: Runtime, src: Array, dst: Array, fn: np.ufunc, postscale: float, divisor: int,
                       name: str, phases: Phases, aliased: bool = False) -> None:
    """Allreduce ``src`` into ``dst`` over ``rt.participants`` by recursive doubling: ``⌈log2 n⌉``
    exchanges of the whole payload with the rank whose index differs in one bit."""
    t0 = time.perf_counter()
    _start(rt, src, dst, aliased)
    _rd(rt, rt.participants, dst, fn, f"allreduce '{name}' (recursive doubling)", phases, "rd")
    _finish(dst, postscale, divisor)
    phases["rd"] = (t0, time.perf_counter())


def _rd(rt: Runtime, group: Sequence[int], buf: Array, fn: np.ufunc, what: str, phases: Phases,
        label: str, tag: int = TAG_RD) -> None:
    """Recursive doubling of ``buf`` in place over ``group`` (this rank's index in it: ``i``).

    ``n`` not a power of two (``p`` the largest power below, ``extra = n - p``): the first
    ``2·extra`` ranks pair up, the even one sends its data to the odd one and waits (fold in);
    ``p`` ranks double; each odd one of the first pairs sends the result back (fold out). Both
    ranks of an exchange reduce (lower index's term, higher's) into their buffers: the same bits.
    """
    n = len(group)
    i = group.index(rt.rank)
    if n == 1 or buf.size == 0:
        return
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    tmp = rt.scratch(buf.nbytes).view(buf.dtype)
    if i < 2 * extra and i % 2 == 0:  # folded in: its partner reduces for it
        t = time.perf_counter()
        _exchange(rt, buf, None, group[i + 1], tag, what)
        _exchange(rt, None, buf, group[i + 1], tag, what)
        phases[f"{label} folded into {group[i + 1]}"] = (t, time.perf_counter())
        return
    if i < 2 * extra:
        t = time.perf_counter()
        _exchange(rt, None, tmp, group[i - 1], tag, what)
        fn(tmp, buf, out=buf)  # the even rank's term first
        phases[f"{label} fold in from {group[i - 1]}"] = (t, time.perf_counter())
        me = i // 2
    else:
        me = i - extra
    mask = 1
    step = 0
    while mask < p:
        t = time.perf_counter()
        other = me ^ mask
        peer = group[2 * other + 1 if other < extra else other + extra]
        _exchange(rt, buf, tmp, peer, tag, what)
        if other < me:
            fn(tmp, buf, out=buf)
        else:
            fn(buf, tmp, out=buf)
        phases[f"{label}[{step}] with {peer}{_network(rt, peer)}"] = (t, time.perf_counter())
        mask <<= 1
        step += 1
    if i < 2 * extra:
        _exchange(rt, buf, None, group[i - 1], tag, what)


def _network(rt: Runtime, peer: int) -> str:
    return f" @ {rt.hosts[peer]} (network)" if rt.hosts[peer] != rt.hosts[rt.rank] else ""


def group_ring(rt: Runtime, group: Sequence[int], buf: Array, fn: np.ufunc, what: str, phases: Phases,
               label: str, reduce_scatter: bool = True, allgather: bool = True, tag: int = TAG_RS) -> None:
    """Ring reduce-scatter and/or allgather of ``buf`` in place over ``group`` (in its order).

    Block ``j`` is ``buf``'s ``j``-th of ``len(group)`` even blocks. Reduce-scatter step ``s``:
    the rank at index ``i`` sends block ``i-s`` to the right and reduces block ``i-s-1`` from the
    left into its own; after ``n-1`` steps it holds block ``i+1`` complete (each element computed
    once, along the ring). Allgather step ``s``: it sends block ``i+1-s`` and receives block
    ``i-s``. Each step waits for its send and receive: a block written at step ``s`` was sent at
    an earlier one.
    """
    n = len(group)
    if n == 1 or buf.size == 0:
        return
    i = group.index(rt.rank)
    left, right = group[(i - 1) % n], group[(i + 1) % n]
    bounds = [buf.size * j // n for j in range(n + 1)]

    def block(j: int) -> Array:
        j %= n
        return buf[bounds[j]:bounds[j + 1]]

    if reduce_scatter:
        widest = max(bounds[j + 1] - bounds[j] for j in range(n))
        tmp = rt.scratch(widest * buf.itemsize).view(buf.dtype)
        for s in range(n - 1):
            t = time.perf_counter()
            into = block(i - s - 1)
            got = tmp[:into.size]
            _exchange2(rt, block(i - s), right, got, left, tag, what)
            fn(got, into, out=into)
            phases[f"{label} reduce_scatter[{s}] from {left}{_network(rt, left)}"] = (t, time.perf_counter())
    if allgather:
        for s in range(n - 1):
            t = time.perf_counter()
            _exchange2(rt, block(i + 1 - s), right, block(i - s), left, tag + 1, what)
            phases[f"{label} allgather[{s}] from {left}{_network(rt, left)}"] = (t, time.perf_counter())


def _exchange2(rt: Runtime, send: Array, to: int, recv: Array, frm: int, tag: int, what: str) -> None:
    """Send ``send`` to ``to`` and receive ``recv`` from ``frm``, waiting for both (interruptible)."""
    comm = rt.comm
    reqs = [comm.Irecv(_bytes(recv), frm, tag), comm.Isend(_bytes(send), to, tag)]
    _track(rt, reqs)
    rt.waits.wait(reqs, what, [frm, to])


def uniform_hosts(rt: Runtime, group: Sequence[int]) -> list[list[int]] | None:
    """``group``'s ranks by host (hosts in order of their first rank, ranks in order), or None
    when the hosts do not run as many of them each (the hierarchy needs equal slices)."""
    by_host: dict[str, list[int]] = {}
    for q in group:
        by_host.setdefault(rt.hosts[q], []).append(q)
    hosts = list(by_host.values())
    return hosts if len({len(h) for h in hosts}) == 1 else None


def hierarchical(rt: Runtime, src: Array, dst: Array, fn: np.ufunc, postscale: float, divisor: int,
                 name: str, phases: Phases, aliased: bool = False) -> None:
    """Allreduce ``src`` into ``dst`` by hosts (Horovod's hierarchical allreduce, on messages).

    Inside each host a ring reduce-scatter leaves local rank ``l`` with slice ``l+1`` of its
    host's sum; the ranks holding the same slice on every host (one per host) allreduce it:
    recursive doubling up to ``RD_MAX_BYTES``, a ring above; a ring allgather inside each host
    gives every rank the whole result. Only a ``1/L`` slice crosses the network from each rank.
    Needs as many participating ranks on every host (``uniform_hosts``): ``choose`` asks for it.
    """
    t0 = time.perf_counter()
    hosts = uniform_hosts(rt, rt.participants)
    if hosts is None:  # (``algorithm`` runs a ring there instead)
        raise ValueError(f"allreduce '{name}': the hierarchical allreduce needs as many ranks on every host")
    _start(rt, src, dst, aliased)
    what = f"allreduce '{name}' (hierarchical)"
    local = next(h for h in hosts if rt.rank in h)
    size = len(local)
    li = local.index(rt.rank)
    group_ring(rt, local, dst, fn, what, phases, "host", allgather=False)
    t1 = time.perf_counter()
    phases["hier host reduce_scatter"] = (t0, t1)
    # the slice this rank holds complete for its host, and the ranks holding it on every host
    j = (li + 1) % size
    lo, hi = dst.size * j // size, dst.size * (j + 1) // size
    cross = [h[li] for h in hosts]
    piece = dst[lo:hi]
    if len(cross) > 1 and piece.size:
        if piece.nbytes <= choice.RD_MAX_BYTES:
            _rd(rt, cross, piece, fn, what + " across hosts", phases, "hosts rd", tag=TAG_RD + 1)
        else:
            group_ring(rt, cross, piece, fn, what + " across hosts", phases, "hosts", tag=TAG_RS + _TAG_STEP)
    t2 = time.perf_counter()
    phases["hier across hosts"] = (t1, t2)
    # every element is finished once, by its slice's holder, before the allgather copies it
    _finish(piece, postscale, divisor)
    group_ring(rt, local, dst, fn, what, phases, "host", reduce_scatter=False)
    phases["hier host allgather"] = (t2, time.perf_counter())
    phases["hier"] = (t0, time.perf_counter())


def eager_limit(rt: Runtime) -> int:
    """The largest allreduce (bytes) whose payload rides in the agreement message on ``rt`` now:
    kept in ``rt.chosen`` and worked out again only after its inputs changed (see ``_chosen``)."""
    chosen = rt.chosen
    if chosen.wiring != rt.headers.wiring or chosen.revision != rt.config.revision:
        chosen = _chosen(rt)
    return chosen.eager


def algorithm(rt: Runtime, nbytes: int) -> str:
    """The allreduce algorithm of ``nbytes`` on ``rt`` now (``algorithm_choice.choose``): the same
    on every rank. Chosen once per size while the inputs stay (``rt.chosen``)."""
    chosen = rt.chosen
    if chosen.wiring != rt.headers.wiring or chosen.revision != rt.config.revision:
        chosen = _chosen(rt)
    alg = chosen.sizes.get(nbytes)
    return alg if alg is not None else chosen.keep(nbytes, _choose(rt, nbytes))


def _chosen(rt: Runtime) -> choice.Chosen:
    """``rt.chosen`` renewed: its inputs are the setting and the shared-memory threshold (the
    config's ``revision`` counts their changes), the participants and the eager capacity (the
    header buffers' ``wiring`` counts a join, a resync and a rebuild), and whether shared-memory
    slots exist (made once, after the buffers, at init: ``rt.chosen`` is made after them)."""
    chosen = rt.chosen
    chosen.renew(rt.headers.wiring, rt.config.revision,
                 choice.eager_limit(rt.config.allreduce, len(rt.participants), rt.headers.eager_limit, _has_shm(rt)))
    return chosen


def _has_shm(rt: Runtime) -> bool:
    return rt.shm is not None and rt.config.shm_threshold > 0


def _choose(rt: Runtime, nbytes: int) -> str:
    """``algorithm``'s choice worked out: a hierarchy over hosts of unequal ranks runs as one ring."""
    parts = rt.participants
    hosts = uniform_hosts(rt, parts)
    count = len({rt.hosts[q] for q in parts})
    alg = choice.choose(rt.config.allreduce, nbytes, len(parts), count, hosts is not None, rt.headers.eager_limit,
                        _has_shm(rt), rt.config.shm_threshold)
    return "ring" if alg == "hier" and hosts is None else alg


BODIES = {"rd": recursive_doubling, "hier": hierarchical}

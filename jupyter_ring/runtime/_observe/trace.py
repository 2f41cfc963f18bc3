"""Per-collective trace records, aggregate statistics and Chrome-trace export."""

import collections
import threading
import time
from typing import TypedDict

__all__ = ["Trace", "busbw_factor"]


# kind, name, bytes, start, end (perf_counter seconds), phases: name -> (start, end), algorithm ("": none)
_Record = tuple[str, str, int, float, float, dict[str, tuple[float, float]], str]


class RecentRecord(TypedDict):
    """One collective of ``Trace.recent``: wall-clock times (``%ring timeline``)."""

    kind: str
    name: str
    bytes: int
    start: float
    end: float
    phases: dict[str, list[float]]   # phase name -> [start, end]
    algorithm: str                   # the allreduce algorithm that ran ("eager", "rd", "ring", ...), or ""


class _ChromeEventFields(TypedDict):
    name: str
    ph: str
    pid: int
    tid: int
    args: dict[str, object]


class ChromeEvent(_ChromeEventFields, total=False):
    """One Chrome-trace event: metadata ("M") or a complete event ("X", with cat, ts and dur)."""

    cat: str
    ts: float
    dur: float


def busbw_factor(kind: str, size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor."""
    if size <= 1:
        return 1.0
    if kind in ("allreduce",):
        return 2.0 * (size - 1) / size
    if kind in ("allgather", "reducescatter", "alltoall"):
        return (size - 1) / size
    return 1.0


class Trace:
    """Records of recent collectives plus running totals per kind."""

    def __init__(self, rank: int, size: int, maxlen: int) -> None:
        self.rank = rank
        self.size = size
        self.records: collections.deque[_Record] = collections.deque(maxlen=max(1, int(maxlen)))
        # kind -> algorithm ("": none named) -> [count, bytes, seconds]; a kind's totals are its sums
        self.totals: dict[str, dict[str, list[float]]] = {}
        # records come from the caller's thread, the engine's and, for torch.distributed's
        # asynchronous collectives, the thread that completes them (runtime._device.torch_comm)
        self._lock = threading.Lock()
        # perf_counter() is monotonic but has no epoch: keep one anchor to place records in time.
        self.anchor = time.time() - time.perf_counter()

    def record(self, kind: str, name: str, nbytes: int, start: float, end: float,
               phases: dict[str, tuple[float, float]], algorithm: str = "") -> None:
        """Store one finished collective; ``phases`` maps phase name to (start, end); ``algorithm``
        names the allreduce algorithm that ran (counted apart too). Any thread."""
        with self._lock:
            self.records.append((kind, name, nbytes, start, end, phases, algorithm))
            by_algorithm = self.totals.get(kind)
            if by_algorithm is None:
                by_algorithm = self.totals[kind] = {}
            total = by_algorithm.get(algorithm)
            if total is None:
                total = by_algorithm[algorithm] = [0, 0, 0.0]
            total[0] += 1
            total[1] += nbytes
            total[2] += end - start

    def stats(self, algorithms: bool = False) -> dict[str, dict[str, float]]:
        """Per kind: count, bytes, time_s, algbw and busbw (bytes/s, nccl-tests definitions);
        with ``algorithms`` also per kind and algorithm, as ``allreduce[rd]``."""
        out: dict[str, dict[str, float]] = {}
        per_kind: dict[str, list[float]] = {}
        per_algorithm: list[tuple[str, list[float]]] = []
        with self._lock:
            for kind, by_algorithm in self.totals.items():
                whole = per_kind[kind] = [0, 0, 0.0]
                for algorithm, total in by_algorithm.items():
                    whole[0] += total[0]
                    whole[1] += total[1]
                    whole[2] += total[2]
                    if algorithms and algorithm:
                        per_algorithm.append((f"{kind}[{algorithm}]", total[:]))
        for key, (count, nbytes, seconds) in sorted(per_kind.items()) + sorted(per_algorithm):
            kind = key.split("[")[0]
            algbw = nbytes / seconds if seconds > 0 else 0.0
            out[key] = {
                "count": count,
                "bytes": nbytes,
                "time_s": seconds,
                "algbw": algbw,
                "busbw": algbw * busbw_factor(kind, self.size),
            }
        return out

    def recent(self, seconds: float) -> list[RecentRecord]:
        """This rank's collectives that ended in the last ``seconds`` (wall-clock times, for
        ``%ring timeline``): a list of dicts kind, name, bytes, start, end, phases {name: [s, e]}."""
        now = time.perf_counter()
        anchor = self.anchor
        return [{"kind": kind, "name": name, "bytes": nbytes, "start": anchor + start,
                 "end": anchor + end,
                 "phases": {p: [anchor + a, anchor + b] for p, (a, b) in phases.items()}, "algorithm": algorithm}
                for kind, name, nbytes, start, end, phases, algorithm in list(self.records)
                if now - end <= seconds]

    def reset(self) -> None:
        with self._lock:
            self.records.clear()
            self.totals.clear()

    def chrome_events(self) -> list[ChromeEvent]:
        """This rank's records as Chrome-trace events (pid = rank, one track per rank)."""
        events: list[ChromeEvent] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0, "args": {"sort_index": self.rank}},
        ]
        for kind, name, nbytes, start, end, phases, algorithm in self.records:
            events.append({
                "name": f"{kind} {name}", "cat": kind, "ph": "X", "pid": self.rank, "tid": 0,
                "ts": (self.anchor + start) * 1e6, "dur": max(0.0, end - start) * 1e6,
                "args": {"bytes": nbytes, "algorithm": algorithm} if algorithm else {"bytes": nbytes},
            })
            for phase, (p_start, p_end) in phases.items():
                events.append({
                    "name": phase, "cat": kind, "ph": "X", "pid": self.rank, "tid": 1,
                    "ts": (self.anchor + p_start) * 1e6, "dur": max(0.0, p_end - p_start) * 1e6,
                    "args": {"op": name},
                })
        return events

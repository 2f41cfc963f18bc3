"""Runtime configuration read from ``JUPYTER_RING_*`` environment variables."""

import dataclasses
import os
from typing import Any, ClassVar, cast

from .algorithm_choice import AGREEMENTS, ALGORITHMS
from .waits import WAIT_MODES

__all__ = ["Config"]

MiB = 1 << 20


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; set it to seconds or bytes, e.g. {name}={default:g}") from None


def _env_bytes_or_off(name: str, default: float) -> float:
    """Bytes, where ``off`` (or 0) switches the feature off: 0."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("off", "none", "no", "false"):
        return 0
    return _env_float(name, default)


# No ``from __future__ import annotations`` here: from_env reads each field's type as a class.
@dataclasses.dataclass
class Config:
    """Tunables of the ring runtime; each has a ``JUPYTER_RING_<NAME>`` environment variable."""

    stall_timeout: float = 60.0
    """Seconds a rank waits inside a collective before raising StallError."""
    stall_warning: float = 10.0
    """Seconds after which a waiting rank warns (on stderr) which ranks have not arrived."""
    fusion_threshold: int = 128 * MiB
    """Bytes of queued async allreduces packed into one fusion buffer (Horovod's default)."""
    cycle_ms: float = 1.0
    """Milliseconds the engine's background thread waits after the first queued async collective
    for more to fuse with it (Horovod's cycle time); ``flush()``, ``synchronize()`` and a full
    fusion buffer start at once."""
    chunk_bytes: int = 1 * MiB
    """Pipeline piece of the ring: reduction of one piece overlaps the transfer of the next."""
    eager_bytes: int = 64 * 1024
    """Payloads up to this size travel inside the agreement message (one round trip in all)."""
    shm_threshold: int = 64 * 1024
    """Allreduces of more than this many bytes go through shared memory instead of the ring when
    every rank is on one host; 0 (or ``off`` in the environment) never uses shared memory (the
    algorithms over messages run: see ``allreduce``)."""
    shm_window_bytes: int = 1 * MiB
    """Cap of each rank's shared-memory slot (allocated lazily, grown up to this): allreduces go
    through it in pieces of half of it (registered memory: pieces of this size). Smaller pieces
    stay in the cache (benchmarks/shm_probe.py) but cost more syncs, each a wait for a peer that
    a loaded machine may have descheduled: 1 MiB is the best of 0.5-4 MiB on a quiet machine
    (benchmarks/allreduce.py --windows); where other work takes the cores, 4 MiB syncs less."""
    trace_records: int = 10000
    """How many recent collective records the trace keeps for ``timeline()``."""
    wait: str = "auto"
    """How a waiting rank uses its core: ``spin`` polls back to back at first (a core per rank),
    ``yield`` gives the core to any other runnable process between polls (ranks outnumber cores),
    ``auto`` picks ``yield`` where this host runs more ranks than the process may use cores."""
    allreduce: str = "auto"
    """Which allreduce algorithm runs: ``auto`` picks by size and world (eager payloads, recursive
    doubling, the ring, shared memory, the hierarchy of hosts; thresholds in
    ``runtime/_engine/algorithm_choice.py``); ``eager``, ``rd``, ``ring``, ``shm`` or ``hier`` forces one
    where it applies. The same on every rank."""
    agreement: str = "auto"
    """How the ranks exchange the header every collective starts with: ``all`` sends it to every
    peer (one round trip, n-1 messages a rank, eager payloads ride along), ``log`` relays it in
    ⌈log2 n⌉ steps (Bruck's allgather, headers only: small data goes by recursive doubling),
    ``auto`` picks ``log`` from ``algorithm_choice.LOG_AGREEMENT_RANKS`` ranks on. The same on
    every rank."""
    finalize_timeout: float = 10.0
    """Seconds a rank may spend in MPI_Finalize at exit before it is ended (SIGALRM): a rank
    whose launcher or peers are unreachable (a host cut off) would otherwise wait there forever;
    0 waits without limit."""

    revision: ClassVar[int] = 0
    """How many times a field was assigned (set per instance from the first one on; not a
    setting): what a runtime derives from the settings and keeps (the allreduce algorithm's
    choice, ``algorithms.eager_limit``) is renewed when it differs from the one it was made under."""

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        object.__setattr__(self, "revision", self.revision + 1)

    @classmethod
    def from_env(cls, **overrides: Any) -> "Config":
        """Defaults, then ``JUPYTER_RING_*`` variables, then keyword overrides."""
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            env = "JUPYTER_RING_" + field.name.upper()
            if field.type is str:
                values[field.name] = os.environ.get(env, "").strip().lower() or field.default
                continue
            read = _env_bytes_or_off if field.name == "shm_threshold" else _env_float
            value = read(env, cast(float, field.default))  # every field but the str ones is a number
            values[field.name] = int(value) if field.type is int else value
        values.update(overrides)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.stall_timeout <= 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {self.stall_timeout}")
        if self.chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be at least 1024, got {self.chunk_bytes}")
        if self.finalize_timeout < 0:
            raise ValueError(f"finalize_timeout must be >= 0 seconds, got {self.finalize_timeout}")
        if self.cycle_ms < 0:
            raise ValueError(f"cycle_ms must be >= 0 milliseconds, got {self.cycle_ms}")
        if self.eager_bytes < 0 or self.fusion_threshold < 0 or self.shm_threshold < 0:
            raise ValueError("eager_bytes, fusion_threshold and shm_threshold must be >= 0")
        if self.wait not in WAIT_MODES:
            raise ValueError(f"wait must be one of {', '.join(WAIT_MODES)} (JUPYTER_RING_WAIT), got {self.wait!r}")
        if self.allreduce not in ALGORITHMS:
            raise ValueError(f"allreduce must be one of {', '.join(ALGORITHMS)} (JUPYTER_RING_ALLREDUCE), "
                             f"got {self.allreduce!r}")
        if self.agreement not in AGREEMENTS:
            raise ValueError(f"agreement must be one of {', '.join(AGREEMENTS)} (JUPYTER_RING_AGREEMENT), "
                             f"got {self.agreement!r}")
        if self.shm_window_bytes < 1 << 16:
            raise ValueError(f"shm_window_bytes must be at least 65536, got {self.shm_window_bytes}")

"""Runtime configuration read from ``JUPYTER_RING_*`` environment variables."""

import dataclasses
import os

__all__ = ["Config"]

MiB = 1 << 20


def _env_float(name, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; set it to seconds or bytes, e.g. {name}={default:g}") from None


@dataclasses.dataclass
class Config:
    """Tunables of the ring runtime; each has a ``JUPYTER_RING_<NAME>`` environment variable."""

    stall_timeout: float = 60.0
    """Seconds a rank waits inside a collective before raising StallError."""
    stall_warning: float = 10.0
    """Seconds after which a waiting rank warns (on stderr) which ranks have not arrived."""
    fusion_threshold: int = 128 * MiB
    """Bytes of queued async allreduces packed into one fusion buffer (Horovod's default)."""
    chunk_bytes: int = 1 * MiB
    """Pipeline piece of the ring: reduction of one piece overlaps the transfer of the next."""
    eager_bytes: int = 64 * 1024
    """Payloads up to this size travel inside the agreement message (one round trip in all)."""
    trace_records: int = 10000
    """How many recent collective records the trace keeps for ``timeline()``."""
    finalize_timeout: float = 10.0
    """Seconds a rank may spend in MPI_Finalize at exit before it is ended (SIGALRM): a rank
    whose launcher or peers are unreachable (a host cut off) would otherwise wait there forever;
    0 waits without limit."""

    @classmethod
    def from_env(cls, **overrides):
        """Defaults, then ``JUPYTER_RING_*`` variables, then keyword overrides."""
        values = {}
        for field in dataclasses.fields(cls):
            value = _env_float("JUPYTER_RING_" + field.name.upper(), field.default)
            values[field.name] = int(value) if field.type is int else value
        values.update(overrides)
        config = cls(**values)
        config.validate()
        return config

    def validate(self):
        if self.stall_timeout <= 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {self.stall_timeout}")
        if self.chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be at least 1024, got {self.chunk_bytes}")
        if self.finalize_timeout < 0:
            raise ValueError(f"finalize_timeout must be >= 0 seconds, got {self.finalize_timeout}")
        if self.eager_bytes < 0 or self.fusion_threshold < 0:
            raise ValueError("eager_bytes and fusion_threshold must be >= 0")

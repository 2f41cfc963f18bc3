"""How a rank waits for its peers: spin on a core of its own, give the core away where ranks share.

Every wait of the runtime polls from Python (``polling.Waiter.poll``), so that SIGINT, the stall timeout
and a peer's resync notice are seen within milliseconds. What it does between two polls decides
what a wait costs the machine:

- ``spin``: poll back to back for ``SPIN_SECONDS``, then sleep between polls, doubling the sleep
  up to ``MAX_NAP`` (``LONG_NAP`` once a wait has lasted ``LONG_WAIT``; ``HELD_NAP`` while a
  rank waited on is held in a debugger: a peer at a breakpoint costs its waiters ~0.1 % of a core). Right when every rank has a core: a peer's message
  is seen within a microsecond.
- ``yield``: the same, but every poll of the first phase gives the core to any other runnable
  process (``sched_yield``). Where ranks outnumber cores, the peer a rank waits for is often
  runnable on the very core the waiter spins on; a spinning waiter keeps it from running until
  the scheduler's time slice ends (milliseconds), a yielding one lets it run at once. MPICH's own
  progress loop does the same.
- ``auto`` (the default): ``yield`` where this host runs more ranks than this process may use
  cores (its affinity mask, a cgroup's CPU quota, JupyterHub's ``CPU_LIMIT``), else ``spin``.

``JUPYTER_RING_WAIT`` (or ``init(wait=...)``) overrides the choice; ``ring.wait_policy()`` says
which one is in force and why.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["WAIT_MODES", "WaitPolicy", "cores_available", "choose", "next_nap",
           "SPIN_SECONDS", "MAX_NAP", "LONG_WAIT", "LONG_NAP", "HELD_NAP"]

WAIT_MODES = ("auto", "spin", "yield")
SPIN_SECONDS = 0.002   # polls back to back (or yielding) before the first sleep
FIRST_NAP = 1e-5
MAX_NAP = 1e-3         # the longest sleep between polls in a wait's first LONG_WAIT seconds
LONG_WAIT = 1.0
LONG_NAP = 1e-2        # ... and after: a long wait (a peer computing) costs ~0.5 % of a core
HELD_NAP = 5e-2        # ... while a rank waited on is held in a debugger: a person types (~0.1 %)

_CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


class WaitPolicy(NamedTuple):
    """The wait in force on this rank: ``mode`` is ``spin`` or ``yield``; the rest says why."""

    mode: str            # "spin" or "yield"
    requested: str       # the setting: "auto", "spin" or "yield"
    ranks_on_host: int   # ranks of this runtime on this host
    cores: float         # cores this process may use

    @property
    def yields(self) -> bool:
        """Whether a waiting rank gives its core away between polls."""
        return self.mode == "yield"

    def describe(self) -> str:
        """One line for users: which wait, and why."""
        share = f"{self.ranks_on_host} rank(s) on this host, {self.cores:g} core(s) to use"
        if self.requested == "auto":
            return f"{self.mode} (auto: {share})"
        return f"{self.mode} (set by JUPYTER_RING_WAIT or init(wait=...); {share})"


def _cgroup_quota(path: str = _CGROUP_CPU_MAX) -> float | None:
    """Cores a cgroup v2 CPU quota allows (``cpu.max``: "quota period"), or None without one."""
    try:
        with open(path) as fh:
            quota, period = fh.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(float(quota) / float(period), 1.0)
    except (ValueError, ZeroDivisionError):
        return None


def cores_available(environ: Mapping[str, str] | None = None, cgroup_path: str = _CGROUP_CPU_MAX) -> float:
    """Cores this process may run on: its affinity mask, lowered by a cgroup quota and ``CPU_LIMIT``."""
    environ = os.environ if environ is None else environ
    limits = [float(len(os.sched_getaffinity(0)))]
    quota = _cgroup_quota(cgroup_path)
    if quota is not None:
        limits.append(quota)
    raw = environ.get("CPU_LIMIT", "").strip()  # JupyterHub's Spawner.cpu_limit
    if raw:
        try:
            limits.append(max(float(raw), 1.0))
        except ValueError:
            pass
    return min(limits)


def choose(requested: str, ranks_on_host: int, cores: float) -> WaitPolicy:
    """The wait for ``ranks_on_host`` ranks sharing ``cores``, as ``requested`` (see the module)."""
    if requested not in WAIT_MODES:
        raise ValueError(f"wait={requested!r} is not a wait mode; use one of {', '.join(WAIT_MODES)} "
                         "(JUPYTER_RING_WAIT=auto is the default)")
    mode = requested
    if requested == "auto":
        mode = "yield" if ranks_on_host > cores else "spin"
    return WaitPolicy(mode, requested, ranks_on_host, cores)


def next_nap(nap: float, waited: float) -> float:
    """The sleep after ``nap`` in a wait that has lasted ``waited`` seconds: doubled, capped."""
    return min(nap * 2, LONG_NAP if waited > LONG_WAIT else MAX_NAP)

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
  cores (its affinity mask, a cgroup's CPU quota, JupyterHub's ``CPU_LIMIT``); else ``spin``
  while the host has a core for every runnable task, and ``yield`` while it has not (other
  users' processes, another job's ranks: a shared lab server, a loaded CI machine), looked up
  in ``/proc/loadavg`` at most every ``BUSY_EVERY`` seconds (:func:`host_busy`). A rank that spins
  there takes the core from whoever was about to run, its peer included.

``JUPYTER_RING_WAIT`` (or ``init(wait=...)``) overrides the choice; ``ring.wait_policy()`` says
which one is in force and why.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["WAIT_MODES", "WaitPolicy", "cores_available", "choose", "next_nap", "host_busy", "yields_now",
           "runnable_tasks", "SPIN_SECONDS", "MAX_NAP", "LONG_WAIT", "LONG_NAP", "HELD_NAP", "BUSY_EVERY"]

WAIT_MODES = ("auto", "spin", "yield")
SPIN_SECONDS = 0.002   # polls back to back (or yielding) before the first sleep
FIRST_NAP = 1e-5
MAX_NAP = 1e-3         # the longest sleep between polls in a wait's first LONG_WAIT seconds
LONG_WAIT = 1.0
LONG_NAP = 1e-2        # ... and after: a long wait (a peer computing) costs ~0.5 % of a core
HELD_NAP = 5e-2        # ... while a rank waited on is held in a debugger: a person types (~0.1 %)
BUSY_EVERY = 0.25      # seconds between two looks at the host's runnable tasks (auto, a core a rank)

_CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"
_LOADAVG = "/proc/loadavg"


class WaitPolicy(NamedTuple):
    """The wait in force on this rank: ``mode`` is ``spin`` or ``yield``; the rest says why."""

    mode: str            # "spin" or "yield"
    requested: str       # the setting: "auto", "spin" or "yield"
    ranks_on_host: int   # ranks of this runtime on this host
    cores: float         # cores this process may use

    @property
    def yields(self) -> bool:
        """Whether a waiting rank always gives its core away between polls."""
        return self.mode == "yield"

    @property
    def adaptive(self) -> bool:
        """Whether the rank spins only while the host is not busy (``auto`` with a core a rank):
        it yields while the host's runnable tasks outnumber its cores (:func:`host_busy`)."""
        return self.requested == "auto" and self.mode == "spin"

    def describe(self) -> str:
        """One line for users: which wait, and why."""
        share = f"{self.ranks_on_host} rank(s) on this host, {self.cores:g} core(s) to use"
        if self.adaptive:
            return f"{self.mode} (auto: {share}; yields while the host's cores are all busy)"
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


def runnable_tasks(path: str | None = None) -> int | None:
    """Tasks runnable on this host at this moment (``/proc/loadavg``'s fourth field,
    ``running/total``, the reader included), None where it cannot be read."""
    try:
        with open(path or _LOADAVG) as fh:
            return int(fh.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def host_busy(path: str | None = None) -> bool:
    """Whether this host's runnable tasks outnumber its cores now: a rank that spins then keeps
    a runnable task (its peer's, or another user's) off a core."""
    tasks = runnable_tasks(path)
    return tasks is not None and tasks > (os.cpu_count() or 1)


class _HostLook:
    """The host's cores all busy, as last looked up by this process's waits, and when
    (``perf_counter``) to look again."""

    busy = False
    next_look = 0.0


_host = _HostLook()


def yields_now(policy: WaitPolicy, now: float) -> bool:
    """Whether a wait under ``policy`` beginning at ``now`` (``perf_counter``) gives its core away
    between its first polls: always under ``yield``; under ``auto``'s spin while the host is busy
    (:func:`host_busy`, looked up at most every ``BUSY_EVERY`` seconds by the process's waits)."""
    if policy.yields:
        return True
    if not policy.adaptive:
        return False
    if now >= _host.next_look:
        _host.busy, _host.next_look = host_busy(), now + BUSY_EVERY
    return _host.busy


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

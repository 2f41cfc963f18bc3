"""Horovod's host discovery for a notebook cluster: ``%ring start --host-discovery SOURCE``.

``SOURCE`` is what Horovod's ``--host-discovery-script`` takes, or a Python callable:

- a command (an executable script, with arguments if any, split as a shell would): it prints one
  ``host:slots`` line per host available now (``host`` alone: 1 slot), exits 0; blank lines and
  ``#`` comments are skipped;
- ``module:callable``: ``callable()`` returns that text, a list of such lines, or a dict
  ``{host: slots}``.

:class:`HostDiscovery` asks the source every ``interval`` seconds (Horovod: 1 s) on a thread of
its own, which never touches the cluster: it keeps the latest answer (:class:`Found`), or why
there is none (the script failed, timed out, printed garbage). The kernel's thread reads it
(``_held_cluster``) and resizes the cluster: on one host the total of the slots is the world
size wanted, bounded by ``--min-ranks``/``--max-ranks`` (:func:`wanted`). A failing source is
reported, never fatal: the cluster keeps its size until the source answers again.
"""

from __future__ import annotations

import importlib
import re
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

__all__ = ["DiscoveryError", "Found", "HostDiscovery", "parse_hosts", "resolve", "wanted"]

SCRIPT_TIMEOUT = 10.0  # seconds a discovery script (or callable) gets per answer
_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+?)(?::(?P<slots>[^:\s]+))?$")
_CALLABLE = re.compile(r"^(?P<module>[A-Za-z_][\w.]*):(?P<name>[A-Za-z_][\w.]*)$")


class DiscoveryError(ValueError):
    """The discovery source gave no usable answer: the message names the source, what is wrong
    and the fix."""


class Found(NamedTuple):
    """One answer of the source: ``hosts`` (host -> slots) and their total, or ``error`` (why
    there is none; then ``hosts`` is empty and ``slots`` None). ``seq`` counts the answers."""

    hosts: dict[str, int]
    slots: int | None
    error: str
    seq: int
    at: float


def parse_hosts(text: str, source: str) -> dict[str, int]:
    """``host:slots`` lines (``host`` alone: 1 slot) as host -> slots, a host named twice adding
    up; :class:`DiscoveryError` naming ``source`` and the line for anything else."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        found = _LINE.match(line)
        slots_text = found.group("slots") if found else None
        if found is None or (slots_text is not None and not slots_text.isdigit()):
            raise DiscoveryError(f"host discovery {source}: line {number} is {raw.strip()!r}, not "
                                 "'host:slots' (e.g. 'localhost:4'); print one such line per host")
        slots = 1 if slots_text is None else int(slots_text)
        if slots < 1:
            raise DiscoveryError(f"host discovery {source}: line {number} gives {found.group('host')} "
                                 f"{slots} slots; list a host with 1 slot or more, or leave it out")
        hosts[found.group("host")] = hosts.get(found.group("host"), 0) + slots
    return hosts


def resolve(spec: str) -> Callable[[], dict[str, int]]:
    """The source ``spec`` names, as a function that asks it once (host -> slots, or
    :class:`DiscoveryError`); :class:`DiscoveryError` now when it cannot be found."""
    spec = spec.strip()
    if not spec:
        raise DiscoveryError("--host-discovery: give a script (it prints 'host:slots' lines) or "
                             "module:callable")
    named = _CALLABLE.match(spec)
    if named and shutil.which(spec) is None:
        return _callable_source(spec, named.group("module"), named.group("name"))
    try:
        argv = shlex.split(spec)
    except ValueError as exc:
        raise DiscoveryError(f"--host-discovery {spec!r}: {exc}; quote it as a shell would") from None
    if shutil.which(argv[0]) is None:
        raise DiscoveryError(f"--host-discovery {spec!r}: {argv[0]} is not an executable file (nor "
                             "on PATH); give the path of a script that prints 'host:slots' lines "
                             "(chmod +x it), or module:callable")
    return lambda: _run_script(spec, argv)


def _callable_source(spec: str, module_name: str, name: str) -> Callable[[], dict[str, int]]:
    try:
        target: object = importlib.import_module(module_name)
        for part in name.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise DiscoveryError(f"--host-discovery {spec}: cannot import it ({type(exc).__name__}: "
                             f"{exc}); give module:callable importable by this kernel, or a script") from None
    if not callable(target):
        raise DiscoveryError(f"--host-discovery {spec}: {type(target).__name__} is not callable")
    function = target

    def ask() -> dict[str, int]:
        try:
            answer = function()
        except Exception as exc:  # noqa: BLE001 - the user's code: reported, never fatal
            raise DiscoveryError(f"host discovery {spec}() raised {type(exc).__name__}: {exc}") from None
        return _answer_hosts(answer, f"{spec}()")

    return ask


def _answer_hosts(answer: object, source: str) -> dict[str, int]:
    """A callable's answer (text, lines, or host -> slots) as host -> slots."""
    if isinstance(answer, str):
        return parse_hosts(answer, source)
    if isinstance(answer, Mapping):
        text = "\n".join(f"{host}:{slots}" for host, slots in answer.items())
        return parse_hosts(text, source)
    if isinstance(answer, (list, tuple)) and all(isinstance(line, str) for line in answer):
        return parse_hosts("\n".join(answer), source)
    raise DiscoveryError(f"host discovery {source} returned {type(answer).__name__}; return "
                         "'host:slots' lines (a str or a list of str) or a dict {host: slots}")


def _run_script(spec: str, argv: list[str]) -> dict[str, int]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"host discovery {spec}: no answer within {SCRIPT_TIMEOUT:g} s (killed); "
                             "it must print its hosts and exit") from None
    except OSError as exc:
        raise DiscoveryError(f"host discovery {spec}: cannot run it ({exc})") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise DiscoveryError(f"host discovery {spec}: exited {done.returncode}: {tail}")
    return parse_hosts(done.stdout, spec)


def wanted(slots: int, min_ranks: int, max_ranks: int | None) -> tuple[int | None, str]:
    """The world size for ``slots`` discovered: bounded above by ``max_ranks``; None (stay as
    it is) below ``min_ranks``, as Horovod waits for ``--min-np``. The second item says why the
    size is not ``slots`` ("" when it is)."""
    if slots < min_ranks:
        return None, (f"host discovery reports {slots} slot(s), below --min-ranks {min_ranks}: the "
                      f"cluster keeps its size until it reports {min_ranks} or more")
    if max_ranks is not None and slots > max_ranks:
        return max_ranks, f"host discovery reports {slots} slots; --max-ranks {max_ranks} bounds the world"
    return slots, ""


class HostDiscovery:
    """The source ``spec`` (see the module) asked every ``interval`` seconds on a daemon thread
    (:meth:`start`, :meth:`stop`); :meth:`latest` is its last answer."""

    def __init__(self, spec: str, interval: float = 1.0) -> None:
        if not interval > 0:
            raise DiscoveryError(f"host discovery: the interval must be > 0 s, got {interval!r}")
        self.spec = spec
        self.interval = interval
        self._ask = resolve(spec)
        self._lock = threading.Lock()
        self._latest = Found({}, None, "not asked yet", 0, time.monotonic())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.changed_at = time.monotonic()  # when the total of the slots last changed

    def ask(self) -> Found:
        """Ask the source once now, keep and return its answer (the poller's step)."""
        try:
            hosts, error = self._ask(), ""
        except DiscoveryError as exc:
            hosts, error = {}, str(exc)
        now = time.monotonic()
        with self._lock:
            before = self._latest
            found = Found(hosts, sum(hosts.values()) if not error else None, error, before.seq + 1, now)
            if found.slots is not None and found.slots != before.slots:
                self.changed_at = now
            self._latest = found
        return found

    def latest(self) -> Found:
        """The last answer (thread-safe)."""
        with self._lock:
            return self._latest

    def start(self) -> None:
        """Ask every ``interval`` seconds from now on, on a daemon thread."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._poll, name="jupyter_ring-host-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop asking (the thread ends after the answer it may be waiting for)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(SCRIPT_TIMEOUT + 1.0)

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.ask()
            except Exception as exc:  # noqa: BLE001 - never end the thread: keep the reason
                with self._lock:
                    seq = self._latest.seq + 1
                    self._latest = Found({}, None, f"host discovery {self.spec}: {type(exc).__name__}: {exc}",
                                         seq, time.monotonic())

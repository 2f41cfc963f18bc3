"""``%ring debugpy RANK``: a visual debugger (VS Code, any DAP client) attached to one rank.

:func:`start` runs on the rank (shipped by ``view.apply``). It starts debugpy's debugger inside
the rank's process (``in_process_debug_adapter``: no adapter process to leave behind) listening
on ``127.0.0.1`` at a free port, and makes it safe and usable there:

- **Only this user drives it.** debugpy takes any client that connects (a DAP client such as
  VS Code sends no credential), and every user of a machine can connect to its loopback.
  The listening socket is an :class:`OwnerOnlySocket`: a connection is accepted only if the
  socket it comes from belongs to this process's user (Linux: the ``uid`` column of
  ``/proc/net/tcp``, the kernel's record of who created the peer's socket); others are closed
  before a byte is read.
- **Breakpoints by file and line resolve.** A rank compiles a cell as
  ``/tmp/ipykernel_<pid>/<hash>.py``, a name that is no file, and debugpy refuses a breakpoint
  in a file that does not exist. From ``start`` on, the rank's cells are compiled as files of the
  rank's ``rank<r>.cells`` folder in the cluster's where folder (0700, files 0600, gone with the
  cluster; ``%ring where`` reads the same files), whose names the client's ``pathMappings``
  give. The hash leaves out the notebook's ``# jupyter_ring In[N]`` line, so a cell run again
  keeps its file and its breakpoints.
- **Only the cell's thread stops.** debugpy stops every thread of a process at a breakpoint;
  here only the thread that reached it (a client may ask otherwise: ``stopAllThreadsOnSuspend``):
  the engine's threads (output, control) and the runtime's (the peers' collectives) run on.
- **Peers do not stall.** While debugpy holds the rank (a breakpoint, a step) the rank is marked
  held, as at a pdb prompt (``runtime/_observe/debugger.py``): peers waiting for it in a collective
  do not raise ``StallError``.

debugpy can listen once per process: a second ``start`` returns the same endpoint.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import sys
import threading
from typing import Any, TypedDict

from ..runtime.internal import hold
from ..runtime.internal import cells_path

__all__ = ["Endpoint", "OwnerOnlySocket", "MissingDebugpy", "start", "connected", "peer_uid"]

INSTALL_HINT = "pip install 'jupyter_ring[debug]'"
LOOPBACK = "127.0.0.1"


class MissingDebugpy(RuntimeError):
    """debugpy cannot be imported on the rank."""


class Endpoint(TypedDict):
    """Where the rank's debugger listens, and how its cells' files are named."""

    host: str
    port: int
    pid: int
    hostname: str        # the rank's host (a rank elsewhere needs an SSH tunnel to be reached)
    cells_dir: str       # the folder of the rank's cell files: the client's pathMappings remoteRoot
    owner_check: bool    # whether connections from other users are refused (Linux)
    new: bool            # False when debugpy was already listening (started by an earlier call)
    cells: list[tuple[int, str]]  # the latest cells: (the notebook's In[N], file name), newest last


_endpoint: Endpoint | None = None
_lock = threading.Lock()


# --------------------------------------------------------------------------- who connects
def _proc_net_key(address: tuple[str, int]) -> str:
    """``address`` as ``/proc/net/tcp`` writes it: the IPv4 address in host byte order, the
    port big-endian, both in upper-case hex (``0100007F:1F90`` for 127.0.0.1:8080 on x86)."""
    host, port = address[0], address[1]
    packed = struct.unpack("=I", socket.inet_aton(host))[0]
    return f"{packed:08X}:{port:04X}"


def peer_uid(connection: socket.socket, table: str = "/proc/net/tcp") -> int | None:
    """The uid owning the other end of the IPv4 loopback ``connection``; None when it cannot be
    told (no ``/proc/net/tcp``: not Linux; or the peer's socket is gone already)."""
    try:
        local = _proc_net_key(connection.getsockname())
        remote = _proc_net_key(connection.getpeername())
        with open(table, encoding="ascii") as fh:
            rows = fh.read().splitlines()[1:]
    except (OSError, ValueError):
        return None
    for row in rows:
        fields = row.split()
        # the peer's own socket: its local end is our remote end, and the other way round
        if len(fields) > 7 and fields[1] == remote and fields[2] == local:
            return int(fields[7])
    return None


def owner_check_possible() -> bool:
    return os.path.exists("/proc/net/tcp")


class OwnerOnlySocket(socket.socket):
    """A listening socket whose ``accept`` hands over only connections from this user.

    A connection from another uid (or one whose owner cannot be found) is closed at once and
    the wait goes on; pydevd's accept loop never sees it. Where ``/proc/net/tcp`` does not exist
    (not Linux) nothing can be checked and every loopback connection is accepted."""

    def accept(self) -> tuple[socket.socket, Any]:
        while True:
            connection, address = super().accept()
            if not owner_check_possible() or peer_uid(connection) == os.getuid():
                return connection, address
            refused.append(address)
            try:
                connection.close()
            except OSError:
                pass


refused: list[Any] = []  # the addresses of connections refused (another user's), for the tests


_bound: list[tuple[str, int]] = []  # where the listening socket was bound (by pydevd's thread)
_bound_event = threading.Event()
_BIND_WAIT = 30.0  # seconds for pydevd's thread to bind: it starts at once, but the rank is loaded


def _owner_only_server_socket(host: str, port: int) -> socket.socket:
    """pydevd's ``create_server_socket``, bound to loopback, with the owner check.

    Where it bound is noted here: with the in-process adapter, older debugpy releases'
    ``listen`` return None instead of the endpoint (debugpy issue 1656)."""
    if host not in (LOOPBACK, "localhost"):
        raise ValueError(f"jupyter_ring's debugpy listens on {LOOPBACK} only, not {host!r}")
    server = OwnerOnlySocket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((LOOPBACK, port))
        server.settimeout(None)
    except Exception:
        server.close()
        raise
    name = server.getsockname()
    _bound.append((str(name[0]), int(name[1])))
    _bound_event.set()
    return server


# --------------------------------------------------------------------------- the rank's cells
_LISTED = 5  # cells named by %ring debugpy
_cells: list[tuple[int, str]] = []  # the notebook's cells run since: (In[N], file name), newest last


def _cells_as_files(shell: Any, folder: str) -> None:
    """Compile the rank's cells from now on as files in ``folder`` (the rank's ``rank<r>.cells``):
    the name IPython gives a cell is ``folder/<hash>.py``, and the file is there.

    The hash is ipykernel's, of the cell without the notebook's ``# jupyter_ring In[N]`` line
    (``engines/_setup.CELL_NUMBER``), so the same cell run again keeps its file and the
    breakpoints set in it. ``engines/_setup._keep_cell_sources`` writes the files (the folder
    keeps the latest 64); written here too where it is not armed."""
    from ._setup import _CELL_NUMBER

    compiler = shell.compile
    if getattr(compiler, "_jupyter_ring_cells_as_files", False):
        return
    os.makedirs(folder, mode=0o700, exist_ok=True)
    original_name = compiler.get_code_name
    original_cache = compiler.cache
    writes = not getattr(compiler, "_jupyter_ring_keeps_sources", False)

    def get_code_name(raw_code: str, transformed_code: str, number: int) -> str:
        head, _, last = raw_code.rstrip("\n").rpartition("\n")
        match = _CELL_NUMBER.fullmatch(last)
        if match is not None:
            raw_code = head + "\n"
        name = os.path.join(folder, os.path.basename(original_name(raw_code, transformed_code, number)))
        if match is not None:
            cell = (int(match.group(1)), os.path.basename(name))
            _cells[:] = [c for c in _cells if c[1] != cell[1]] + [cell]
            del _cells[:-_LISTED]
        return name

    def cache(transformed_code: str, number: int = 0, raw_code: str | None = None) -> str:
        name: str = original_cache(transformed_code, number, raw_code)
        if writes:
            _write_cell(name, transformed_code)
        return name

    compiler.get_code_name = get_code_name
    compiler.cache = cache
    compiler._jupyter_ring_cells_as_files = True


def _write_cell(name: str, source: str) -> None:
    """Write ``source`` at ``name`` (0600); a failure only makes debugpy refuse its breakpoints."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(source)
    except OSError:
        pass


# --------------------------------------------------------------------------- held while stopped
def _mark_held_while_suspended(pydb_class: Any) -> None:
    """Mark the rank held (``hold``) while debugpy keeps a thread of it suspended."""
    if getattr(pydb_class, "_jupyter_ring_marks_held", False):
        return
    original = pydb_class.do_wait_suspend
    suspended = [0]

    @functools.wraps(original)
    def do_wait_suspend(self: Any, thread: Any, frame: Any, *args: Any, **kwargs: Any) -> Any:
        with _lock:
            suspended[0] += 1
            if suspended[0] == 1:
                code = frame.f_code
                hold.enter(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in "
                           f"{code.co_name} (debugpy)")
        try:
            return original(self, thread, frame, *args, **kwargs)
        except BaseException:  # the kernel's interrupt ends the cell here: debugpy lets it go on
            _resumed(self, thread)
            raise
        finally:
            with _lock:
                suspended[0] -= 1
                if suspended[0] == 0:
                    hold.leave()

    pydb_class.do_wait_suspend = do_wait_suspend
    pydb_class._jupyter_ring_marks_held = True


def _resumed(debugger: Any, thread: Any) -> None:
    """Tell debugpy that ``thread``, which an exception (the interrupt) takes out of its wait at a
    breakpoint, runs again, as a client's *continue* would: else debugpy keeps it marked
    suspended and stops it at once, without a word to the client, once it is traced again."""
    try:
        from _pydevd_bundle.pydevd_additional_thread_info import set_additional_thread_info
        from _pydevd_bundle.pydevd_constants import get_current_thread_id
        from _pydevd_bundle.pydevd_thread_lifecycle import internal_run_thread

        internal_run_thread(thread, set_additional_thread_info=set_additional_thread_info)
        debugger.writer.add_command(debugger.cmd_factory.make_thread_run_message(
            debugger, get_current_thread_id(thread), -1))
    except Exception:  # another debugpy: the interrupt still ends the cell
        pass


# --------------------------------------------------------------------------- traced again
def _trace_again(*_args: Any) -> None:
    """Before each cell (``pre_run_cell``): put debugpy's tracing back on the rank's main thread
    where something took it off, so its breakpoints stop the cell again. An interrupt that ends
    a cell while debugpy holds the rank is raised inside debugpy's trace function, and Python
    then turns tracing off for the thread (as it does for any error there); pdb (``breakpoint()``)
    leaves the thread untraced after ``c``. From Python 3.12 debugpy uses ``sys.monitoring``:
    ``sys.gettrace()`` tells nothing there and nothing is done."""
    if sys.version_info >= (3, 12) or sys.gettrace() is not None:
        return
    debugpy = sys.modules.get("debugpy")
    if debugpy is not None and debugpy.is_client_connected():
        debugpy.debug_this_thread()


# --------------------------------------------------------------------------- start
def _import_debugpy() -> Any:
    try:
        import debugpy
    except ImportError as exc:
        raise MissingDebugpy(f"debugpy is not installed on this rank ({exc}); install it where "
                             f"the ranks' Python is ({sys.executable}): {INSTALL_HINT}") from None
    return debugpy


def start(port: int = 0) -> Endpoint:
    """Start debugpy on this rank, on ``127.0.0.1:port`` (0: a free one); see the module's doc."""
    global _endpoint
    debugpy = _import_debugpy()
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("%ring debugpy runs on an engine (an IPython shell); none is here")
    if hold.directory is None:
        raise RuntimeError("this engine was not set up by %ring start (no where folder): "
                           "%ring debugpy needs a cluster started by %ring start")
    cells_dir = cells_path(hold.directory, hold.rank)
    _cells_as_files(shell, cells_dir)
    if _endpoint is not None:
        again: Endpoint = {**_endpoint, "cells": list(_cells), "new": False}
        return again
    import debugpy.server.api  # noqa: F401 (imports debugpy's copy of pydevd as `pydevd`)

    pydevd = sys.modules.get("pydevd")
    if pydevd is None or not hasattr(pydevd, "create_server_socket") or not hasattr(pydevd, "PyDB"):
        raise RuntimeError(f"debugpy {getattr(debugpy, '__version__', '?')} is not one jupyter_ring "
                           "can restrict to this user (pydevd.create_server_socket not found); "
                           "install a debugpy 1.8 release: pip install 'debugpy>=1.8,<2'")
    setattr(pydevd, "create_server_socket", _owner_only_server_socket)  # pydevd looks it up here
    _mark_held_while_suspended(pydevd.PyDB)
    shell.events.register("pre_run_cell", _trace_again)
    debugpy.listen((LOOPBACK, port), in_process_debug_adapter=True)
    if not _bound_event.wait(_BIND_WAIT):
        raise RuntimeError(f"debugpy did not open its port within {_BIND_WAIT:g} s on this rank")
    host, bound = _bound[-1]
    # a breakpoint stops the thread that reached it, not every thread of the rank (debugpy's
    # default): the engine's threads (its output, its control channel) and the runtime's own
    # (the background engine its peers' collectives need) run on while the cell is stopped
    debugger = pydevd.get_global_debugger()
    if debugger is not None:
        debugger.multi_threads_single_notification = False
    _endpoint = Endpoint(host=host, port=bound, pid=os.getpid(),
                         hostname=socket.gethostname(), cells_dir=cells_dir,
                         owner_check=owner_check_possible(), new=True, cells=list(_cells))
    return _endpoint


def connected() -> bool:
    """Whether a debugger client is attached to this rank's debugpy now."""
    debugpy = sys.modules.get("debugpy")
    return bool(debugpy is not None and _endpoint is not None and debugpy.is_client_connected())

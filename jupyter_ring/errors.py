"""The front end's exceptions: one root, :class:`JupyterRingError`, and a few subclasses.

Everything the notebook side raises on purpose (the magics, the cluster, the Ring panel's
server routes) is a :class:`JupyterRingError`; the runtime on the ranks has its own root,
``jupyter_ring.runtime.RingError``, because it never imports the front end. Arguments that are
wrong in themselves are still ``ValueError``/``TypeError`` (and ``%ring`` usage errors IPython's
``UsageError``). The builtin second bases keep ``except RuntimeError`` / ``except LookupError``
code written against earlier releases working.

::

    JupyterRingError
    ├── ClusterError          the cluster could not start, or cannot do what was asked
    │   └── DeadRankError     ranks' engines died; ``%ring restart`` brings the cluster back
    ├── ClusterNotFound       the Ring panel asked for a cluster that has no cluster file
    └── DistributedError      a ``%%distributed`` cell failed on one or more ranks
"""

__all__ = ["JupyterRingError", "ClusterError", "DeadRankError", "ClusterNotFound",
           "DistributedError"]


class JupyterRingError(Exception):
    """Root of every error the jupyter_ring front end raises on purpose."""


class ClusterError(JupyterRingError, RuntimeError):
    """The cluster could not start, or is not in a state to do what was asked."""


class DeadRankError(ClusterError):
    """One or more ranks' engines have died; ``%ring restart`` brings the cluster back.

    ``ranks`` lists the dead ranks.
    """

    def __init__(self, message, ranks):
        super().__init__(message)
        self.ranks = ranks

    def _render_traceback_(self):
        return [f"DeadRankError: {self}"]


class ClusterNotFound(JupyterRingError, LookupError):
    """No cluster file for this id in any IPython profile (or it went away meanwhile)."""


class DistributedError(JupyterRingError):
    """A ``%%distributed`` cell failed on one or more ranks.

    Shows the first failing rank's traceback (label ``[rank r @ host]``, original exception type
    kept in ``ename``), then one line per other failed rank. ``errors`` maps rank -> the remote
    error; ``rank`` is the headline rank.
    """

    def __init__(self, rank, host, error, others, note="", reasons=None):
        self.reasons = dict(reasons or {})  # rank -> why the front end interrupted it
        self.rank = rank
        self.host = host
        self.error = error
        self.others = others          # [(rank, host, error)] in order of failure
        self.note = note
        self.ename = _ename(error)
        self.evalue = getattr(error, "evalue", str(error))
        self.errors = {rank: error, **{r: e for r, _, e in others}}
        super().__init__(self._summary())

    def _summary(self):
        text = f"[rank {self.rank} @ {self.host}] {self.ename}: {self.evalue}"
        if self.others:
            text += "; also " + ", ".join(f"rank {r}: {_ename(e)}" for r, _, e in self.others)
        return text

    def _render_traceback_(self):
        lines = [f"[rank {self.rank} @ {self.host}] {self.ename}: {self.evalue}"]
        remote_tb = getattr(self.error, "traceback", None)
        if remote_tb:
            lines.extend(str(remote_tb).splitlines())
        if self.others:
            lines.append("")
            lines.append(f"other ranks ({len(self.others)}), probably as a consequence:")
            for rank, host, error in self.others:
                line = f"  [rank {rank} @ {host}] {_ename(error)}"
                evalue = _first_line(getattr(error, "evalue", str(error)))
                if evalue:
                    line += f": {evalue}"
                if rank in self.reasons:
                    line += f" (interrupted: {self.reasons[rank]})"
                lines.append(line)
        if self.note:
            lines.append(self.note)
        return lines


def _ename(error):
    """The exception type's name of a local or remote error (ipyparallel's ``ename``)."""
    return getattr(error, "ename", None) or type(error).__name__


def _first_line(text):
    text = str(text).strip()
    return text.splitlines()[0] if text else ""

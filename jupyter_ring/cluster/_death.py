"""Death diagnosis: which rank died first and how, from the engines' nanny logs and mpiexec's report.

:func:`describe_death` is a pure function of what the cluster knows (its rank rows, the engine
id of each rank) and the text of the engine launchers' output files, so each of its cases can be
read against a log captured from a real death.
"""

import re
from collections.abc import Iterable, Mapping, Sequence

from ..engines._setup import RankRow
from ..errors import _rank_list

__all__ = ["RESTART_FIX", "describe_death", "died_starting", "says_how"]


RESTART_FIX = "Their variables are lost; run %ring restart for a fresh cluster with the same arguments."


def describe_death(dead: Iterable[int], rows: Iterable[RankRow],
                   engine_ids: Sequence[int], output: str, fix: str = RESTART_FIX) -> str:
    """A message for the ``dead`` ranks: which died first and how, and ``fix``.

    ``rows``: the ranks' rows (``rank``, ``host``, ``pid``); ``engine_ids[rank]``: the rank's
    engine id; ``output``: the engine sets' output (nanny logs, mpiexec's or the keepers' report).
    """
    rows = list(rows)
    hosts = {row["rank"]: row["host"] for row in rows}
    pids = {row["rank"]: row["pid"] for row in rows}
    dead = list(dead)
    first = _first_death(output, {eid: rank for rank, eid in enumerate(engine_ids) if rank in dead},
                         hosts, pids)
    gone = _hosts_gone(dead, hosts, pids, engine_ids, output)
    if gone and (first is None or first[2] == "engine process exited"):
        # a host whose every rank vanished with no word from its nannies (they died with it):
        # that host went first; an engine elsewhere that merely exited is MPI ending the job
        lost = [r for r in dead if hosts.get(r) in gone]
        head = _at_hosts(lost, hosts) + " stopped answering (died, or the host is down or cut off from this one)"
        others = [r for r in dead if r not in lost]
        if others:
            head += f"; MPI then ended rank(s) {_rank_list(others)}"
    elif first is not None:
        rank, host, how = first
        head = f"rank {rank} @ {host} died ({how})"
        others = [r for r in dead if r != rank]
        if others:
            head += f"; MPI then ended rank(s) {_rank_list(others)}"
    else:
        head = _at_hosts(dead, hosts)
        head += (" stopped answering (died, or the host is down or cut off from this one)"
                 if len(set(hosts.values())) > 1 else " died")
    return f"{head}. {fix}"


def _at_hosts(ranks: Iterable[int], hosts: Mapping[int, str]) -> str:
    """``ranks 0, 1 @ a; rank 2 @ b``: ``ranks`` by host, the hosts in the order first met."""
    where: dict[str, list[int]] = {}
    for r in ranks:
        where.setdefault(hosts.get(r, "?"), []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_rank_list(rs)} @ {host}" for host, rs in where.items())


# a rank's keeper (engines._keeper.KEEPER_LINE): "jupyter_ring keeper: rank 1 engine 4242 signaled with Killed"
# The signal's name only (strsignal: "Killed", "Segmentation fault", "Real-time signal 34"): text
# another process wrote into the same line (the keeper writes its line in one write) is left out.
_KEEPER = r"jupyter_ring keeper: rank (\S+) engine {pid} signaled with ([A-Za-z-]+(?: [a-z]+)*(?: \d+)?)"


def died_starting(output: str) -> str:
    """A keeper's line in the engines' ``output``: a rank's engine killed by a signal while
    the ranks start (under keepers the job goes on without it, and its peers wait for it in
    MPI's start-up: only this line tells); "" when there is none."""
    found = re.search(_KEEPER.format(pid=r"\d+"), output)
    return (f"rank {found[1]}'s engine died while the ranks started ({found[2].strip()})"
            if found else "")


def says_how(message: str) -> bool:
    """Whether a :func:`describe_death` message says how the first rank died (a signal, MPI's
    exit string, a host cut off), not only that its engine exited or that ranks are gone."""
    return "died (" in message and "died (engine process exited)" not in message or (
        "stopped answering" in message)


def _hosts_gone(dead: Sequence[int], hosts: Mapping[int, str], pids: Mapping[int, int],
                engine_ids: Sequence[int], output: str) -> list[str]:
    """The hosts (of more than one) all of whose ranks are dead with no nanny or keeper line
    about any of them: what a host that died or was cut off leaves (its nannies went with it)."""
    if len(set(hosts.values())) < 2:
        return []
    logged = {int(m.group(1)) for m in re.finditer(r"\[KernelNanny\.(\d+)\] Pipe closed", output)}
    kept = {int(m.group(1)) for m in re.finditer(r"jupyter_ring keeper: rank \S+ engine (\d+)", output)}
    gone = []
    for host in dict.fromkeys(hosts[r] for r in sorted(dead) if r in hosts):
        ranks = [r for r, h in hosts.items() if h == host]
        if all(r in dead and pids.get(r) not in kept and (r >= len(engine_ids) or engine_ids[r] not in logged)
               for r in ranks):
            gone.append(host)
    return gone


def _first_death(output: str, eid_rank: Mapping[int, int], hosts: Mapping[int, str],
                 pids: Mapping[int, int]) -> tuple[int, str, str] | None:
    """``(rank, host, how)`` of the rank (of ``eid_rank``'s) whose nanny logged its death first.

    The nanny of the engine that died first logs it first (engines replaced earlier logged
    theirs before: they are no rank of ``eid_rank``); mpiexec's own report names whichever
    rank it cleaned up, so it is used only for how the job ended; a rank's keeper
    (``engines._keeper``) names the engine's pid and its signal.
    """
    nannies = (int(m.group(1)) for m in re.finditer(r"\[KernelNanny\.(\d+)\] Pipe closed, parent", output))
    eid = next((e for e in nannies if e in eid_rank), None)
    if eid is None:
        return _first_keepers_line(output, eid_rank.values(), hosts, pids)
    rank = eid_rank[eid]
    keeper = re.search(_KEEPER.format(pid=pids.get(rank, -1)), output)
    if keeper:
        return rank, hosts.get(rank, "?"), f"signal: {keeper.group(2).strip()}"
    exit_string = re.search(r"EXIT STRING: (.+)", output)
    # gforker -exitinfo: "[0]<rank>:Return code = 0, signaled with Killed"
    gforker = re.search(rf"\]{rank}:Return code = \d+, signaled with (\w+)", output)
    how = (exit_string.group(1).strip() if exit_string
           else f"signal: {gforker.group(1)}" if gforker else "engine process exited")
    return rank, hosts.get(rank, "?"), how


def _first_keepers_line(output: str, ranks: Iterable[int], hosts: Mapping[int, str],
                        pids: Mapping[int, int]) -> tuple[int, str, str] | None:
    """``(rank, host, how)`` from the first keeper's line naming the engine pid of one of
    ``ranks``: a keeper writes its line as soon as its engine is gone, and under load the nanny's
    log of the same death can come seconds later."""
    rank_of_pid = {pids[r]: r for r in ranks if r in pids}
    for line in re.finditer(_KEEPER.format(pid=r"(\d+)"), output):
        rank = rank_of_pid.get(int(line.group(2)))
        if rank is not None:
            return rank, hosts.get(rank, "?"), f"signal: {line.group(3).strip()}"
    return None

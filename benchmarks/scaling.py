"""Allreduce as the world grows: jupyter_ring against MPI_Allreduce at 2, 4, 8 ranks, side by side.

    .venv/bin/python benchmarks/scaling.py [--ranks 2,4,8] [--min-kib 4] [--max-mib 64]
        [--waits auto,spin] [--algorithms auto,rd,ring] [--agreements all,log] [--runs 2] [--json out.json]

For each world size and each variant, a wait policy of ``--waits`` (``JUPYTER_RING_WAIT``: auto,
spin, yield) with an allreduce algorithm of ``--algorithms`` (``JUPYTER_RING_ALLREDUCE``: auto,
eager, rd, ring, shm, hier) and an agreement of ``--agreements`` (``JUPYTER_RING_AGREEMENT``: auto,
all, log), one ``mpiexec -n N`` run of this script; the runs alternate
(``--runs`` rounds of every variant), so a machine's slow stretch hits every variant alike.
Inside a run, per float32 size,
the calls are interleaved: a barrier, ``ring.allreduce`` (out of place), a barrier,
``MPI_Allreduce`` (out of place, same MPI): median wall time of each on rank 0 (every rank waits
for the slowest, so rank 0's time is the collective's). Prints one table per world size: the
medians over runs, ring ÷ MPI per variant, and which algorithm ran (``ring.stats()``: ``auto``
names its choice). The first row, ``barrier``, times ``ring.barrier()`` against ``MPI_Barrier``:
an agreement and nothing else.

``--hosts H --per-host R --link 10GbE`` runs every variant on ``H`` simulated hosts of ``R`` ranks
(tests/multihost/manyhosts.py: network namespaces on a bridge, each host's link shaped to the
LAN's rate; needs root), launched by MPICH's Hydra over ssh with ranks on TCP, instead of
``--ranks`` on this host. Ranks above this machine's cores are the point:
a class's 4 ranks on a 2-core server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8", help="world sizes, comma-separated")
    parser.add_argument("--min-kib", type=int, default=4)
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--waits", default="auto", help="JUPYTER_RING_WAIT values to compare")
    parser.add_argument("--algorithms", default="auto", help="JUPYTER_RING_ALLREDUCE values to compare")
    parser.add_argument("--agreements", default="auto", help="JUPYTER_RING_AGREEMENT values to compare")
    parser.add_argument("--runs", type=int, default=2, help="rounds of every policy per world size")
    parser.add_argument("--max-reps", type=int, default=300, help="calls per size at most (a loaded machine: fewer)")
    parser.add_argument("--hosts", type=int, default=0, help="simulated hosts (0: the ranks on this host)")
    parser.add_argument("--per-host", type=int, default=2, help="ranks on each simulated host")
    parser.add_argument("--link", default="10GbE", help="the simulated hosts' links: 10GbE, 100GbE or none")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def sizes(min_kib: int, max_mib: int) -> list[int]:
    out, size = [], min_kib * KiB
    while size <= max_mib * MiB:
        out.append(size)
        size *= 4
    return out


def reps_for(nbytes: int, ranks: int, most: int = 300) -> int:
    """Enough calls for a stable median, fewer for large sizes and worlds (a run stays ~1 min)."""
    return max(5, min(most, int(64 * MiB / max(nbytes, 64 * KiB) / max(1, ranks // 2))))


def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    import jupyter_ring.runtime as ring

    ring.init()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    rows = []
    ring.barrier()
    ours, mpis = [], []
    for _ in range(args.max_reps):  # the agreement alone
        comm.Barrier()
        t = time.perf_counter()
        ring.barrier()
        ours.append(time.perf_counter() - t)
        comm.Barrier()
        t = time.perf_counter()
        comm.Barrier()
        mpis.append(time.perf_counter() - t)
    rows.append({"bytes": 0, "ring_s": statistics.median(ours), "mpi_s": statistics.median(mpis),
                 "algorithm": "barrier"})
    for nbytes in sizes(args.min_kib, args.max_mib):
        x = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        ring.allreduce(x, name="warm")
        ours, mpis = [], []
        ring.reset_stats()
        for _ in range(reps_for(nbytes, n, args.max_reps)):
            comm.Barrier()
            t = time.perf_counter()
            ring.allreduce(x, op=ring.Sum, name="x")
            ours.append(time.perf_counter() - t)
            comm.Barrier()
            t = time.perf_counter()
            comm.Allreduce(x, out, op=MPI.SUM)
            mpis.append(time.perf_counter() - t)
        ran = sorted(key[10:-1] for key in ring.stats() if key.startswith("allreduce["))
        rows.append({"bytes": nbytes, "ring_s": statistics.median(ours), "mpi_s": statistics.median(mpis),
                     "algorithm": "+".join(ran)})
    if rank == 0:
        print("RESULT " + json.dumps({"ranks": n, "wait": ring.wait_policy().describe(), "rows": rows}), flush=True)
    ring.shutdown()


Variant = tuple[str, str, str]  # wait, allreduce algorithm, agreement


def launch(ranks: int, variant: Variant, args: argparse.Namespace, rig: object = None) -> dict:
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec, "-n", str(ranks), sys.executable, __file__, "--worker",
           "--min-kib", str(args.min_kib), "--max-mib", str(args.max_mib), "--max-reps", str(args.max_reps)]
    wait, algorithm, agreement = variant
    env = {**os.environ, "JUPYTER_RING_WAIT": wait, "JUPYTER_RING_ALLREDUCE": algorithm,
           "JUPYTER_RING_AGREEMENT": agreement, "OMP_NUM_THREADS": "1"}
    if rig is not None:  # on the simulated hosts: Hydra over their ssh, ranks over TCP
        cmd = rig.cmd(0, [cmd[0], "-f", rig.hostfile, *cmd[1:]])
        env.update(rig.env(), UCX_TLS="tcp,self",
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{ranks} ranks, wait={wait}, allreduce={algorithm}, agreement={agreement}: no result\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def label(variant: Variant) -> str:
    """A variant's column name: its algorithm, and its wait and agreement where they are not auto."""
    wait, algorithm, agreement = variant
    text = algorithm if wait == "auto" else f"{algorithm}, wait {wait}"
    return text if agreement == "auto" else f"{text}, agreement {agreement}"


def fmt_size(nbytes: int) -> str:
    if nbytes == 0:
        return "barrier"
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    waits = [(w.strip(), a.strip(), g.strip()) for w in args.waits.split(",") if w.strip()
             for a in args.algorithms.split(",") if a.strip() for g in args.agreements.split(",") if g.strip()]
    load = os.getloadavg()
    print(f"# {os.cpu_count()} cores, load {load[0]:.2f} {load[1]:.2f} at start, {time.strftime('%H:%M')} UTC")
    rig = None
    if args.hosts:
        sys.path.insert(0, os.path.join(ROOT, "tests", "multihost"))
        from manyhosts import ManyHosts

        rig = ManyHosts(args.hosts, args.per_host, args.link).open()
        args.ranks = str(args.hosts * args.per_host)
        shaped = "rate and latency" if rig.delayed else "rate only (no tc netem here: the veth's own latency)"
        print(f"# {args.hosts} simulated hosts x {args.per_host} ranks, links {args.link}, {shaped}")
    try:
        results = measure(args, waits, rig)
    finally:
        if rig is not None:
            rig.close()
    load = os.getloadavg()
    print(f"\n# load {load[0]:.2f} {load[1]:.2f} at the end, {time.strftime('%H:%M')} UTC")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


def measure(args: argparse.Namespace, waits: list[Variant], rig: object) -> list[dict]:
    """Every variant at every world size, alternated run by run; prints the tables."""
    results = []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        runs: dict[Variant, list[dict]] = {w: [] for w in waits}
        for _ in range(args.runs):
            for wait in waits:
                runs[wait].append(launch(ranks, wait, args, rig))
        chosen = "; ".join(sorted({f"wait {w[0]}: {runs[w][0]['wait']}" for w in waits}))
        print(f"\n## {ranks} ranks ({chosen})\n")
        head = "| size | MPI_Allreduce µs | " + " | ".join(f"ring µs ({label(w)}) | ÷ MPI" for w in waits)
        print(head + " | ran (auto) |")
        print("|" + "---|" * (3 + 2 * len(waits)))
        for i, row in enumerate(runs[waits[0]][0]["rows"]):
            mpi = statistics.median(run["rows"][i]["mpi_s"] for w in waits for run in runs[w])
            cells = [fmt_size(row["bytes"]), f"{mpi * 1e6:,.0f}"]
            entry = {"ranks": ranks, "bytes": row["bytes"], "mpi_s": mpi}
            for wait in waits:
                ours = statistics.median(run["rows"][i]["ring_s"] for run in runs[wait])
                cells += [f"{ours * 1e6:,.0f}", f"{ours / mpi:.2f}"]
                entry[f"ring_s_{label(wait)}"] = ours
                entry[f"ran_{label(wait)}"] = runs[wait][0]["rows"][i]["algorithm"]
            cells.append(", ".join(sorted({runs[w][0]["rows"][i]["algorithm"] for w in waits if w[1] == "auto"})))
            results.append(entry)
            print("| " + " | ".join(cells) + " |", flush=True)
    return results


if __name__ == "__main__":
    main()

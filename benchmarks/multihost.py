"""Allreduce across two hosts (TCP over veth) against one host, and cluster start times. As root.

    .venv/bin/python benchmarks/multihost.py [--max-mib 16] [--starts 3] [--json out.json]

Builds the two simulated hosts of the multi-host tests (tests/multihost/twohosts.py: network
namespaces, veth, sshd each) and, in one run: (1) for float32 sizes 4 KiB .. --max-mib, times
jupyter_ring's ``allreduce_`` and ``MPI_Allreduce`` interleaved size by size (medians, busbw as
nccl-tests) with 2 ranks placed three ways: one per host over TCP (``UCX_TLS=tcp,self``), both
on one host with MPI's defaults (shared memory), and both on one host over TCP; (2) the time
``RingCluster.start()`` takes (controller, engines registered, ``ring.init()`` on every rank)
for 2 ranks on one host, on two hosts (Hydra over ssh) and on two Slurm nodes (``--launcher
slurm``: sbatch, slurmctld and a slurmd per host as in tests/multihost/test_slurm.py), median
of --starts.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "tests", "multihost")]

from allreduce import KiB, MiB, human, median_time, reps_for  # noqa: E402

WORKER = """\
import json, sys
import numpy as np
from mpi4py import MPI
sys.path.insert(0, {bench!r})
from allreduce import median_time, reps_for
import jupyter_ring.runtime as ring
comm = MPI.COMM_WORLD
ring.init()
size = comm.Get_size()
factor = 2 * (size - 1) / size
rows, nbytes = [], 4 * 1024
while nbytes <= {max_bytes}:
    buf = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
    reps = reps_for(nbytes)
    row = {{"bytes": nbytes}}
    row["ring"] = median_time(lambda: ring.allreduce_(buf, op=ring.Sum, name="b"), reps, comm.Barrier)
    row["mpi"] = median_time(lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), reps, comm.Barrier)
    rows.append(row)
    nbytes *= 4
hosts = comm.allgather(MPI.Get_processor_name())
if comm.rank == 0:
    print("RESULT " + json.dumps({{"rows": rows, "hosts": hosts, "factor": factor}}), flush=True)
"""

START = """\
import json, time
from jupyter_ring.cluster import RingCluster
t0 = time.perf_counter()
c = RingCluster(n=2, gpus="none", **{kwargs!r})
c.start()
took = time.perf_counter() - t0
hosts = sorted({{r["host"] for r in c.ranks}})
c.stop()
print("START " + json.dumps({{"s": took, "hosts": hosts}}), flush=True)
"""


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=int, default=16)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    return parser.parse_args()


def on_host_a(two, argv, env, tag):
    proc = subprocess.run(two.cmd(0, argv), capture_output=True, text=True, env=env, timeout=900)
    lines = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith(tag)]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-3000:]}")
    return json.loads(lines[0])


def main():
    args = parse()
    from jupyter_ring.launch import find_mpiexec, mpi_env
    from twohosts import SlurmHosts, slurm_missing

    why = slurm_missing()
    if why:
        sys.exit(f"benchmarks/multihost.py {why}")
    two = SlurmHosts().open()
    home = tempfile.mkdtemp(prefix="jr_bench_multihost_")
    try:
        a, b = (h["name"] for h in two.hosts)
        env = mpi_env(one_host=False)
        env.update(two.env(), IPYTHONDIR=os.path.join(home, "ipython"), PYTHONUNBUFFERED="1")
        script = os.path.join(home, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER.format(bench=os.path.join(ROOT, "benchmarks"),
                                  max_bytes=args.max_mib * MiB))
        places = {"two hosts, TCP": ([f"{a}:1,{b}:1"], {"UCX_TLS": "tcp,self"}),
                  "one host, shm": ([f"{a}:2"], {}),
                  "one host, TCP": ([f"{a}:2"], {"UCX_TLS": "tcp,self"})}
        results = {}
        for label, (hosts, extra) in places.items():
            argv = [find_mpiexec(), "-hosts", hosts[0], "-n", "2", sys.executable, script]
            results[label] = on_host_a(two, argv, dict(env, **extra), "RESULT")
        starts = {}
        for label, kwargs in (("one host", {}),
                              ("two hosts, Hydra/ssh", {"hosts": [f"{a}:1", f"{b}:1"]}),
                              ("two hosts, --launcher slurm",
                               {"launcher": "slurm", "nodes": 2, "ntasks_per_node": 1})):
            code = START.format(kwargs=kwargs)
            extra = {"UCX_TLS": "tcp,self"} if kwargs else {}
            runs = [on_host_a(two, [sys.executable, "-c", code], dict(env, **extra), "START")
                    for _ in range(args.starts)]
            starts[label] = {"median_s": statistics.median(r["s"] for r in runs),
                             "runs_s": [r["s"] for r in runs], "hosts": runs[0]["hosts"]}
    finally:
        two.close()
        subprocess.run(["rm", "-rf", home])
    print(report(results, starts))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"allreduce": results, "start": starts}, fh, indent=1)


def report(results, starts):
    labels = list(results)
    head = "| size |" + "".join(f" {lab}: ring µs | ring busbw GB/s | MPI µs | MPI busbw GB/s |"
                                 for lab in labels)
    lines = [head, "|---" * (1 + 4 * len(labels)) + "|"]
    gb = 1e9
    for i, row in enumerate(results[labels[0]]["rows"]):
        cells = [human(row["bytes"])]
        for lab in labels:
            r = results[lab]["rows"][i]
            f = results[lab]["factor"]
            cells += [f"{r['ring'] * 1e6:.1f}", f"{r['bytes'] / r['ring'] * f / gb:.3f}",
                      f"{r['mpi'] * 1e6:.1f}", f"{r['bytes'] / r['mpi'] * f / gb:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| cluster of 2 ranks | start (median) | runs | hosts |")
    lines.append("|---|---|---|---|")
    for lab, s in starts.items():
        lines.append(f"| {lab} | {s['median_s']:.2f} s | "
                     f"{', '.join(f'{x:.2f}' for x in s['runs_s'])} | {', '.join(s['hosts'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Where a small blocking allreduce's time goes: 1 and 2 ranks, wall, CPU and waits, against a floor.

    .venv/bin/python benchmarks/latency.py [--sizes 4096,65536] [--reps 2000]

For each size, ``allreduce_`` (float32, op Max) under 1 and 2 ranks, each call between barriers:
median wall time, CPU of the calling thread (``time.thread_time``), and the time spent inside the
runtime's waits on MPI requests (``Waiter.wait``, timed by wrapping it) with how often the
requests had completed at the first test; then ``MPI_Allreduce`` of the same buffer, and a
floor: the least Python an eager exchange needs (copy the payload into a persistent send
buffer, start persistent send and receive, test until done, compare a 24-byte header, reduce in
rank order), on the same MPI. Wall ≈ CPU with waits of a few µs means the time is the runtime's
own Python, not messaging; floor ÷ MPI says what a call could reach.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,65536", help="bytes, comma-separated")
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def floor_call(comm, MPI, buf):
    """The least Python of one eager exchange with every peer (2 ranks at most)."""
    r, n = comm.Get_rank(), comm.Get_size()
    if n == 1:
        return lambda: None
    peer = 1 - r
    sendbuf, recvbuf = bytearray(48 + buf.nbytes), bytearray(48 + buf.nbytes)
    payload = np.frombuffer(sendbuf, buf.dtype, buf.size, 48)
    theirs = np.frombuffer(recvbuf, buf.dtype, buf.size, 48)
    reqs = [comm.Recv_init(recvbuf, peer, 5), comm.Send_init(sendbuf, peer, 5)]
    own = bytes(24)
    start, test = MPI.Prequest.Startall, MPI.Request.Testall
    terms = (payload, theirs) if r == 0 else (theirs, payload)

    def call():
        np.copyto(payload, buf)
        start(reqs)
        while not test(reqs):
            pass
        if memoryview(recvbuf)[:24] != own:
            raise RuntimeError("headers differ")
        np.maximum(*terms, out=buf)
    return call


def worker(args):
    from mpi4py import MPI

    import jupyter_ring.runtime as ring
    from jupyter_ring.runtime import _api

    comm = MPI.COMM_WORLD
    ring.init()
    waiter_class = type(_api._proc.rt.waits)
    waits = {"seconds": 0.0, "ready": 0, "count": 0}
    original = waiter_class.wait

    def timed_wait(self, reqs, *rest, **kw):
        start = time.perf_counter()
        waits["ready"] += bool(self.rt.MPI.Request.Testall(reqs))
        original(self, reqs, *rest, **kw)
        waits["seconds"] += time.perf_counter() - start
        waits["count"] += 1
    waiter_class.wait = timed_wait
    floor_comm = comm.Dup()
    out = {}
    for nbytes in map(int, args.sizes.split(",")):
        buf = np.random.default_rng(comm.Get_rank()).standard_normal(nbytes // 4).astype(np.float32)
        floor = floor_call(floor_comm, MPI, buf)
        rows = {"wall": [], "cpu": [], "waits": [], "ready": [], "mpi": [], "floor": []}
        for i in range(args.reps + 1):
            comm.Barrier()
            waits.update(seconds=0.0, ready=0, count=0)
            t0, c0 = time.perf_counter(), time.thread_time()
            ring.allreduce_(buf, op=ring.Max, name="latency")
            t1, c1 = time.perf_counter(), time.thread_time()
            comm.Barrier()
            t2 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
            t3 = time.perf_counter()
            comm.Barrier()
            t4 = time.perf_counter()
            floor()
            t5 = time.perf_counter()
            if i:  # the first call builds caches
                rows["wall"].append(t1 - t0)
                rows["cpu"].append(c1 - c0)
                rows["waits"].append(waits["seconds"])
                rows["ready"].append(waits["ready"] / max(1, waits["count"]))
                rows["mpi"].append(t3 - t2)
                rows["floor"].append(t5 - t4)
        out[nbytes] = {k: float(np.median(v)) for k, v in rows.items()}
    waiter_class.wait = original
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    comm.Barrier()


def main():
    args = parse()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jupyter_ring.launch import find_mpiexec, mpi_env

    print(f"allreduce_ float32 op Max, medians of {args.reps} calls between barriers (µs)\n")
    print("| ranks | size | wall | CPU (calling thread) | in waits | requests done at once | MPI_Allreduce "
          "| floor (least Python) | wall ÷ MPI | floor ÷ MPI | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ranks in (1, 2):
        cmd = [find_mpiexec(), "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker",
               "--sizes", args.sizes, "--reps", str(args.reps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), stdin=subprocess.DEVNULL)
        found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not found:
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        load = open("/proc/loadavg").read().split()[0]
        for nbytes, row in json.loads(found[0]).items():
            us = {k: v * 1e6 for k, v in row.items()}
            floor = f"{us['floor']:.1f}" if ranks > 1 else "-"
            ratio = f"{row['floor'] / row['mpi']:.2f}" if ranks > 1 else "-"
            print(f"| {ranks} | {int(nbytes) // 1024} KiB | {us['wall']:.1f} | {us['cpu']:.1f} | {us['waits']:.1f} | "
                  f"{row['ready']:.2f} | {us['mpi']:.1f} | {floor} | {row['wall'] / row['mpi']:.2f} | {ratio} | {load} |")


if __name__ == "__main__":
    main()

"""20 kills in a row in one kernel: does anything leak, is every run right? (issue 34, figure 4)

    .venv/bin/python benchmarks/respawn_soak.py [--ranks 2] [--kills 20] [--env NAME=VALUE ...]

Through a real notebook kernel (tests/real_kernel.py) with ``%ring start -n N --max-restarts K``
(K = the kills): rank N-1's engine (the replacement, after the first kill) is SIGKILLed 1.5 s
into a cell of allreduces, again and again. After each kill:

- *right*: the cell failed with DeadRankError, the next cell runs on the full world, an
  allreduce of 1,009 random numbers is exact on every rank, the survivors still hold ``kept``;
- *processes*: the kernel's descendants (controller, mpiexec jobs, keepers, nannies, engines);
- *shm*: files of /dev/shm that a rank of the cluster ever mapped (read from /proc/PID/maps
  after each kill) and that still exist: the live ranks' segments, plus any leaked;
- *kernel fds*: open file descriptors of the kernel process;
- *rank 0 fds*: those of the survivor rank 0's engine;
- *comm handle*: the handle (``Comm.py2f``) MPICH gives a communicator rank 0 dups and frees
  at once: MPICH reuses a freed communicator's slot, so a constant handle says no communicator
  is left allocated by the replacements (it grows with each one left).

A survivor lost with the replacement (rank 0's engine gone too, or a replacement that failed)
is counted and recorded with what the killed cell and the next one said, and ``%ring restart``
starts the world afresh before the next kill. The load average is printed. ``--env`` starts the
kernel, and so its ranks, with a variable: ``--env MPIR_CVAR_CH4_NETMOD=ofi --env FI_PROVIDER=tcp
--env FI_TCP_IFACE=lo`` runs the ranks on MPICH's ofi netmod instead of ucx (docs/reliability.md
compares the two).
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

LOOP = "%%distributed\nimport numpy as np\nfor step in range(10**9):\n    ring.allreduce(np.ones(1000), name='t')"
CHECK = ("%%distributed\nimport numpy as np, os\n"
         "data = lambda q, k: np.random.default_rng([q, k]).integers(-99, 99, 1009).astype(np.float64)\n"
         "v = ring.allreduce(data(ring.rank(), {k}), op=ring.Sum, name='c{k}')\n"
         "print(bool((v == sum(data(q, {k}) for q in range(ring.size()))).all()), 'kept' in dir(), ring.size())")
PROBE = ("%%distributed\nfrom jupyter_ring.engines import _respawn as _jr_r\n"
         "_jr_c = _jr_r.world().Dup(); _jr_h = _jr_c.py2f(); _jr_c.Free()\n"
         "print(len(os.listdir('/proc/self/fd')), _jr_h, os.getpid())")
CLUSTER = "get_ipython().magics_manager.registry['RingMagics'].cluster"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="a variable the kernel, and so its ranks, start with (MPICH's netmod, say)")
    return p.parse_args()


def rank_lines(text: str) -> dict[int, str]:
    return {int(line[6:].split("]", 1)[0]): line.split("] ", 1)[1]
            for line in text.splitlines() if line.startswith("[rank ")}


def shm_mapped(pids: list[int]) -> set[str]:
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                found |= {line.split()[-1] for line in f if " /dev/shm/" in line}
        except OSError:
            pass
    return found


def main() -> None:
    import psutil

    from real_kernel import ring_kernel, sigkill_during

    args = parse()
    n = args.ranks
    env = dict(item.partition("=")[::2] for item in args.env)
    print(f"load average before: {open('/proc/loadavg').read().split()[0]}, {os.cpu_count()} cores, env {env}")
    seen_shm: set[str] = set()
    crashes, wrong = [], []
    print("kill | cell failed with | next cell right | kept on survivors | processes | shm | kernel fds | rank 0 fds | comm handle | s")
    with ring_kernel(start=f"%ring start -n {n} --max-restarts {args.kills}", env=env) as kernel:
        kpid = int(kernel.ok("import os\nprint(os.getpid())").split()[-1])
        kernel.ok("%%distributed\nkept = ring.rank()")
        for k in range(1, args.kills + 1):
            rows = json.loads(kernel.ok(f"import json\nprint(json.dumps({CLUSTER}.ranks))").strip().splitlines()[-1])
            seen_shm |= shm_mapped([r["pid"] for r in rows])
            survivor = rows[0]["pid"]
            _, error, killed = sigkill_during(kernel, rows[n - 1]["pid"], LOOP)
            ename = error["ename"] if error else "nothing"
            said_at_kill = error["evalue"][:400] if error else ""
            out, error = kernel.execute(CHECK.format(k=k), timeout=180)
            took = time.monotonic() - killed
            if error is not None or not psutil.pid_exists(survivor):
                # the survivor died with the replacement: recorded, then every rank afresh
                crashes.append((k, f"{ename}: {said_at_kill}",
                                error and f"{error['ename']}: {error['evalue'][:300]}"))
                print(f"{k}: survivor crashed: {crashes[-1]}", flush=True)
                kernel.ok("%ring restart", timeout=180)
                kernel.ok("%%distributed\nkept = ring.rank()")
                out = kernel.ok(CHECK.format(k=k))
            said = rank_lines(out)
            right = all(said.get(r, "").startswith("True ") and said[r].endswith(f" {n}") for r in range(n))
            kept = [r for r in range(n) if said.get(r, "").split(" ")[1:2] == ["True"]]
            if ename != "DeadRankError" or not right:
                wrong.append((k, ename, said))
            probe = rank_lines(kernel.ok(PROBE))
            fds0, handle, _ = probe[0].split()
            rows = json.loads(kernel.ok(f"import json\nprint(json.dumps({CLUSTER}.ranks))").strip().splitlines()[-1])
            seen_shm |= shm_mapped([r["pid"] for r in rows])
            procs = len(psutil.Process(kpid).children(recursive=True))
            shm = sum(os.path.exists(f) for f in seen_shm)
            kfds = len(os.listdir(f"/proc/{kpid}/fd"))
            print(f"{k} | {ename} | {right} | {kept} | {procs} | {shm} | {kfds} | {fds0} | {int(handle):#x} | {took:.1f}",
                  flush=True)
        kernel.ok("%ring stop", timeout=60)
    print(f"survivor crashes (then %ring restart): {len(crashes)} of {args.kills}: {crashes}")
    print(f"runs not right: {len(wrong)}: {wrong}")
    print(f"shm files still there after %ring stop: {sum(os.path.exists(f) for f in seen_shm)} of {len(seen_shm)} ever mapped")
    print(f"load average after: {open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()

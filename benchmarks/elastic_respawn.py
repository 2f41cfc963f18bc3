"""A rank SIGKILLed under ``hvd.elastic.run``: time from the kill to the next step completed on
every rank, and the steps run twice (issue 34, item 2), torch and Keras side by side.

    .venv/bin/python benchmarks/elastic_respawn.py [--ranks 2,3] [--frameworks torch,keras] [--repeats 3] [--pace 0.05]

Through a real notebook kernel (tests/real_kernel.py) with a cluster of N ranks: the training cells
of tests/reliability/test_elastic_notebook.py (torch: a ``TorchState`` with a model, a
``DistributedOptimizer`` and an ``ElasticSampler``; Keras: a ``TensorFlowKerasState`` trained by
``GradientTape`` + ``DistributedGradientTape``; a commit every 3 steps), run in turn in one kernel
(torch, Keras, torch, ...), each step made to take ``--pace`` seconds so that the kill lands
mid-epoch; rank N-1's engine is SIGKILLed from
outside once rank 0 has logged step 9 (the first time; later repeats kill the replacement).
Each rank logs each completed step with its time; the figure is, from the kill, the time until
every rank of the new world has completed a step (the replacement's first one included). The
cell must succeed, with the same final weights on every rank. The machine's load average is
printed before and after.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "reliability"))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,3", help="world sizes, comma-separated (default 2,3)")
    p.add_argument("--frameworks", default="torch,keras", help="training cells, comma-separated (default torch,keras)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pace", type=float, default=0.05, help="seconds each step sleeps (default 0.05)")
    return p.parse_args()


def records(logs: str, rank: int) -> list[dict]:
    try:
        with open(os.path.join(logs, f"rank{rank}.jsonl")) as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except (OSError, ValueError):
        return []


def one_kill(kernel, n: int, pace: float, framework: str) -> tuple[float, int]:
    """(seconds from the kill to a completed step on every rank, steps run twice on rank 0)."""
    import threading

    from test_elastic_notebook import KERAS_TRAIN, TRAIN, weights_of

    train = {"torch": TRAIN, "keras": KERAS_TRAIN}[framework]
    rows = json.loads(kernel.ok("import json\nprint(json.dumps(get_ipython().magics_manager"
                                ".registry['RingMagics'].cluster.ranks))").strip().splitlines()[-1])
    victim = rows[n - 1]["pid"]
    logs = tempfile.mkdtemp(prefix="elastic-bench-")
    killed: list[float] = []

    def killer() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(r.get("step", -1) >= 9 for r in records(logs, 0)):
                killed.append(time.time())
                os.kill(victim, signal.SIGKILL)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    out, error = kernel.execute(train.format(kill_at=-1, victim=-1, pace=pace, logs=logs), timeout=300)
    thread.join(1)
    if error is not None or not killed:
        raise SystemExit(f"{framework}, {n} ranks: the cell failed or ended before the kill: {error and error['evalue']}\n{out}")
    weights = weights_of(out, n)
    if len({w[0] for w in weights.values()}) != 1:
        raise SystemExit(f"{framework}, {n} ranks: the ranks ended with different weights: {weights}")
    firsts = []
    for rank in range(n):
        after = [r["t"] for r in records(logs, rank) if "t" in r and r["t"] > killed[0]]
        if not after:
            raise SystemExit(f"rank {rank} completed no step after the kill")
        firsts.append(min(after))
    steps = [r["step"] for r in records(logs, 0) if "step" in r]
    return max(firsts) - killed[0], len(steps) - len(set(steps))


def main() -> None:
    from real_kernel import ring_kernel

    args = parse()
    print(f"load average before: {open('/proc/loadavg').read().split()[0]}, {os.cpu_count()} cores")
    frameworks = args.frameworks.split(",")
    for n in (int(x) for x in args.ranks.split(",")):
        times: dict[str, list[float]] = {f: [] for f in frameworks}
        twice: dict[str, list[int]] = {f: [] for f in frameworks}
        restarts = args.repeats * len(frameworks)
        with ring_kernel(start=f"%ring start -n {n} --max-restarts {restarts}") as kernel:
            for _ in range(args.repeats):
                for framework in frameworks:  # interleaved: the same load for each
                    took, again = one_kill(kernel, n, args.pace, framework)
                    times[framework].append(took)
                    twice[framework].append(again)
                    print(f"  {framework}, {n} ranks: kill -> a step completed on every rank {took:.2f} s, "
                          f"steps run twice {again}", flush=True)
        for framework in frameworks:
            took = times[framework]
            print(f"{framework}, {n} ranks: kill -> next step on every rank: median {statistics.median(took):.2f} s, "
                  f"max {max(took):.2f} s (each: {', '.join(f'{t:.2f}' for t in took)}); steps run twice "
                  f"(at most the 2 since the last commit): {twice[framework]}")
    print(f"load average after: {open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()

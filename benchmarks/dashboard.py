"""Cost of the live dashboard: training step time with it vs without, and its update latency.

Usage: python benchmarks/dashboard.py [-n 2] [--pairs 20] [--steps 600] [--rate R]

One cluster of ``-n`` ranks (``RingCluster``, as ``%ring start``); this process is the notebook
side, polling the cell's AsyncResult every 20 ms as ``%%distributed`` does. The ranks train the
PyTorch MLP of notebooks/03 (one thread each, batch 64, ``ring.log(loss=...)`` every step, the
DistributedOptimizer counting steps), in blocks of ``--steps`` steps. Blocks alternate, in the
same run, between

- **live**: the datapub publisher installed on every rank (``ENGINE_SETUP``) and a
  ``LiveDashboard`` here ingesting every snapshot and redrawing its widgets (≤ 5/s), and
- **off**: no publisher on the ranks (``c.RingMagics.dashboard = False``), the same polling
  loop.

Step time is each block's wall time over its steps on the ranks (a mean: it includes the rare
steps that publish), median over the blocks of each kind; with other load on the machine, the
median of the ratios of adjacent live/off blocks and the ratio of the fastest blocks are
steadier. CPU: this process's and ipyparallel's controller's, as a share of one core. Latency
is, for every metric point logged by ``ring.log`` on a rank, the wall time from the log call
until the poll here that put it into the dashboard's state (same machine, same clock).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

TRAIN_SETUP = """
import time, torch
import jupyter_ring.runtime.torch as hvd
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x_all = torch.rand(8192, 2, generator=g) * 2 - 1
y_all = (x_all[:, 0] * x_all[:, 1] > 0).float()
x_train, y_train = x_all[hvd.rank()::hvd.size()], y_all[hvd.rank()::hvd.size()]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                            torch.nn.Tanh(), torch.nn.Linear(64, 1))
opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
loss_fn = torch.nn.BCEWithLogitsLoss()

def train(steps, batch=64):
    ring.progress(0, total=steps, desc="bench")
    t0 = time.perf_counter()
    for i in range(steps):
        idx = torch.randint(0, len(x_train), (batch,))
        opt.zero_grad()
        loss = loss_fn(model(x_train[idx]).squeeze(1), y_train[idx])
        loss.backward()
        opt.step()
        ring.log(loss=loss.item())
    return (time.perf_counter() - t0) / steps
"""


def _controller(cluster):
    for proc in cluster.processes():
        try:
            if "ipyparallel.controller" in " ".join(proc.cmdline()):
                return proc
        except Exception:
            pass
    return None


def _cpu(proc):
    times = proc.cpu_times() if proc is not None else None
    return times.user + times.system if times is not None else 0.0


def run_block(cluster, steps, live, controller=None):
    """One training block on every rank.

    Returns (per-rank mean step seconds, latencies, this process's CPU share of one core,
    the controller's CPU share).
    """
    ar = cluster.view.execute(f"_jr_bench_step = train({steps})", block=False)
    latencies = []
    seen = {}
    cpu0, wall0, ctl0 = time.process_time(), time.perf_counter(), _cpu(controller)
    while not ar.wait(0.02):
        if live is not None:
            _poll(live, ar, seen, latencies)
    ar.get()
    if live is not None:
        ar.wait_for_output(2.0)
        _poll(live, ar, seen, latencies)
    wall = time.perf_counter() - wall0
    cpu = (time.process_time() - cpu0) / wall
    ctl = (_cpu(controller) - ctl0) / wall
    return cluster.view.pull("_jr_bench_step", block=True), latencies, cpu, ctl


def _poll(live, ar, seen, latencies):
    if live.poll(ar):
        now = time.time()
        for rank, state in live.state.ranks.items():
            points = state.history.get("loss", [])
            # points are in time order: the new ones are past the last wall time seen
            last = seen.get(rank, -1.0)
            for wall, _step, _value in reversed(points):
                if wall <= last:
                    break
                latencies.append(now - wall)
            if points:
                seen[rank] = points[-1][0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--pairs", type=int, default=20, help="live/off block pairs (default 20)")
    parser.add_argument("--steps", type=int, default=600, help="training steps per block (default 600)")
    parser.add_argument("--rate", type=float, default=None,
                        help="snapshots per second per rank (default: the publisher's)")
    parser.add_argument("--controller-db", default=None,
                        help="the controller's record store, e.g. DictDB (ipyparallel's default) "
                             "to compare with ours (default: RingCluster's)")
    args = parser.parse_args(argv)
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="jupyter_ring_bench_"))
    from jupyter_ring.cluster import RingCluster
    from jupyter_ring.engines import _publish
    from jupyter_ring.widgets.live import ENGINE_SETUP, LiveDashboard

    cluster = RingCluster(n=args.n, **({"controller_db": args.controller_db}
                                       if args.controller_db else {}))
    cluster.start()
    try:
        cluster.view.execute(TRAIN_SETUP, block=True).get()
        cluster.view.execute(ENGINE_SETUP, block=True).get()
        run_block(cluster, args.steps, LiveDashboard(args.n, display=False))  # warm-up
        times = {"live": [], "off": []}
        cpu = {"live": [], "off": []}
        ctl = {"live": [], "off": []}
        controller = _controller(cluster)
        latencies = []
        snapshots = 0
        for pair in range(args.pairs):
            order = ("live", "off") if pair % 2 == 0 else ("off", "live")
            for mode in order:
                if mode == "live":
                    if args.rate:
                        cluster.view.apply_sync(_publish.install, args.rate)
                    else:
                        cluster.view.apply_sync(_publish.install)
                    live = LiveDashboard(args.n, display=False)
                else:
                    cluster.view.apply_sync(_publish.uninstall)
                    live = None
                per_rank, lat, cpu_share, ctl_share = run_block(cluster, args.steps, live, controller)
                cpu[mode].append(cpu_share)
                ctl[mode].append(ctl_share)
                times[mode].append(max(per_rank))   # a step ends when the slowest rank's does
                latencies += lat
                if live is not None:
                    live.finish()
                    snapshots += live.received
                    points = sum(len(s.history.get("loss", [])) for s in live.state.ranks.values())
                    assert points == args.n * args.steps, (points, args.n * args.steps)
    finally:
        cluster.stop()

    live_ms = statistics.median(times["live"]) * 1e3
    off_ms = statistics.median(times["off"]) * 1e3
    latencies.sort()

    def pct(p):
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] * 1e3

    print(f"{args.n} ranks, {args.pairs} pairs of {args.steps}-step blocks, live/off interleaved")
    print(f"step time (ms, median of blocks): live {live_ms:.3f}, off {off_ms:.3f}, "
          f"ratio {live_ms / off_ms:.4f} ({100 * (live_ms / off_ms - 1):+.2f} %)")
    paired = statistics.median(a / b for a, b in zip(times["live"], times["off"]))
    fastest = min(times["live"]) / min(times["off"])
    print(f"live/off: median of the {args.pairs} adjacent-pair ratios {paired:.4f}, "
          f"fastest blocks {min(times['live']) * 1e3:.3f} / {min(times['off']) * 1e3:.3f} ms = "
          f"{fastest:.4f}")
    print("blocks live (ms): " + ", ".join(f"{t * 1e3:.3f}" for t in times["live"]))
    print("blocks off  (ms): " + ", ".join(f"{t * 1e3:.3f}" for t in times["off"]))
    print(f"notebook-side CPU (share of one core, median of blocks): "
          f"live {100 * statistics.median(cpu['live']):.1f} %, off {100 * statistics.median(cpu['off']):.1f} %; "
          f"controller live {100 * statistics.median(ctl['live']):.1f} %, "
          f"off {100 * statistics.median(ctl['off']):.1f} %")
    print(f"snapshots received (live blocks): {snapshots}, carrying all "
          f"{args.pairs * args.steps * args.n} logged points")
    print(f"latency ring.log -> notebook state (ms): median {pct(50):.1f}, p95 {pct(95):.1f}, "
          f"max {latencies[-1] * 1e3:.1f} over {len(latencies)} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())

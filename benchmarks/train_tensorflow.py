"""Keras 3 ``model.fit`` throughput with jupyter_ring's DistributedOptimizer: 1 rank vs 2 ranks.

    python benchmarks/train_tensorflow.py [--steps 30] [--batch 64] [--repeats 3] [--baseline-src DIR]

``--baseline-src DIR`` (a checkout of another revision, e.g. ``git worktree add /tmp/base main``)
runs that tree's jupyter_ring too, interleaved with this one, so both appear in one table.

The same ~10M-parameter MLP as benchmarks/train_torch.py, one TF thread per rank, median step time
of the timed epoch (a first epoch compiles the train step and is not timed).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the tree whose jupyter_ring is measured: this one, or --baseline-src's (set for the workers)
sys.path.insert(0, os.environ.get("JUPYTER_RING_BENCH_SRC") or os.path.dirname(HERE))


def worker(steps, batch):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import keras

    import jupyter_ring.runtime.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(2048, activation="relu"),
                              keras.layers.Dense(2048, activation="relu"),
                              keras.layers.Dense(2048, activation="relu"), keras.layers.Dense(10)])
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    if hvd.size() > 1:
        opt = hvd.DistributedOptimizer(opt)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((steps * batch, 1024)).astype(np.float32)
    y = rng.integers(0, 10, steps * batch)
    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, b, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, b, logs=None):
            times.append(time.perf_counter() - self.t0)

    cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)] if hvd.size() > 1 else []
    model.fit(x[:5 * batch], y[:5 * batch], batch_size=batch, epochs=1, verbose=0, callbacks=cbs)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[Timer()])
    result = hvd.allgather_object({"step_s": statistics.median(times)})
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def launch(n, args, src=None):
    from jupyter_ring.launch import find_mpiexec, mpi_env

    env = mpi_env()
    env.update(OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    env["JUPYTER_RING_BENCH_SRC"] = os.path.abspath(src) if src is not None else ""
    cmd = [find_mpiexec(), "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker",
           "--steps", str(args.steps), "--batch", str(args.batch)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    step = max(r["step_s"] for r in json.loads(line[len("RESULT "):]))
    return n * args.batch / step


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline-src", default=None, help="another source tree to measure alongside")
    args = p.parse_args()
    if args.worker:
        worker(args.steps, args.batch)
        return
    trees = {"this tree": None}
    if args.baseline_src:
        trees[f"baseline ({args.baseline_src})"] = args.baseline_src
    runs = {(tree, n): [] for tree in trees for n in (1, 2)}
    loads = []
    for _ in range(args.repeats):
        for tree, n in runs:  # interleaved: every configuration once per repeat
            loads.append(os.getloadavg()[0])
            runs[tree, n].append(launch(n, args, trees[tree]))
    print(f"Keras 3 model.fit (TF backend), 10.5M-parameter MLP, batch {args.batch} per rank, "
          f"{args.steps} steps x {args.repeats} runs interleaved, medians, 1 TF thread per rank, "
          f"load {min(loads):.1f}-{max(loads):.1f}\n")
    print("| code | ranks | samples/s | scaling efficiency |")
    print("|---|---|---|---|")
    for tree in trees:
        one = statistics.median(runs[tree, 1])
        for n in (1, 2):
            med = statistics.median(runs[tree, n])
            print(f"| {tree} | {n} | {med:.0f} | {med / (n * one):.2f} |")


if __name__ == "__main__":
    main()

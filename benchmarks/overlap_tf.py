"""How much of TensorFlow's gradient allreduce hides behind backward inside a tf.function, on 2 ranks.

    .venv/bin/python benchmarks/overlap_tf.py [--ranks 2] [--layers 8] [--width 1024] [--compute-ms 4] [--steps 20]

The TensorFlow twin of benchmarks/overlap.py. A tf.function step: ``--layers`` matmuls (width x
width float32 weights), whose backward is emulated layer by layer (each layer's gradient waits
``--compute-ms`` in a stateless numpy_function: the CPU idles, as while a GPU computes), and
``DistributedGradientTape``'s gradients. Interleaved step by step, medians over ``--steps`` (the
slower rank's step sets the pace):

- compute: the same step with a plain tf.GradientTape, with the sleeps and without them;
- buckets: DistributedGradientTape's gradients in buckets of one layer that start during backward
  (``JUPYTER_RING_TF_OVERLAP=1``), without the sleeps (communication) and with them (overlapped);
- one op: the same with ``JUPYTER_RING_TF_OVERLAP=0``, one fused op after backward.

hidden = 1 - (overlapped - compute) / (communication - compute without sleeps), per variant.
"""

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from overlap import launch, parser  # noqa: E402 - the torch twin's options and launcher


def worker(args):
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import jupyter_ring.runtime.tensorflow as hvd

    hvd.init()
    os.environ["JUPYTER_RING_TF_BUCKET_BYTES"] = str(args.width * args.width * 4)  # one layer a bucket
    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.standard_normal((args.width, args.width)).astype(np.float32) / args.width ** 0.5)
               for _ in range(args.layers)]
    x = tf.constant(rng.standard_normal((4, args.width)).astype(np.float32))
    sleep = {"s": args.compute_ms / 1000.0}

    def idle(g):
        time.sleep(sleep["s"])
        return g

    @tf.custom_gradient
    def compute(h):
        def grad(dy):
            # stateless: a real backward's ops (MatMul) are not ordered against the collectives
            return tf.ensure_shape(tf.numpy_function(idle, [dy], tf.float32, stateful=False), dy.shape)
        return tf.identity(h), grad

    def make(distributed):
        def step():
            with tf.GradientTape() as tape:
                h = x
                for w in weights:
                    h = compute(tf.matmul(h, w))
                loss = tf.reduce_mean(h * h)
            if distributed:
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, weights)
            return tf.add_n([g[0, 0] for g in grads])
        return tf.function(step)

    plain = make(False)
    os.environ["JUPYTER_RING_TF_OVERLAP"] = "1"
    buckets = make(True).get_concrete_function()    # traced now: the variables are read at trace time
    os.environ["JUPYTER_RING_TF_OVERLAP"] = "0"
    one_op = make(True).get_concrete_function()
    kinds = {"compute": (plain, True), "compute, no sleeps": (plain, False),
             "communication, buckets": (buckets, False), "overlapped, buckets": (buckets, True),
             "communication, one op": (one_op, False), "overlapped, one op": (one_op, True)}

    def run(fn, with_sleeps):
        sleep["s"] = args.compute_ms / 1000.0 if with_sleeps else 0.0
        hvd.barrier()
        start = time.perf_counter()
        fn().numpy()
        return time.perf_counter() - start

    for fn, with_sleeps in kinds.values():  # warm-up
        for _ in range(3):
            run(fn, with_sleeps)
    times = {k: [] for k in kinds}
    for _ in range(args.steps):
        for kind, (fn, with_sleeps) in kinds.items():
            times[kind].append(run(fn, with_sleeps))
    everyone = hvd.allgather_object(times)
    if hvd.rank() == 0:
        paced = {k: [max(t[k][i] for t in everyone) for i in range(args.steps)] for k in kinds}
        print("RESULT " + json.dumps({k: statistics.median(v) for k, v in paced.items()}), flush=True)


def main():
    args = parser(__doc__.splitlines()[0]).parse_args()
    if args.worker:
        worker(args)
        return
    t = launch(__file__, args, TF_CPP_MIN_LOG_LEVEL="3")
    grads = args.layers * args.width * args.width * 4 / (1 << 20)
    print(f"{args.ranks} ranks, {args.layers} layers x {grads / args.layers:.0f} MiB of gradients "
          f"({grads:.0f} MiB), backward {args.compute_ms:g} ms a layer (emulated), medians of {args.steps} steps, "
          f"load {os.getloadavg()[0]:.1f}\n")
    print("| step | ms |")
    print("|---|---|")
    for kind in ("compute, no sleeps", "compute", "communication, buckets", "overlapped, buckets",
                 "communication, one op", "overlapped, one op"):
        print(f"| {kind} | {t[kind] * 1e3:.1f} |")
    for variant in ("buckets", "one op"):
        comm = t[f"communication, {variant}"] - t["compute, no sleeps"]
        exposed = t[f"overlapped, {variant}"] - t["compute"]
        hidden = 1 - exposed / comm if comm > 0 else float("nan")
        print(f"\n{variant}: communication alone {comm * 1e3:.1f} ms, exposed {exposed * 1e3:.1f} ms: "
              f"**{100 * hidden:.0f} % hidden**")

if __name__ == "__main__":
    main()

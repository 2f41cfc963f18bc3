"""The TensorFlow and Keras adapters in one launch (TF's import costs seconds per rank).

Collectives on tf tensors (eager and inside tf.function), DistributedGradientTape training and
Keras ``model.fit`` with DistributedOptimizer + callbacks: n ranks on shards end where one process
on the full batch ends, and all ranks bit-identical. Prints ``TF_ALL_OK <rank>``.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import _checks  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)

import keras  # noqa: E402

import jupyter_ring.runtime.keras as hvdk  # noqa: E402
import jupyter_ring.runtime.tensorflow as hvd  # noqa: E402
from jupyter_ring.runtime import _api  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
failures = []
BATCH, STEPS = 24, 4  # shards of 12, 8 and 6 rows at 2, 3 and 4 ranks


def close(label, got, want, tol):
    _checks.close(failures, label, got, want, tol)


def same_on_all_ranks(label, arr):
    flat = np.concatenate([np.ravel(a) for a in arr]).astype(np.float64)
    everyone = hvd.allgather(tf.constant(flat[None]), name=f"{label}.same").numpy()
    if not all(np.array_equal(everyone[0], row) for row in everyone):
        failures.append(f"{label}: ranks are not bit-identical")


# ---- collectives, eager and inside tf.function
rng = np.random.default_rng(1)
xs = [rng.standard_normal((13, 3)).astype(np.float32) for _ in range(n)]
close("allreduce", hvd.allreduce(tf.constant(xs[r])), sum(xs) / n, 1e-6)
close("allreduce Sum", hvd.allreduce(tf.constant(xs[r]), op=hvd.Sum, name="s"), sum(xs), 1e-5)
close("allreduce fp16", hvd.allreduce(tf.constant(xs[r]), compression=hvd.Compression.fp16), sum(xs) / n, 1e-2)
close("allreduce bfloat16", tf.cast(hvd.allreduce(tf.cast(xs[r], tf.bfloat16)), tf.float32), sum(xs) / n, 3e-2)
close("grouped_allreduce", hvd.grouped_allreduce([tf.constant(x) for x in (xs[r], 2 * xs[r])], op=hvd.Sum)[1],
      2 * sum(xs), 1e-5)
# random integers (exact in float32), the same on every rank for a rank q: rank q's allgather rows
# 1, 0, 7, 3, 4, ... (one empty), alltoall rows (q + 2 d) % 3 to rank d (some 0), reducescatter over
# 2n + 1 rows (not divisible by n: the first rank gets one more)
ints = np.random.default_rng(2)
parts = [ints.integers(-99, 99, ([1, 0, 7, 3][q] if q < 4 else q, 2)) for q in range(n)]
close("allgather", hvd.allgather(tf.constant(parts[r])), np.concatenate(parts), 0)
close("broadcast", hvd.broadcast(tf.constant(xs[r]), root_rank=n - 1), xs[n - 1], 0)
close("broadcast scalar", hvd.broadcast(tf.constant(float(r)), root_rank=n - 1), float(n - 1), 0)
counts = [[(q + 2 * d) % 3 for d in range(n)] for q in range(n)]
sent = [ints.integers(-99, 99, (sum(counts[q]), 3)).astype(np.float32) for q in range(n)]
out, received = hvd.alltoall(tf.constant(sent[r]), splits=counts[r])
close("alltoall", out, np.concatenate([np.split(sent[q], np.cumsum(counts[q])[:-1])[r] for q in range(n)]), 0)
close("alltoall received splits", received, [counts[q][r] for q in range(n)], 0)
rows = [ints.integers(-99, 99, (2 * n + 1, 2)).astype(np.float32) for _ in range(n)]
lo = 0 if r == 0 else 3 + 2 * (r - 1)
close("reducescatter", hvd.reducescatter(tf.constant(rows[r]), op=hvd.Sum), sum(rows)[lo:lo + 2 + (r == 0)], 0)

@tf.function
def in_graph(x):
    return hvd.allreduce(x, op=hvd.Sum, name="graph") + hvd.broadcast(x, 0, name="graph.b")


close("allreduce in tf.function", in_graph(tf.constant(xs[r])), sum(xs) + xs[0], 1e-5)
v = tf.Variable(np.random.default_rng(3 + r).standard_normal(3).astype(np.float32))
with tf.GradientTape() as tape:
    y = tf.reduce_sum(hvd.allreduce(v * (r + 1.0), op=hvd.Sum, name="diff"))
close("allreduce gradient", tape.gradient(y, v), np.full(3, n * (r + 1.0)), 1e-6)


# ---- DistributedGradientTape: shards of a batch == the full batch in one process
def data(step):
    g = np.random.default_rng(100 + step)
    return g.standard_normal((BATCH, 5)).astype(np.float32), g.standard_normal((BATCH, 2)).astype(np.float32)


def shard(a):
    per = BATCH // n
    return a[r * per:(r + 1) * per]


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])


def tape_train(distributed, graph):
    model = make_model(0 if not distributed else r)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    if distributed:
        hvd.broadcast_variables(model.variables, root_rank=0)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    fn = tf.function(step_fn) if graph else step_fn
    for step in range(STEPS):
        x, y = data(step)
        fn(tf.constant(shard(x) if distributed else x), tf.constant(shard(y) if distributed else y))
    return [w.numpy() for w in model.trainable_variables]


class Buckets:
    """Inside a tf.function, gradients in buckets of ``nbytes`` that start during backward (None:
    the defaults: this small model's gradients are one fused op); read at trace time."""

    def __init__(self, nbytes):
        self.nbytes = nbytes

    def __enter__(self):
        if self.nbytes:  # buckets whatever the cores (by default only where a rank has a spare one)
            os.environ.update(JUPYTER_RING_TF_BUCKET_BYTES=str(self.nbytes), JUPYTER_RING_TF_OVERLAP="1")

    def __exit__(self, *exc):
        os.environ.pop("JUPYTER_RING_TF_BUCKET_BYTES", None)
        os.environ.pop("JUPYTER_RING_TF_OVERLAP", None)


want = np.concatenate([w.ravel() for w in tape_train(False, False)])
for graph, nbytes in ((False, None), (True, None), (True, 64)):
    with Buckets(nbytes):
        got = tape_train(True, graph)
    close(f"DistributedGradientTape graph={graph} buckets={nbytes}", np.concatenate([w.ravel() for w in got]), want,
          1e-5)
    same_on_all_ranks(f"tape graph={graph} {nbytes}", got)


# ---- the fused gradient op reduces in the transport's registered memory on one host (no copy into
# it and back) and hands back views of it; eagerly and inside tf.function, each rank's own average
start = np.random.default_rng(4)  # the same on every rank, as after a broadcast of the weights
w1, w2 = (tf.Variable(start.standard_normal(shape).astype(np.float32)) for shape in (7, (3, 5)))


def fused_grads():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w1 * float(r + 1)) + tf.reduce_sum(w2 * w2 * float(r))
    return hvd.DistributedGradientTape(tape).gradient(loss, [w1, w2])


for graph in (False, True):
    g1, g2 = (tf.function(fused_grads) if graph else fused_grads)()
    close(f"fused gradients graph={graph}", np.concatenate([g1.numpy().ravel(), g2.numpy().ravel()]),
          np.concatenate([np.full(7, (n + 1) / 2), (n - 1.0) * w2.numpy().ravel()]), 1e-5)
    if n > 1 and not graph and not _api.registered(np.from_dlpack(g1)):
        failures.append("fused gradients: not a view of registered memory")

# ---- a variable with a gradient on rank 0 only (eager): no hang, everyone gets rank 0's / n
a, b = tf.Variable(1.0), tf.Variable(2.0)
with tf.GradientTape() as tape:
    loss = a * 3.0 + (b * 5.0 if r == 0 else 0.0)
grads = hvd.DistributedGradientTape(tape).gradient(loss, [a, b])
close("gradient on rank 0 only", [g.numpy() for g in grads], [3.0, 5.0 / n], 1e-6)
with tf.GradientTape() as tape:
    loss = a * 3.0
grads = hvd.DistributedGradientTape(tape).gradient(loss, [a, b])
if grads[1] is not None:
    failures.append("a gradient that no rank has should stay None")


# ---- Keras model.fit with DistributedOptimizer and the callbacks
def fit(distributed, run_eagerly):
    model = make_model(0 if not distributed or r == 0 else r + 7)  # others differ: the callback fixes it
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    if distributed:
        opt = hvdk.DistributedOptimizer(opt)
    model.compile(optimizer=opt, loss="mse", metrics=["mae"], run_eagerly=run_eagerly, jit_compile=False)
    xs_all, ys_all = zip(*(data(s) for s in range(STEPS)))
    x, y = np.concatenate(xs_all), np.concatenate(ys_all)
    if distributed:
        # each step's batch is split across the ranks: rank r takes its rows of every batch
        per = BATCH // n
        idx = np.concatenate([np.arange(s * BATCH + r * per, s * BATCH + (r + 1) * per) for s in range(STEPS)])
        x, y, batch = x[idx], y[idx], per
    else:
        batch = BATCH
    cbs = [hvdk.callbacks.BroadcastGlobalVariablesCallback(0), hvdk.callbacks.MetricAverageCallback()] \
        if distributed else []
    hist = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=cbs)
    return [w.numpy() for w in model.trainable_variables], hist.history


want, _ = fit(False, False)
want = np.concatenate([w.ravel() for w in want])
for eager, nbytes in ((False, None), (True, None), (False, 64)):
    with Buckets(nbytes):
        got, history = fit(True, eager)
    close(f"keras fit run_eagerly={eager} buckets={nbytes}", np.concatenate([w.ravel() for w in got]), want, 1e-5)
    same_on_all_ranks(f"keras fit run_eagerly={eager} {nbytes}", got)
    loss = hvd.allgather(tf.constant([history["loss"][-1]], tf.float64), name=f"loss.{eager}.{nbytes}").numpy()
    if not np.all(loss == loss[0]):
        failures.append(f"MetricAverageCallback: epoch losses differ between ranks: {loss}")

# ---- LearningRateWarmupCallback: Horovod's ramp from lr/size to lr over the warm-up epochs, set
# before each batch at the fractional epoch plus one batch (2 batches an epoch here)
model = make_model(0)
model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse", jit_compile=False)
seen = []


class Record(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


x, y = data(0)
model.fit(shard(x), shard(y), batch_size=BATCH // n // 2, epochs=3, verbose=0, shuffle=False,
          callbacks=[hvdk.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2), Record()])
expect = [0.4 / n * (1 + (e + b / 2 + 1 / 2) * (n - 1) / 2) for e in range(2) for b in range(2)] + [0.4, 0.4]
close("LearningRateWarmupCallback", seen, expect, 1e-6)

if failures:
    print(f"rank {r}: {len(failures)} failures:\n  " + "\n  ".join(failures[:20]), flush=True)
    sys.exit(1)
print(f"TF_ALL_OK {r}", flush=True)

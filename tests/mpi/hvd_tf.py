"""Horovod's TensorFlow and Keras names on jupyter_ring, in one launch (TF's import costs seconds).

Eager, tf.function and TF1 graph mode: TF error types, IndexedSlices, integer scale factors,
grouped allgather/reducescatter and alltoall with gradients, in-place variable broadcasts,
size_op & co, DistributedGradientTape on sparse embedding gradients, SyncBatchNormalization,
process sets; Keras: LearningRateScheduleCallback, BestModelCheckpoint, load_model,
PartialDistributedOptimizer. Every rank asserts its own results; prints ``HVD_TF_OK <rank>``.
"""

import os
import shutil
import sys
import tempfile

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

hvd.init()
r, n = hvd.rank(), hvd.size()
failures = []


def close(label, got, want, tol=0.0):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        failures.append(f"{label}: shape {got.shape} != {want.shape}")
    elif not np.allclose(got, want, rtol=tol, atol=tol):
        failures.append(f"{label}: max abs diff {np.abs(got - want).max():.3g}")


def expect_raises(label, exc_types, fn):
    _checks.expect_raises(failures, label, exc_types, fn)


def expect_disagreement(label, named, fn):
    """``fn()`` raises FailedPreconditionError (Horovod's type for ranks that disagree), naming ``named``."""
    try:
        fn()
    except tf.errors.FailedPreconditionError as exc:
        if "CollectiveMismatchError" not in str(exc) or named not in str(exc):
            failures.append(f"{label}: the message lacks the runtime's error on {named!r}: {str(exc)[:300]}")
        return
    except Exception as exc:  # noqa: BLE001 - reported
        failures.append(f"{label}: raised {type(exc).__name__}: {str(exc)[:200]}")
        return
    failures.append(f"{label}: did not raise")


def every_rank(seed, shape, dtype=np.float32):
    g = np.random.default_rng(seed)
    return [(g.uniform(-100, 100, shape)).astype(dtype) for _ in range(n)]


# ---- errors are TensorFlow's, eagerly and inside tf.function
if n > 1:
    expect_raises("shape mismatch (eager)", (tf.errors.FailedPreconditionError,),
                  lambda: hvd.allreduce(tf.zeros([3 + r]), name="mismatch"))
    # inside a graph op too (py_function keeps no error type: a failed variable read raises it),
    # with the runtime's message; the fused gradient op of DistributedGradientTape alike
    expect_disagreement("dtype mismatch (tf.function)", "mismatch.fn",
                        lambda: tf.function(lambda: hvd.allreduce(tf.zeros([3], tf.float32 if r else tf.float64),
                                                                  name="mismatch.fn"))())
    weights = tf.Variable(tf.ones([2 + r]))

    @tf.function
    def tape_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(weights * weights)
        return hvd.DistributedGradientTape(tape).gradient(loss, [weights])

    expect_disagreement("gradient shapes differ (tf.function, fused)", "gradients[1 tensors", tape_step)
    # in buckets that start during backward (tiny buckets: one per gradient), a bucket's wait
    # raises it; the later buckets are dropped, and the next step, shapes alike, is exact
    os.environ.update(JUPYTER_RING_TF_BUCKET_BYTES="8", JUPYTER_RING_TF_OVERLAP="1")
    trio = [tf.Variable(tf.ones([3])), weights, tf.Variable(tf.ones([4]))]
    good = [tf.Variable(tf.fill([k + 2], float(r + 1))) for k in range(3)]

    def bucket_step(variables):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * v) for v in variables])
        return hvd.DistributedGradientTape(tape).gradient(loss, variables)

    expect_disagreement("gradient shapes differ (tf.function, buckets)", "gradients[3 tensors",
                        tf.function(lambda: bucket_step(trio)))
    got = tf.function(lambda: bucket_step(good))()
    os.environ["JUPYTER_RING_TF_OVERLAP"] = "maybe"
    expect_raises("JUPYTER_RING_TF_OVERLAP=maybe", (ValueError,), tf.function(lambda: bucket_step(good)))
    del os.environ["JUPYTER_RING_TF_BUCKET_BYTES"], os.environ["JUPYTER_RING_TF_OVERLAP"]
    close("buckets exact after the mismatch", np.concatenate([g.numpy() for g in got]),
          np.concatenate([np.full(k + 2, n + 1.0) for k in range(3)]))
    expect_raises("alltoall dim 0 not divisible", (tf.errors.InvalidArgumentError,),
                  lambda: hvd.alltoall(tf.ones([n + 1])))
    close("usable after the errors", hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="after"), [n, n])

# ---- integer scale factors (float64, truncated) and Average on ints
for dtype in (np.int32, np.int64):
    for length in (0, 1, n + 1, 13):
        xs = every_rank(length, (length,), dtype)
        got = hvd.allreduce(tf.constant(xs[r]), op=hvd.Sum, prescale_factor=0.37, name=f"pre{length}{dtype.__name__}")
        close(f"prescale {dtype.__name__} {length}", got,
              sum((x.astype(np.float64) * 0.37).astype(dtype) for x in xs) if length else xs[r])
        got = hvd.allreduce(tf.constant(xs[r]), op=hvd.Average, name=f"avg{length}{dtype.__name__}")
        close(f"average {dtype.__name__} {length}", got,
              (sum(x.astype(np.float64) for x in xs) / n).astype(dtype) if length else xs[r])

# ---- IndexedSlices: allgather of values and indices; Sum/Average only
values = [np.full((2, 3), q + 1, np.float32) for q in range(n)]
slices = tf.IndexedSlices(tf.constant(values[r]), tf.constant([r, r + 1]), dense_shape=tf.constant([n + 1, 3]))
for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
    out = hvd.allreduce(slices, op=op)
    if not isinstance(out, tf.IndexedSlices):
        failures.append(f"allreduce(IndexedSlices) returned {type(out).__name__}")
    dense = np.zeros((n + 1, 3))
    for q in range(n):
        dense[q:q + 2] += values[q] * scale
    close(f"IndexedSlices op={op}", tf.convert_to_tensor(out), dense, 1e-6)
expect_raises("IndexedSlices op=Max", (NotImplementedError,), lambda: hvd.allreduce(slices, op=hvd.Max))
expect_raises("IndexedSlices prescale", (NotImplementedError,), lambda: hvd.allreduce(slices, prescale_factor=2.0))

# ---- grouped allgather / reducescatter / alltoall with gradients, eager and tf.function
for graph in (False, True):
    def grads_of(fn, x):
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = fn(x)
            return y, tape.gradient(y, x)
        return (tf.function(run) if graph else run)(x)

    weights = tf.constant(np.arange(1, 3 * sum(q + 1 for q in range(n)) + 1, dtype=np.float32).reshape(-1, 3))
    y, g = grads_of(lambda x: tf.reduce_sum(hvd.grouped_allgather([x], name=f"ga{graph}")[0] * weights),
                    tf.ones([r + 1, 3]))
    start = sum(q + 1 for q in range(r))
    close(f"grouped_allgather grad graph={graph}", g, weights.numpy()[start:start + r + 1])
    rows = 2 * n + 1
    lo = rows // n * r + min(r, rows % n)
    hi = lo + rows // n + (1 if r < rows % n else 0)
    xs = every_rank(11, (rows, 2))
    out = hvd.grouped_reducescatter([tf.constant(xs[r])], op=hvd.Sum, name=f"grs{graph}")[0]
    close(f"grouped_reducescatter graph={graph}", out, sum(xs)[lo:hi], 1e-3)
    y, g = grads_of(lambda x: tf.reduce_sum(hvd.reducescatter(x, op=hvd.Sum, name=f"rsg{graph}") * (r + 1.0)),
                    tf.ones([rows, 2]))
    per_row = np.concatenate([np.full(((rows // n) + (1 if q < rows % n else 0), 2), q + 1.0) for q in range(n)])
    close(f"reducescatter grad graph={graph}", g, per_row * n)
    y, g = grads_of(lambda x: tf.reduce_sum(hvd.alltoall(x, splits=[1] * n, name=f"a2a{graph}")[0]
                                            * tf.range(1, n + 1, dtype=tf.float32)[:, None] * (r + 1.0)),
                    tf.ones([n, 2]))
    close(f"alltoall grad graph={graph}", g, np.array([[(q + 1.0) * (r + 1.0)] * 2 for q in range(n)]))

# ---- in-place broadcasts of variables, the topology ops
v = tf.Variable(np.full(4, float(r), np.float32))
hvd.broadcast_([v], root_rank=n - 1)
close("broadcast_", v.numpy(), np.full(4, n - 1.0))
v2 = tf.Variable(np.full(2, float(r), np.float64))
hvd.broadcast_variables([v2], root_rank=0)
close("broadcast_variables", v2.numpy(), [0.0, 0.0])
for label, op, want in (("size_op", hvd.size_op, n), ("rank_op", hvd.rank_op, r),
                        ("local_size_op", hvd.local_size_op, hvd.local_size()),
                        ("local_rank_op", hvd.local_rank_op, hvd.local_rank())):
    if int(op()) != want or int(tf.function(lambda op=op: op())()) != want:
        failures.append(f"{label}")
expect_raises("broadcast_global_variables eagerly", (RuntimeError,), lambda: hvd.broadcast_global_variables(0))

# ---- DistributedGradientTape: an embedding's IndexedSlices gradient, with and without sparse_as_dense
emb = tf.Variable(np.zeros((10, 2), np.float32))
ids = [np.array([q % 10, 9]) for q in range(n)]
want = np.zeros((10, 2))
for q in range(n):
    np.add.at(want, ids[q], 1.0 / n)
for sparse_as_dense in (False, True):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.nn.embedding_lookup(emb, ids[r]))
    grad = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense).gradient(loss, [emb])[0]
    if isinstance(grad, tf.IndexedSlices) == sparse_as_dense:
        failures.append(f"tape sparse_as_dense={sparse_as_dense}: gradient type {type(grad).__name__}")
    close(f"tape embedding sparse_as_dense={sparse_as_dense}", tf.convert_to_tensor(grad), want, 1e-6)

# ---- SyncBatchNormalization: rank r's rows == BatchNormalization on the whole batch
batch = np.random.default_rng(3).standard_normal((2 * n, 3)).astype(np.float32)
bn, sync_bn = keras.layers.BatchNormalization(), hvd.SyncBatchNormalization()
close("SyncBatchNormalization", sync_bn(batch[2 * r:2 * r + 2], training=True),
      bn(batch, training=True).numpy()[2 * r:2 * r + 2], 1e-4)
close("SyncBatchNormalization moving_variance", sync_bn.moving_variance.numpy(), bn.moving_variance.numpy(), 1e-5)

# ---- process sets in TF
if n >= 2:
    ps = hvd.add_process_set([0] if n == 2 else [0, 2])
    members = [0] if n == 2 else [0, 2]
    if r in members:
        close("allreduce on a process set", hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum, process_set=ps),
              [float(sum(members))])
        close("process_set_included_op", hvd.process_set_included_op(ps.process_set_id), 1)
    hvd.remove_process_set(ps)

# ---- TF1 graph mode: collectives, broadcast_global_variables, the error types, in a session
with tf.Graph().as_default():
    x = tf.constant(np.full(3, r + 1.0, np.float32))
    summed = hvd.allreduce(x, op=hvd.Sum, name="graph.sum")
    gathered = hvd.allgather(tf.reshape(x[:1], [1]), name="graph.gather")
    var = tf.compat.v1.get_variable("v", initializer=tf.constant(float(r)))
    bcast = hvd.broadcast_global_variables(0)
    bad = hvd.allreduce(tf.zeros([2 + r]), name="graph.bad")
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        close("graph allreduce", sess.run(summed), np.full(3, n * (n + 1) / 2))
        close("graph allgather", sess.run(gathered), np.arange(1, n + 1))
        sess.run(bcast)
        close("graph broadcast_global_variables", sess.run(var), 0.0)
        if n > 1:
            expect_disagreement("graph mismatch (TF1 session)", "graph.bad", lambda: sess.run(bad))
            close("graph allreduce after the mismatch", sess.run(summed), np.full(3, n * (n + 1) / 2))
        close("graph size_op", sess.run(hvd.size_op()), n)

# ---- Keras DistributedOptimizer config: from_config (on the instance and the class) reads the
# config without changing it, so one config rebuilds the same optimizer twice (Horovod's test_from_config)
wrapped = hvdk.DistributedOptimizer(keras.optimizers.Adam(0.003 * (r + 1)))
config = wrapped.get_config()
for label, rebuild in (("instance", wrapped.from_config), ("class", type(wrapped).from_config)):
    copy = rebuild(config)
    if copy.get_config() != config or not isinstance(copy.inner_optimizer, keras.optimizers.Adam):
        failures.append(f"DistributedOptimizer.from_config on the {label}: {copy.get_config()} != {config}")
    close(f"from_config on the {label}: learning rate", float(copy.learning_rate), 0.003 * (r + 1), 1e-7)

# ---- Keras: LearningRateScheduleCallback, BestModelCheckpoint, load_model, PartialDistributedOptimizer
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse",
              jit_compile=False)
seen = []


class Record(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        seen.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


folder = hvd.broadcast_object(tempfile.mkdtemp(prefix="hvd_keras_") if r == 0 else None)
best = hvdk.callbacks.BestModelCheckpoint(monitor="loss")
best.filepath = os.path.join(folder, f"best{r}.keras")
xs = np.random.default_rng(r).standard_normal((8, 4)).astype(np.float32)
model.fit(xs, xs[:, :1], batch_size=4, epochs=3, verbose=0, shuffle=False,
          callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0), hvdk.callbacks.MetricAverageCallback(),
                     hvdk.callbacks.LearningRateScheduleCallback(0.1, multiplier=0.5, start_epoch=1), Record(), best])
close("LearningRateScheduleCallback (staircase, 0.5 ** (epoch - 1) from epoch 1)", seen, [0.1, 0.1, 0.1, 0.1, 0.05, 0.05], 1e-7)
if not os.path.exists(best.filepath):
    failures.append("BestModelCheckpoint wrote nothing")
loaded = hvdk.load_model(best.filepath)
if not isinstance(loaded.optimizer, hvdk.DistributedOptimizer):
    failures.append(f"load_model: optimizer is {type(loaded.optimizer).__name__}")
else:
    before = [w.copy() for w in loaded.get_weights()]
    loaded.fit(xs, xs[:, :1], batch_size=4, epochs=1, verbose=0, shuffle=False)
    same = hvd.allgather_object(np.concatenate([w.ravel() for w in loaded.get_weights()]).tobytes())
    if any(np.array_equal(a, b) for a, b in zip(before, loaded.get_weights())) or len(set(same)) != 1:
        failures.append("load_model: training did not continue identically on every rank")
local = keras.layers.Dense(1)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), local])
model.compile(optimizer=hvdk.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[local]),
              loss="mse", jit_compile=False)
model.fit(xs, xs[:, :1] * (r + 1), batch_size=8, epochs=1, verbose=0,
          callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
kernels = hvd.allgather_object([w.tobytes() for w in model.get_weights()])
if n > 1 and (len({k[0] for k in kernels}) != 1 or len({k[2] for k in kernels}) == 1):
    failures.append("PartialDistributedOptimizer: shared layers must agree, the local layer must not")

hvd.barrier()  # every rank is done with the checkpoint folder
if r == 0:
    shutil.rmtree(folder, ignore_errors=True)

if failures:
    print(f"rank {r}: {len(failures)} failures:\n  " + "\n  ".join(failures[:30]), flush=True)
    sys.exit(1)
print(f"HVD_TF_OK {r}", flush=True)

"""Keras 2 (tf_keras, ``TF_USE_LEGACY_KERAS=1``): Horovod's Keras API on it, every rank checking.

``model.fit`` with ``DistributedOptimizer`` around both of Keras 2's optimizer families, the
callbacks, ``PartialDistributedOptimizer``, embeddings (sparse gradients, and ``sparse_as_dense``),
``load_model`` and ``SyncBatchNormalization``: n ranks on shards of each batch end where one
process on the whole batch ends, bit-identical on every rank. Prints ``KERAS2_OK <rank>``.
"""

import os
import sys
import tempfile

os.environ["TF_USE_LEGACY_KERAS"] = "1"   # before TensorFlow's import: tf.keras is tf_keras
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import _checks  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
keras = tf.keras

import jupyter_ring.runtime.keras as hvd  # noqa: E402
import jupyter_ring.runtime.tensorflow as hvd_tf  # noqa: E402
from jupyter_ring.runtime.tensorflow.util import optimizer_variables  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
failures = []
PER, STEPS = 3, 4          # rows per rank in each step's batch (the batch: PER * n rows)
BATCH = PER * n
assert hvd.LEGACY_KERAS and keras.layers.Layer.__module__.startswith("tf_keras."), keras.layers.Layer


def close(label, got, want, tol):
    _checks.close(failures, label, got, want, tol)


def flat(arrays):
    return np.concatenate([np.ravel(a) for a in arrays]).astype(np.float64)


def same_on_all_ranks(label, arrays):
    mine = flat(arrays)
    everyone = hvd_tf.allgather(tf.constant(mine[None]), name=f"{label}.same").numpy()
    if not all(np.array_equal(everyone[0], row) for row in everyone):
        failures.append(f"{label}: ranks are not bit-identical")


rng = np.random.default_rng(7)   # the same data on every rank; rank r trains on its rows
X = rng.standard_normal((STEPS * BATCH, 5)).astype(np.float32)
Y = rng.standard_normal((STEPS * BATCH, 2)).astype(np.float32)
MINE = np.concatenate([np.arange(s * BATCH + r * PER, s * BATCH + (r + 1) * PER) for s in range(STEPS)])


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Dense(7, activation="tanh", input_shape=(5,)), keras.layers.Dense(2)])


OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "legacy SGD": lambda: keras.optimizers.legacy.SGD(0.05, momentum=0.9),
    "legacy Adam": lambda: keras.optimizers.legacy.Adam(0.01),
}


def fit(kind, distributed, run_eagerly=False, callbacks=()):
    # the other ranks start elsewhere: BroadcastGlobalVariablesCallback gives them rank 0's model
    model = make_model(0 if not distributed or r == 0 else 10 + r)
    opt = OPTIMIZERS[kind]()
    if distributed:
        opt = hvd.DistributedOptimizer(opt)
    # Horovod's Keras 2 scripts pass experimental_run_tf_function=False: Keras 2 still takes it
    model.compile(optimizer=opt, loss="mse", metrics=["mae"], run_eagerly=run_eagerly,
                  experimental_run_tf_function=False)
    x, y, batch = (X[MINE], Y[MINE], PER) if distributed else (X, Y, BATCH)
    cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
           *callbacks] if distributed else list(callbacks)
    history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=cbs)
    return model, history.history


# ---- model.fit: both optimizer families, graph and eager train steps
for kind in OPTIMIZERS:
    reference, _ = fit(kind, False)
    want = flat(w.numpy() for w in reference.trainable_variables)
    for eager in ((False, True) if kind == "SGD" else (False,)):
        model, history = fit(kind, True, run_eagerly=eager)
        got = [w.numpy() for w in model.trainable_variables]
        close(f"fit {kind} run_eagerly={eager}", flat(got), want, 2e-5)
        same_on_all_ranks(f"fit {kind} {eager}", got)
        if type(model.optimizer).__name__ != type(OPTIMIZERS[kind]()).__name__:
            failures.append(f"{kind}: the wrapped optimizer's class is named {type(model.optimizer).__name__}")
        loss = hvd_tf.allgather(tf.constant([history["loss"][-1]], tf.float64), name=f"loss.{kind}.{eager}").numpy()
        if not np.all(loss == loss[0]):
            failures.append(f"MetricAverageCallback ({kind}): epoch losses differ between ranks: {loss}")

# ---- backward_passes_per_step=2: each rank sums two passes' gradients, the ranks reduce them at
# every second pass; the same as one process taking a step on both passes' batches at once
def fit_aggregated(average):
    model = make_model(0)
    opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.05, momentum=0.9), backward_passes_per_step=2,
                                   average_aggregated_gradients=average)
    model.compile(optimizer=opt, loss="mse")
    model.fit(X[MINE], Y[MINE], batch_size=PER, epochs=2, shuffle=False, verbose=0)
    return model, opt


for average in (True, False):
    keras.utils.set_random_seed(0)
    reference = make_model(0)
    # the sum of two passes' mean gradients is twice their mean: the rate doubles instead
    reference.compile(optimizer=keras.optimizers.legacy.SGD(0.05 if average else 0.1, momentum=0.9), loss="mse")
    reference.fit(X, Y, batch_size=2 * BATCH, epochs=2, shuffle=False, verbose=0)
    model, opt = fit_aggregated(average)
    got = [w.numpy() for w in model.trainable_variables]
    close(f"backward_passes_per_step=2 average={average}", flat(got),
          flat(w.numpy() for w in reference.trainable_variables), 2e-5)
    same_on_all_ranks(f"aggregated {average}", got)
    if (int(opt.iterations.numpy()), int(opt._agg_helper.counter.numpy())) != (2 * STEPS, 0):
        failures.append(f"backward_passes_per_step=2: iterations {opt.iterations.numpy()}, counter "
                        f"{opt._agg_helper.counter.numpy()} after {2 * STEPS} passes")

# ---- LearningRateScheduleCallback with momentum correction: at the batch where the rate changes,
# the momentum is scaled by new / old rate, and restored after it (legacy SGD's momentum is a variable)
seen = []


class Record(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        opt = self.model.optimizer
        seen.append((float(keras.backend.get_value(opt.learning_rate)), float(keras.backend.get_value(opt.momentum))))


model, _ = fit("legacy SGD", True, callbacks=[hvd.callbacks.LearningRateScheduleCallback(
    0.05, multiplier=lambda epoch: 0.5, start_epoch=1, staircase=True), Record()])
per_epoch = STEPS
expect = [(0.05, 0.9)] * per_epoch + [(0.025, 0.45)] + [(0.025, 0.9)] * (per_epoch - 1)
close("LearningRateScheduleCallback momentum correction", seen, expect, 1e-6)

# ---- PartialDistributedOptimizer: the local layer's gradient stays this rank's (scaled by 1/n)
model = make_model(0)
local = model.layers[1]
opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[local])
x, y = tf.constant(X[MINE[:PER]]), tf.constant(Y[MINE[:PER]])
with tf.GradientTape() as tape:
    loss = tf.reduce_mean((model(x) - y) ** 2)
grads_and_vars = opt.compute_gradients(loss, model.trainable_variables, tape=tape)
with tf.GradientTape() as tape:
    loss = tf.reduce_mean((model(x) - y) ** 2)
mine = tape.gradient(loss, model.trainable_variables)
every = hvd_tf.allgather(tf.constant(flat(g.numpy() for g in mine)[None]), name="partial.every").numpy()
shared = every.mean(0)
sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
offsets = np.cumsum([0] + sizes)
for i, ((g, v), m) in enumerate(zip(grads_and_vars, mine)):
    is_local = any(v is w for w in local.trainable_weights)
    want = m.numpy() / n if is_local else shared[offsets[i]:offsets[i + 1]].reshape(m.shape)
    close(f"PartialDistributedOptimizer {v.name} (local={is_local})", g.numpy(), want, 1e-5)

# ---- embeddings: IndexedSlices gradients by allgather, or densified with sparse_as_dense
IDS = rng.integers(0, 11, (STEPS * BATCH, 3))
TARGET = rng.standard_normal((STEPS * BATCH, 3, 4)).astype(np.float32)


def fit_embedding(distributed, sparse_as_dense=False):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.layers.Embedding(11, 4, input_length=3)])
    opt = keras.optimizers.legacy.SGD(0.5)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, sparse_as_dense=sparse_as_dense)
    model.compile(optimizer=opt, loss="mse")
    ids, target, batch = (IDS[MINE], TARGET[MINE], PER) if distributed else (IDS, TARGET, BATCH)
    model.fit(ids, target, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()[0]


want = fit_embedding(False)
for dense in (False, True):
    got = fit_embedding(True, dense)
    close(f"embedding sparse_as_dense={dense}", got, want, 1e-5)
    same_on_all_ranks(f"embedding {dense}", [got])

# ---- load_model: the optimizer comes back distributed, with its saved state
model, _ = fit("legacy Adam", True)
path = os.path.join(tempfile.gettempdir(), f"jupyter_ring-keras2-{os.getpid()}.h5")
model.save(path)  # HDF5: Keras 2's format that keeps the optimizer's slots
loaded = hvd.load_model(path)
os.unlink(path)
if not hasattr(loaded.optimizer, "register_local_var"):
    failures.append(f"load_model: the optimizer is not distributed ({type(loaded.optimizer).__mro__})")
close("load_model optimizer state", flat(v.numpy() for v in optimizer_variables(loaded.optimizer)),
      flat(v.numpy() for v in optimizer_variables(model.optimizer)), 0)
loaded.fit(X[MINE[:PER]], Y[MINE[:PER]], batch_size=PER, epochs=1, verbose=0)
same_on_all_ranks("load_model then fit", [w.numpy() for w in loaded.trainable_variables])

# ---- SyncBatchNormalization: every rank's slice normalised with the whole batch's statistics
whole = rng.standard_normal((2 * n + 1, 3)).astype(np.float32) * 3 + 1   # rank r: rows of r::n
bn = keras.layers.BatchNormalization(fused=False)
sync = hvd_tf.SyncBatchNormalization()
want = bn(tf.constant(whole), training=True).numpy()
got = sync(tf.constant(whole[r::n]), training=True).numpy()
close("SyncBatchNormalization", got, want[r::n], 1e-4)
close("SyncBatchNormalization moving mean", sync.moving_mean.numpy(), bn.moving_mean.numpy(), 1e-5)

# ---- bad input: a Keras 3 optimizer is not Keras 2's
import keras as keras3  # noqa: E402

try:
    hvd.DistributedOptimizer(keras3.optimizers.SGD(0.1))
    failures.append("DistributedOptimizer(Keras 3 optimizer) did not raise")
except TypeError as exc:
    if "tf_keras" not in str(exc):
        failures.append(f"DistributedOptimizer(Keras 3 optimizer): unclear error {exc}")

if failures:
    print(f"rank {r}: {len(failures)} failures:\n  " + "\n  ".join(failures[:20]), flush=True)
    sys.exit(1)
print(f"KERAS2_OK {r}", flush=True)

"""Horovod's classic TensorFlow 1 tutorial, graph mode, with only its import changed.

The style of Horovod's tensorflow_mnist.py: ``tf.compat.v1`` graph, ConfigProto, a
``tf.compat.v1.train`` optimizer wrapped in ``hvd.DistributedOptimizer``, learning rate scaled
by ``hvd.size()``, ``hvd.BroadcastGlobalVariablesHook(0)``, ``StopAtStepHook``,
``MonitoredTrainingSession`` with checkpoints on rank 0 only. Each rank starts from its own
random weights (the hook must fix that) and trains on its shard of every batch.

Every rank checks: its weights after training equal one process trained on the full batches
(same graph without Horovod), bit-identical on every rank; only rank 0 wrote checkpoints; a
second session restores rank 0's checkpoint and the hook gives every rank those weights.
Prints ``TF_TUTORIAL_OK <rank>``.
"""

import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import jupyter_ring.runtime.tensorflow as hvd  # noqa: E402 - the one line a Horovod script changes

tf.compat.v1.disable_eager_execution()
hvd.init()
r, n = hvd.rank(), hvd.size()
failures = []
BATCH, STEPS, FEATURES, CLASSES = 12, 6, 20, 5


def batches():
    g = np.random.default_rng(7)
    for _ in range(STEPS):
        yield (g.standard_normal((BATCH, FEATURES)).astype(np.float32),
               g.integers(0, CLASSES, BATCH).astype(np.int64))


def build(seed, distributed):
    """The tutorial's model: a two-layer perceptron on placeholders; returns what training needs."""
    tf.compat.v1.set_random_seed(seed)
    image = tf.compat.v1.placeholder(tf.float32, [None, FEATURES], name="image")
    label = tf.compat.v1.placeholder(tf.int64, [None], name="label")
    w1 = tf.compat.v1.get_variable("w1", [FEATURES, 16], initializer=tf.compat.v1.glorot_uniform_initializer())
    b1 = tf.compat.v1.get_variable("b1", [16], initializer=tf.compat.v1.zeros_initializer())
    w2 = tf.compat.v1.get_variable("w2", [16, CLASSES], initializer=tf.compat.v1.glorot_uniform_initializer())
    logits = tf.matmul(tf.nn.relu(tf.matmul(image, w1) + b1), w2)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=label, logits=logits))
    # Horovod: scale the learning rate by the number of workers
    opt = tf.compat.v1.train.MomentumOptimizer(0.01 * n, momentum=0.9)
    if distributed:
        # Horovod: add Horovod Distributed Optimizer
        opt = hvd.DistributedOptimizer(opt)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    train_op = opt.minimize(loss, global_step=global_step)
    return image, label, train_op, [w1, b1, w2], global_step


def shard(a):
    per = BATCH // n
    return a[r * per:(r + 1) * per]


class Keep(tf.compat.v1.train.SessionRunHook):
    """Reads the variables when the session ends (the tutorial's model, inspected)."""

    def __init__(self, variables):
        self.variables, self.values = variables, None

    def end(self, session):
        self.values = session.run(self.variables)


# ---- the reference: one process, full batches, no Horovod
with tf.Graph().as_default():
    image, label, train_op, variables, _ = build(0, distributed=False)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for xs, ys in batches():
            sess.run(train_op, feed_dict={image: xs, label: ys})
        want = sess.run(variables)

# ---- the tutorial, with rank 0's random start (seed 0) broadcast by the hook
checkpoint_root = hvd.broadcast_object(tempfile.mkdtemp(prefix="tf_tutorial_") if r == 0 else None)
with tf.Graph().as_default():
    image, label, train_op, variables, global_step = build(r, distributed=True)
    config = tf.compat.v1.ConfigProto()
    config.gpu_options.allow_growth = True
    config.gpu_options.visible_device_list = str(hvd.local_rank())
    keep = Keep(variables)
    hooks = [
        # Horovod: BroadcastGlobalVariablesHook broadcasts initial variable states from rank 0 to all
        # other processes.
        hvd.BroadcastGlobalVariablesHook(0),
        tf.compat.v1.train.StopAtStepHook(last_step=STEPS),
        keep,
    ]
    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    checkpoint_dir = checkpoint_root if hvd.rank() == 0 else None
    data = batches()
    with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, hooks=hooks, config=config,
                                                     save_checkpoint_steps=STEPS, log_step_count_steps=None,
                                                     save_summaries_steps=None) as mon_sess:
        while not mon_sess.should_stop():
            xs, ys = next(data)
            mon_sess.run(train_op, feed_dict={image: shard(xs), label: shard(ys)})
    got = keep.values

for name, g, w in zip(("w1", "b1", "w2"), got, want):
    if not np.allclose(g, w, rtol=1e-5, atol=1e-6):
        failures.append(f"{name}: differs from one process on the full batches (max {np.abs(g - w).max():.3g})")
flat = np.concatenate([g.ravel() for g in got])
everyone = hvd.allgather_object(flat.tobytes(), name="tutorial.same")
if len(set(everyone)) != 1:
    failures.append("ranks are not bit-identical after training")
files = hvd.allgather_object(sorted(os.listdir(checkpoint_root)) if r == 0 else None, name="tutorial.files")
if not any(f.startswith("model.ckpt") for f in files[0]):
    failures.append(f"rank 0 wrote no checkpoint: {files[0]}")

# ---- resume: rank 0 restores its checkpoint, the hook gives every rank the restored weights
class AtStart(tf.compat.v1.train.SessionRunHook):
    """Reads the variables once the session exists (after the hooks before it ran)."""

    def __init__(self, variables):
        self.variables, self.values = variables, None

    def after_create_session(self, session, coord):
        self.values = session.run(self.variables)


with tf.Graph().as_default():
    image, label, train_op, variables, global_step = build(100 + r, distributed=True)
    start = AtStart(variables + [global_step])
    hooks = [hvd.BroadcastGlobalVariablesHook(0), start]
    with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_root if r == 0 else None,
                                                     hooks=hooks, save_checkpoint_steps=None, save_checkpoint_secs=None,
                                                     log_step_count_steps=None, save_summaries_steps=None):
        pass
    restored = start.values
if int(restored[-1]) != STEPS:
    failures.append(f"restored global_step {restored[-1]} != {STEPS}")
for name, g, w in zip(("w1", "b1", "w2"), restored, got):
    if not np.array_equal(g, w):
        failures.append(f"{name}: rank {r} did not get rank 0's restored checkpoint")

if failures:
    print(f"rank {r}: {len(failures)} failures:\n  " + "\n  ".join(failures), flush=True)
    sys.exit(1)
print(f"TF_TUTORIAL_OK {r}", flush=True)

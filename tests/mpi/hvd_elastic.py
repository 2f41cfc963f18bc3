"""``hvd.elastic`` for a fixed world, torch, TensorFlow and Keras in one launch.

Every rank starts from its own values (``rank``-dependent) and checks its own results: ``sync``
gives every rank rank 0's (attributes, model parameters, optimizer state, TF/Keras variables and
optimizer slots); ``restore`` goes back to the last commit; ``commit`` then ``restore`` keeps
the new values; ``run`` retries after ``HorovodInternalError`` from the last commit (reset
callbacks called once per reset) and gives up after ``reset_limit`` failures in a row with an
error that says so; TensorFlow's ``run`` counts a failed graph op's error as
``HorovodInternalError``; the Keras callbacks keep ``state.epoch``/``state.batch`` and commit
through ``model.fit``. Prints ``HVD_ELASTIC_OK <rank>``.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import jupyter_ring.runtime.torch as hvd  # noqa: E402

hvd.init()
r, n = hvd.rank(), hvd.size()
failures = []


def same(label, got, want):
    got, want = (np.asarray(t.detach() if isinstance(t, torch.Tensor) else t, np.float64) for t in (got, want))
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6, atol=1e-6):
        failures.append(f"{label}: got {got.ravel()[:6]} want {want.ravel()[:6]}")


def equal(label, got, want):
    if got != want:
        failures.append(f"{label}: got {got!r} want {want!r}")


# ---------------------------------------------------------------- torch: TorchState
torch.manual_seed(100 + r)  # each rank its own initial weights
model = torch.nn.Linear(5, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.randn(4, 5) * (r + 1)).sum().backward()
opt.step()  # momentum buffers differ between ranks
root_params = hvd.broadcast_object({k: v.clone() for k, v in model.state_dict().items()}, 0)
root_momentum = hvd.broadcast_object([opt.state[p]["momentum_buffer"].clone() for p in model.parameters()], 0)

state = hvd.elastic.TorchState(model, opt, epoch=10 + r, batch=20 + r, history=[r])
state.sync()
for k, v in model.state_dict().items():
    same(f"torch sync {k}", v, root_params[k])
for p, want in zip(model.parameters(), root_momentum):
    same("torch sync momentum", opt.state[p]["momentum_buffer"], want)
equal("torch sync epoch", (state.epoch, state.batch, state.history), (10, 20, [0]))

synced = {k: v.clone() for k, v in model.state_dict().items()}
with torch.no_grad():
    model.weight.add_(1.0 + r)
state.epoch, state.batch = 11, 21
state.restore()  # nothing committed since sync: back to the synced values (sync saves)
same("torch restore", model.weight, synced["weight"])
equal("torch restore epoch", (state.epoch, state.batch), (10, 20))

with torch.no_grad():
    model.weight.add_(2.0)
state.epoch = 12
state.commit()
with torch.no_grad():
    model.weight.mul_(-3.0)
state.epoch = 13
state.restore()  # back to the commit, not to the sync
same("torch commit then restore", model.weight, synced["weight"] + 2.0)
equal("torch commit epoch", state.epoch, 12)

# ---------------------------------------------------------------- run: retry from the commit
attempts, resets = [], []
state.register_reset_callbacks([lambda: resets.append(state.epoch)])


@hvd.elastic.run
def train(state, steps):
    attempts.append(state.epoch)
    for _ in range(steps):
        state.epoch += 1
        hvd.allreduce(torch.ones(3), name=f"step.{state.epoch}")  # a collective of the attempt
        if len(attempts) == 1 and state.epoch == 14:  # the first attempt fails half way, on every rank
            raise hvd.HorovodInternalError("a peer went away (simulated)")
        state.commit()
    return state.epoch


equal("run result", train(state, 3), 16)  # committed 13, failed at 14, restored 13, then 14, 15, 16
equal("run attempts (epoch at start)", attempts, [12, 13])
equal("run reset callbacks", resets, [13])


@hvd.elastic.run
def always_fails(state):
    raise hvd.HorovodInternalError("broken for good")


try:
    always_fails(state)
    failures.append("run: a function failing every time did not raise")
except hvd.HorovodInternalError as exc:
    if "4 attempts in a row failed" not in str(exc) or "reset_limit=3" not in str(exc):
        failures.append(f"run: unclear final error: {exc}")

# ---------------------------------------------------------------- TensorFlow and Keras
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import jupyter_ring.runtime.keras as hvdk  # noqa: E402
import jupyter_ring.runtime.tensorflow as hvdtf  # noqa: E402

v = float(r + 1)
variables = [tf.Variable(np.full((2, 3), v)), tf.Variable(np.arange(4.0) * v)]
tstate = hvdtf.elastic.TensorFlowState(variables, batch=20 + r)
tstate.sync()
same("tf sync 0", variables[0].numpy(), np.full((2, 3), 1.0))
same("tf sync 1", variables[1].numpy(), np.arange(4.0))
equal("tf sync batch", tstate.batch, 20)
variables[0].assign(np.full((2, 3), -5.0))
tstate.batch = 99
tstate.restore()
same("tf restore", variables[0].numpy(), np.full((2, 3), 1.0))
equal("tf restore batch", tstate.batch, 20)
variables[1].assign(np.arange(4.0) + 7)
tstate.commit()
variables[1].assign(np.zeros(4))
tstate.restore()
same("tf commit then restore", variables[1].numpy(), np.arange(4.0) + 7)

# run: a collective that failed inside a tf.function is a TensorFlow error, counted as
# HorovodInternalError (a subclass's name in the message, as the respawn's error will be)
class RankLostError(hvd.HorovodInternalError):
    pass


def lost():
    raise RankLostError("a peer went away (simulated)")


def divide_by_zero():
    return 1 / 0


@tf.function
def graph_op(fn):
    return tf.py_function(fn, [], tf.float32)


tf_attempts = []


@hvdtf.elastic.run
def tf_train(state):
    tf_attempts.append(state.batch)
    if len(tf_attempts) == 1:
        state.batch += 1  # not committed: the retry starts from the commit
        graph_op(lost)
    return state.batch


equal("tf run after a failed graph op", (tf_train(tstate), tf_attempts), (20, [20, 20]))


@hvdtf.elastic.run
def tf_other_error(state):
    graph_op(divide_by_zero)


try:
    tf_other_error(tstate)
    failures.append("tf run: a graph op's ZeroDivisionError was swallowed")
except tf.errors.OpError as exc:
    if "ZeroDivisionError" not in str(exc):
        failures.append(f"tf run: unexpected error {exc}")

keras.utils.set_random_seed(200 + r)
net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
adam = keras.optimizers.Adam(0.01)
x = np.random.default_rng(r).standard_normal((8, 4)).astype(np.float32)
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(net(x) ** 2)
adam.apply_gradients(zip(tape.gradient(loss, net.trainable_variables), net.trainable_variables))
root_weights = hvd.broadcast_object([w for w in net.get_weights()], 0)
root_slots = hvd.broadcast_object([s.numpy() for s in adam.variables], 0)
kstate = hvdk.elastic.KerasState(net, adam, epoch=10 + r, batch=20 + r)
kstate.sync()
for got, want in zip(net.get_weights(), root_weights):
    same("keras sync weights", got, want)
for got, want in zip(adam.variables, root_slots):
    same(f"keras sync optimizer {got.path}", got.numpy(), want)
equal("keras sync attributes", (kstate.epoch, kstate.batch), (10, 20))
synced = net.get_weights()
net.set_weights([w + 1 for w in synced])
kstate.restore()
for got, want in zip(net.get_weights(), synced):
    same("keras restore", got, want)

# the callbacks through model.fit: 2 epochs of 3 batches (ranks alike)
net.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
fstate = hvdk.elastic.KerasState(net, epoch=0, batch=0)
commits = []
real_commit = fstate.commit
fstate.commit = lambda: (commits.append((fstate.epoch, fstate.batch)), real_commit())
g = np.random.default_rng(7)
net.fit(g.standard_normal((12 * n, 4)).astype(np.float32)[r::n], g.standard_normal((12 * n, 3)).astype(np.float32)[r::n],
        batch_size=4, epochs=2, verbose=0, shuffle=False,
        callbacks=[hvdk.elastic.UpdateBatchStateCallback(fstate), hvdk.elastic.UpdateEpochStateCallback(fstate),
                   hvdk.elastic.CommitStateCallback(fstate, batches_per_commit=2)])
equal("fit state", (fstate.epoch, fstate.batch), (2, 0))
# a commit every 2nd batch, counted across epochs (as Horovod's), and at each epoch's end, after
# the epoch and batch callbacks (first in the list): batches 1; end; 0 (4th), 2 (6th); end
equal("fit commits", commits, [(0, 1), (1, 0), (1, 0), (1, 2), (2, 0)])

if failures:
    print(f"rank {r} FAILED:\n  " + "\n  ".join(failures), flush=True)
    sys.exit(1)
print(f"HVD_ELASTIC_OK {r}", flush=True)

"""Elastic training goes on by itself through a rank's death (issue 34, item 2): a real kernel, a
real cluster of 2 and of 4 ranks (4 outnumber the 2 cores), a real SIGKILL of one rank in the
middle of an epoch of ``hvd.elastic.run`` (``TorchState`` with a model, a ``DistributedOptimizer``
with momentum, an ``ElasticSampler`` and attributes): the last rank, or rank 0, whose state the
sync usually broadcasts (the survivors then take the first of them as the source). The cell
succeeds: the survivors give the failed step up, go back to their last commit, run their reset
callback, take the replacement in and sync the state to it; the new rank runs the same cell from
its start. Every rank then checks that its final weights equal, bit for bit, those of the same
cell run without the kill, that the steps run twice are at most those since the last commit, and
that every sample of each epoch was trained on exactly once (the sampler's padding apart).
The same for Keras (``TensorFlowKerasState``, a custom loop with ``DistributedGradientTape``, as
Horovod's elastic TensorFlow 2 example), with the rank SIGKILLed by the test itself.
One kernel and cluster per world size serve its tests (the clean run is made once). Without
``elastic.run`` the cell fails with DeadRankError: tests/reliability/test_respawn_notebook.py."""

import json
import os
import re
import signal
import threading
import time

import pytest

from bounds import GONE_S
from real_kernel import alive_after, cluster_pids, ring_kernel
from jupyter_ring.server._clusters import describe_cluster
from reliability.test_respawn_notebook import CLUSTER, xfail_on_survivor_abort
from test_dashboard_kernel import dashboards

pytest.importorskip("torch", reason="needs torch: pip install 'jupyter_ring[torch]'")
pytestmark = pytest.mark.timeout(300)

# both training cells: a reset callback that notes the step it went back to, a log of the steps
# each rank completed, and the elastic loop over the epochs
RESETS_AND_LOG = """\
resets = []
state.register_reset_callbacks([lambda: resets.append(state.step)])
log = open(os.path.join({logs!r}, f"rank{{hvd.rank()}}.jsonl"), "a")
log.write(json.dumps({{"start": time.time()}}) + "\\n")

@hvd.elastic.run
def train(state):
    while state.epoch < EPOCHS:
"""

# 53 samples a rank (a prime; no padding, which an ElasticSampler takes from the samples left
# after a reset, as Horovod's: a run with a reset would then differ from one without in its last
# batch), batches of 4 (13, then 1); a commit every 3 steps; rank VICTIM kills itself (SIGKILL) in
# its 9th step (state.step 8), between backward() and step() (its gradients' allreduce launched,
# the survivors waiting in it), 2 steps after the last commit. VICTIM 0 is the rank whose state
# the sync broadcasts: the survivors take the first of them as the source instead.
TRAIN = """\
%%distributed
import json, os, signal, time
import torch
import jupyter_ring.runtime.torch as hvd

N, BATCH, EPOCHS, COMMIT, KILL_AT, VICTIM, PACE = 53 * hvd.size(), 4, 2, 3, {kill_at}, {victim}, {pace}
data = torch.Generator().manual_seed(1)
X = torch.randn(N, 7, dtype=torch.float64, generator=data)
Y = X @ torch.linspace(-1, 1, 7, dtype=torch.float64).unsqueeze(1) + 0.1 * torch.randn(N, 1, dtype=torch.float64, generator=data)
torch.manual_seed(100 + hvd.rank())  # each rank its own start: the sync gives every rank rank 0's
model = torch.nn.Linear(7, 1).double()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(range(N), shuffle=True, seed=3)
state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, step=0)
""" + RESETS_AND_LOG + """\
        mine = list(state.sampler)
        for b in range(0, len(mine), BATCH):
            batch = mine[b:b + BATCH]
            at = state.sampler.processed_num
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(X[batch]), Y[batch]).backward()
            if state.step == KILL_AT and hvd.rank() == VICTIM and "original" in globals():
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            time.sleep(PACE)  # (benchmarks/elastic_respawn.py: a step that takes time, for an outside kill)
            log.write(json.dumps({{"epoch": state.epoch, "at": at, "step": state.step, "batch": batch,
                                  "t": time.time()}}) + "\\n")
            log.flush()
            state.sampler.record_batch(b // BATCH, BATCH)
            state.step += 1
            if state.step % COMMIT == 0:
                state.commit()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()

train(state)
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
print("WEIGHTS", weights.numpy().tobytes().hex(), state.step, hvd.size(), json.dumps(resets))
"""

# On every rank: the effective batches (the last one logged for each place in each epoch, a step
# given up and run again counts once) cover each epoch's samples exactly once, the padding apart.
CHECK = """\
%%distributed
import collections, json, os
effective, runs = {{}}, collections.Counter()
for r in range(hvd.size()):
    for line in open(os.path.join({logs!r}, f"rank{{r}}.jsonl")):
        rec = json.loads(line)
        if "start" in rec:
            continue
        effective[(r, rec["epoch"], rec["at"])] = rec["batch"]
        runs[(r, rec["step"])] += 1
ok = True
for epoch in range(EPOCHS):
    seen = collections.Counter(i for (r, e, _), batch in effective.items() if e == epoch for i in batch)
    padding = -N % hvd.size()
    ok &= sorted(seen) == list(range(N)) and sum(seen.values()) == N + padding
    ok &= sum(c - 1 for c in seen.values()) == padding
twice = sorted({{step for (r, step), c in runs.items() if c > 1}})
print("CHECK", ok, json.dumps(twice))
"""


def rank_lines(text, rank, tag):
    prefix = f"[rank {rank}] {tag} "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def weights_of(out, n):
    found = {r: rank_lines(out, r, "WEIGHTS") for r in range(n)}
    assert all(len(v) == 1 for v in found.values()), out
    return {r: v[0].split(" ", 3) for r, v in found.items()}


class World:
    """A kernel with an n-rank cluster (``--max-restarts 6``), shared by a module's tests of that
    size; ``clean(cell)``: the weights and check of ``cell`` run without a kill, run once."""

    def __init__(self, kernel, n, logs):
        self.kernel, self.n, self.logs = kernel, n, logs
        self.pids = set(cluster_pids(kernel))
        self._clean = {}

    def clean(self, train, check):
        if train not in self._clean:
            logs = self.folder("clean")
            out = self.kernel.ok(train.format(kill_at=-1, victim=-1, pace=0, logs=logs), timeout=200)
            self._clean[train] = (weights_of(out, self.n), self.kernel.ok(check.format(logs=logs)))
        return self._clean[train]

    def folder(self, name):
        path = self.logs / f"{name}-{len(list(self.logs.iterdir()))}"
        path.mkdir()
        return str(path)


@pytest.fixture(scope="module")
def world(request, tmp_path_factory):
    n = request.param
    with ring_kernel(start=f"%ring start -n {n} --max-restarts 6") as kernel:
        world = World(kernel, n, tmp_path_factory.mktemp(f"elastic{n}"))
        yield world
        world.pids |= set(cluster_pids(kernel))
        kernel.ok("%ring stop", timeout=60)
    left = alive_after(world.pids, GONE_S)
    assert left == [], [p.cmdline() for p in left]


def said_replaced(out, victim):
    """The kernel said which rank died, how, and was replaced, and that elastic.run goes on (the
    keeper's line with the signal may follow the nanny's: RingCluster.describe_death waits for it;
    a victim that was the last rank of its job, a replacement, is read from the text ipyparallel
    kept of the ended job's removed file: "died." was seen in CI rehearsals without it)."""
    assert re.search(rf"rank {victim} @ \S+ died \(signal: Killed\)\. Rank\(s\) {victim} replaced in place in [0-9.]+ s "
                     r"\(restart \d of --max-restarts 6\); elastic\.run goes on from its last commit", out), out


def assert_as_without_the_kill(world, out, check, clean, victim):
    """Every rank ended with the clean run's weights (bit for bit), the survivors reset once back
    to their commit at step 6, the newcomer never; each sample of an epoch trained on once; the
    steps run twice are the 2 completed since that commit (logged 6 and 7), at most the 3
    between two commits; the step the victim died in (8) never completed anywhere."""
    killed = weights_of(out, world.n)
    clean_weights, clean_check = clean
    for rank in range(world.n):
        hexed, steps, size, resets = killed[rank]
        assert (hexed, steps, size) == (clean_weights[rank][0], clean_weights[rank][1], str(world.n)), \
            (killed, clean_weights)
        assert json.loads(resets) == ([] if rank == victim else [6]), (rank, resets)
        assert json.loads(clean_weights[rank][3]) == []
        ok, twice = rank_lines(check, rank, "CHECK")[0].split(" ", 1)
        assert ok == "True" and json.loads(twice) == [6, 7], check
        assert rank_lines(clean_check, rank, "CHECK") == ["True []"], clean_check
    assert len({w[0] for w in killed.values()}) == 1, killed


# the last rank, and rank 0 (the sync's usual source), of 2 and of 4 ranks (4 outnumber the cores)
@pytest.mark.parametrize("world", [2, 4], indirect=True, ids=lambda n: f"{n}ranks")
@pytest.mark.parametrize("victim", ["last", 0], ids=lambda v: f"kill-{v}")
def test_elastic_run_goes_on_through_a_sigkilled_rank_and_ends_as_without_the_kill(world, victim):
    victim = world.n - 1 if victim == "last" else victim
    kernel = world.kernel
    clean = world.clean(TRAIN, CHECK)
    logs = world.folder(f"killed{victim}")
    kernel.ok("%%distributed\noriginal = True")
    world.pids |= set(cluster_pids(kernel))
    messages = []
    out, error = kernel.execute(TRAIN.format(kill_at=8, victim=victim, pace=0, logs=logs), timeout=200,
                                messages=messages)
    xfail_on_survivor_abort(error, kernel)
    assert error is None, (out, error)
    said_replaced(out, victim)  # and the cell went on to its end on every rank
    check = kernel.ok(CHECK.format(logs=logs))
    assert_as_without_the_kill(world, out, check, clean, victim)
    dashboard_shows_the_replacement(world, kernel, messages, victim)


def dashboard_shows_the_replacement(world, kernel, messages, victim):
    """Issue 34 item 4: the cell's dashboard has the replaced rank's row, saying so, with the new
    engine's optimizer steps (it ran the cell from its start: 2 epochs of 14 batches less those
    the survivors had committed, 6), every other row as the survivors ran it (28 + the 2 steps
    given up); the Ring panel's description counts the replacement."""
    (text, _), = dashboards(messages)
    assert len([line for line in text.splitlines() if line.startswith("rank ")]) == world.n, text
    for rank in range(world.n):
        line = next(line for line in text.splitlines() if line.startswith(f"rank {rank}: "))
        if rank == victim:
            # "at step N" where the dashboard had the dead engine's steps; "replaced" alone where
            # the kill came before the dashboard was made (its first report of work, under load)
            assert re.match(rf"rank {rank}: step 22, replaced(?: at step [1-8])?, ", line), text
        else:
            assert re.match(rf"rank {rank}: step 30, \d", line) and "replaced" not in line, text
    path = kernel.ok(f"print({CLUSTER}._running_cluster.cluster_file)").strip()
    described = describe_cluster(path)
    replaced = {r["rank"]: r["replaced"] for r in described["ranks"]}
    assert replaced[victim] >= 1 and described["restarts"]["used"] >= 1, described
    assert all(replaced[r] == 0 for r in replaced if r != victim) or described["restarts"]["used"] > 1, described


# Keras under Horovod's elastic custom loop (horovod's examples/elastic/tensorflow2: a
# TensorFlowKerasState of the model and its optimizer, GradientTape + DistributedGradientTape,
# a commit every few steps). 53 samples a rank in a per-epoch permutation dealt out by rank,
# batches of 4, a commit every 3 steps, float64. The optimizer is not built before the state is
# made: its momentum slots come at its first step on the survivors, never on the newcomer before
# the sync. At state.step KILL_AT, rank VICTIM says so in a file and waits there, outside the
# gradients' allreduce the survivors wait in, until the test SIGKILLs it.
KERAS_TRAIN = """\
%%distributed
import json, os, time
import numpy as np
import keras
import tensorflow as tf
import jupyter_ring.runtime.tensorflow as hvd

N, BATCH, EPOCHS, COMMIT, KILL_AT, VICTIM, PACE = 53 * hvd.size(), 4, 2, 3, {kill_at}, {victim}, {pace}
data = np.random.default_rng(1)
X = data.standard_normal((N, 7))
Y = X @ np.linspace(-1, 1, 7)[:, None] + 0.1 * data.standard_normal((N, 1))
keras.utils.set_random_seed(100 + hvd.rank())  # each rank its own start: the sync gives every rank the source's
model = keras.Sequential([keras.Input((7,), dtype="float64"), keras.layers.Dense(1, dtype="float64")])
opt = keras.optimizers.SGD(0.05, momentum=0.9)
state = hvd.elastic.TensorFlowKerasState(model, opt, epoch=0, batch=0, step=0)
""" + RESETS_AND_LOG + """\
        mine = np.random.default_rng(1000 + state.epoch).permutation(N)[hvd.rank()::hvd.size()]
        while state.batch * BATCH < len(mine):
            at = state.batch * BATCH
            batch = mine[at:at + BATCH].tolist()
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(X[batch]) - Y[batch]) ** 2)
            if state.step == KILL_AT and hvd.rank() == VICTIM and "original" in globals():
                open(os.path.join({logs!r}, "victim"), "w").write(str(os.getpid()))
                while True:  # until the test's SIGKILL
                    time.sleep(0.01)
            grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            time.sleep(PACE)  # (benchmarks/elastic_respawn.py: a step that takes time, for an outside kill)
            log.write(json.dumps({{"epoch": state.epoch, "at": at, "step": state.step, "batch": batch,
                                  "t": time.time()}}) + "\\n")
            log.flush()
            state.batch += 1
            state.step += 1
            if state.step % COMMIT == 0:
                state.commit()
        state.epoch += 1
        state.batch = 0
        state.commit()

train(state)
weights = np.concatenate([w.ravel() for w in model.get_weights()])
print("WEIGHTS", weights.tobytes().hex(), state.step, hvd.size(), json.dumps(resets))
"""


def kill_when_waiting(logs, timeout):
    """A thread that SIGKILLs the process whose pid appears in ``logs``/victim; the kill times."""
    killed = []

    def killer():
        path, deadline = os.path.join(logs, "victim"), time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pid = int(open(path).read())
            except (OSError, ValueError):  # not there yet, or half written
                time.sleep(0.01)
                continue
            killed.append(time.time())
            os.kill(pid, signal.SIGKILL)
            return

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    return thread, killed


@pytest.mark.parametrize("world", [2], indirect=True, ids=lambda n: f"{n}ranks")
def test_keras_elastic_run_goes_on_through_a_rank_sigkilled_by_the_test(world):
    pytest.importorskip("tensorflow", reason="needs tensorflow: pip install 'jupyter_ring[tensorflow]'")
    kernel, victim = world.kernel, 1
    clean = world.clean(KERAS_TRAIN, CHECK)
    logs = world.folder("keras-killed")
    kernel.ok("%%distributed\noriginal = True")
    world.pids |= set(cluster_pids(kernel))
    thread, killed = kill_when_waiting(logs, timeout=200)
    out, error = kernel.execute(KERAS_TRAIN.format(kill_at=8, victim=victim, pace=0, logs=logs), timeout=200)
    thread.join(1)
    xfail_on_survivor_abort(error, kernel)
    assert error is None and killed, (out, error)
    said_replaced(out, victim)
    check = kernel.ok(CHECK.format(logs=logs))
    assert_as_without_the_kill(world, out, check, clean, victim)


# Keras' model.fit with Horovod's elastic callbacks (horovod's examples/elastic
# tensorflow2_keras_mnist_elastic.py: KerasState, UpdateEpochStateCallback,
# UpdateBatchStateCallback, CommitStateCallback; a DistributedOptimizer compiled in). fit starts an
# epoch from its first batch, so the state commits at each epoch's end only: a reset goes back to
# the start of the epoch it gave up, and the run ends as one without the kill. 53 samples a rank,
# batches of 4 (14 a epoch), 3 epochs; rank VICTIM waits to be SIGKILLed at the start of its
# KILL_AT-th batch (epoch 1, batch 5).
FIT = """\
%%distributed
import json, os, time
import numpy as np
import keras
import jupyter_ring.runtime.keras as hvd

N, BATCH, EPOCHS, KILL_AT, VICTIM = 53 * hvd.size(), 4, 3, {kill_at}, {victim}
data = np.random.default_rng(1)
X = data.standard_normal((N, 7))
Y = X @ np.linspace(-1, 1, 7)[:, None] + 0.1 * data.standard_normal((N, 1))
mine = np.arange(N)[hvd.rank()::hvd.size()]
keras.utils.set_random_seed(100 + hvd.rank())
model = keras.Sequential([keras.Input((7,), dtype="float64"), keras.layers.Dense(1, dtype="float64")])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
state = hvd.elastic.KerasState(model, epoch=0, batch=0)
resets, begun = [], []
state.register_reset_callbacks([lambda: resets.append(state.epoch)])

class Gate(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        begun.append(state.epoch)
        if len(begun) == KILL_AT and hvd.rank() == VICTIM and "original" in globals():
            open(os.path.join({logs!r}, "victim"), "w").write(str(os.getpid()))
            while True:  # until the test's SIGKILL
                time.sleep(0.01)

callbacks = [Gate(), hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.CommitStateCallback(state, batches_per_commit=10**6)]

@hvd.elastic.run
def train(state):
    model.fit(X[mine], Y[mine], batch_size=BATCH, shuffle=False, epochs=EPOCHS - state.epoch,
              callbacks=callbacks, verbose=0)

train(state)
weights = np.concatenate([w.ravel() for w in model.get_weights()])
print("WEIGHTS", weights.tobytes().hex(), state.epoch, hvd.size(), json.dumps([resets, len(begun)]))
"""


@pytest.mark.parametrize("world", [2], indirect=True, ids=lambda n: f"{n}ranks")
def test_keras_fit_with_horovods_elastic_callbacks_goes_on_through_a_sigkilled_rank(world):
    pytest.importorskip("tensorflow", reason="needs tensorflow: pip install 'jupyter_ring[tensorflow]'")
    kernel, victim = world.kernel, 1
    logs = world.folder("fit-clean")
    clean = weights_of(kernel.ok(FIT.format(kill_at=-1, victim=-1, logs=logs), timeout=200), 2)
    logs = world.folder("fit-killed")
    kernel.ok("%%distributed\noriginal = True")
    world.pids |= set(cluster_pids(kernel))
    thread, killed = kill_when_waiting(logs, timeout=200)
    out, error = kernel.execute(FIT.format(kill_at=20, victim=victim, logs=logs), timeout=200)
    thread.join(1)
    xfail_on_survivor_abort(error, kernel)
    assert error is None and killed, (out, error)
    said_replaced(out, victim)
    got = weights_of(out, 2)
    for rank in range(2):
        hexed, epochs, size, counts = got[rank]
        # bit for bit as without the kill; 3 epochs of 14 batches each on every rank
        assert (hexed, epochs, size) == (clean[rank][0], "3", "2"), (got, clean)
        assert json.loads(clean[rank][3]) == [[], 42]
        # the survivor went back once to its commit at the end of epoch 0 and ran epoch 1 again
        # (the 5 batches it completed in it and the one given up: those since the commit);
        # the newcomer ran epochs 1 and 2 only, never reset
        assert json.loads(counts) == ([[1], 42 + 6] if rank == 0 else [[], 28]), (rank, counts)

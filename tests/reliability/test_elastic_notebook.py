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
One kernel and cluster per world size serve its tests (the clean run is made once). Without
``elastic.run`` the cell fails with DeadRankError: tests/reliability/test_respawn_notebook.py."""

import json
import re

import pytest

from real_kernel import alive, cluster_pids, ring_kernel
from reliability.test_respawn_notebook import xfail_on_survivor_abort

pytest.importorskip("torch", reason="needs torch: pip install 'jupyter_ring[torch]'")
pytestmark = pytest.mark.timeout(300)

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
resets = []
state.register_reset_callbacks([lambda: resets.append(state.step)])
log = open(os.path.join({logs!r}, f"rank{{hvd.rank()}}.jsonl"), "a")
log.write(json.dumps({{"start": time.time()}}) + "\\n")

@hvd.elastic.run
def train(state):
    while state.epoch < EPOCHS:
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
    left = alive(world.pids)
    assert left == [], [p.cmdline() for p in left]


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
    out, error = kernel.execute(TRAIN.format(kill_at=8, victim=victim, pace=0, logs=logs), timeout=200)
    xfail_on_survivor_abort(error, kernel)
    assert error is None, (out, error)
    # the kernel said what happened, and the cell went on to its end on every rank
    assert re.search(rf"rank {victim} @ \S+ died \(.+\)\. Rank\(s\) {victim} replaced in place in "
                     r"[0-9.]+ s \(restart \d of --max-restarts 6\); elastic\.run goes on from its last commit",
                     out), out
    check = kernel.ok(CHECK.format(logs=logs))
    assert_as_without_the_kill(world, out, check, clean, victim)

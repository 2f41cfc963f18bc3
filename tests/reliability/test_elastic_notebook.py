"""Elastic training goes on by itself through a rank's death (issue 34, item 2): a real kernel, a
real 2-rank cluster, a real SIGKILL of rank 1 in the middle of an epoch of ``hvd.elastic.run``
(``TorchState`` with a model, a ``DistributedOptimizer`` with momentum, an ``ElasticSampler`` and
attributes). The cell succeeds: the survivor gives the failed step up, goes back to its last
commit, runs its reset callback, takes the replacement in and syncs the state to it; the new rank
runs the same cell from its start. Every rank then checks that its final weights equal, bit for
bit, those of the same cell run without the kill, that the steps run twice are at most those
since the last commit, and that every sample of each epoch was trained on exactly once (the
sampler's padding apart). Without ``elastic.run`` the cell fails with DeadRankError:
tests/reliability/test_respawn_notebook.py."""

import json
import re

import pytest

from real_kernel import alive, cluster_pids, ring_kernel

pytest.importorskip("torch", reason="needs torch: pip install 'jupyter_ring[torch]'")
pytestmark = pytest.mark.timeout(300)

# 106 samples over 2 ranks: 53 each (a prime; no padding, which an ElasticSampler takes from the
# samples left after a reset, as Horovod's: a run with a reset would then differ from one
# without in its last batch), batches of 4 (13, then 1);
# a commit every 3 steps; rank 1 kills itself (SIGKILL) in its 9th step (state.step 8), between
# backward() and step() (its gradients' allreduce launched, the survivor waiting in it), 2 steps
# after the last commit.
TRAIN = """\
%%distributed
import json, os, signal, time
import torch
import jupyter_ring.runtime.torch as hvd

N, BATCH, EPOCHS, COMMIT, KILL_AT, PACE = 106, 4, 2, 3, {kill_at}, {pace}
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
            if state.step == KILL_AT and hvd.rank() == 1 and "original" in globals():
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


def test_elastic_run_goes_on_through_a_sigkilled_rank_and_ends_as_without_the_kill(tmp_path):
    killed_logs, clean_logs = tmp_path / "killed", tmp_path / "clean"
    killed_logs.mkdir()
    clean_logs.mkdir()
    with ring_kernel(2) as kernel:
        kernel.ok("%%distributed\noriginal = True")
        old = cluster_pids(kernel)
        out = kernel.ok(TRAIN.format(kill_at=8, pace=0, logs=str(killed_logs)), timeout=200)
        # the kernel said what happened, and the cell went on to its end on both ranks
        assert re.search(r"rank 1 @ \S+ died \(signal: Killed\)\. Rank\(s\) 1 replaced in place in [0-9.]+ s "
                         r"\(restart 1 of --max-restarts 3\); elastic\.run goes on from its last commit", out), out
        killed = weights_of(out, 2)
        check = kernel.ok(CHECK.format(logs=str(killed_logs)))
        clean = weights_of(kernel.ok(TRAIN.format(kill_at=-1, pace=0, logs=str(clean_logs)), timeout=200), 2)
        clean_check = kernel.ok(CHECK.format(logs=str(clean_logs)))
        new = cluster_pids(kernel)
        kernel.ok("%ring stop", timeout=60)
    for rank in range(2):
        hexed, steps, size, resets = killed[rank]
        # the same weights, bit for bit, on every rank and as without the kill (CPU, float64)
        assert (hexed, steps, size) == (clean[rank][0], clean[rank][1], "2"), (killed, clean)
        # the survivor reset once, back to its commit at step 6; the newcomer never reset
        assert json.loads(resets) == ([6] if rank == 0 else []), (rank, resets)
        assert json.loads(clean[rank][3]) == []
        ok, twice = rank_lines(check, rank, "CHECK")[0].split(" ", 1)
        # every sample once; run twice: the 2 steps completed since the last commit (after 6
        # steps: those logged 6 and 7), at most the 3 between two commits; the step rank 1 died
        # in (8) never completed anywhere
        assert ok == "True" and json.loads(twice) == [6, 7], check
        assert rank_lines(clean_check, rank, "CHECK") == ["True []"], clean_check
    left = alive(set(old) | set(new))
    assert left == [], [p.cmdline() for p in left]

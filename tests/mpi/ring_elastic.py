"""``ring.elastic`` for numpy code: ``run`` syncs rank 0's state to every rank, a step that fails
on every rank (``HorovodInternalError``, what a lost rank's collective raises) rolls back to the
last commit, in-place changes to arrays included, the reset callback runs once, and training
ends with the weights of a run without the failure. Random data, 13 weights (prime, not a
multiple of the world). Prints ``RING_ELASTIC_OK <rank>``.
"""

import numpy as np

import jupyter_ring.runtime as ring

ring.init()
r, n = ring.rank(), ring.size()
STEPS, COMMIT_EVERY, FAIL_AT, LR = 20, 4, 10, 0.1


def grad(step, rank):
    return np.random.default_rng([step, rank]).standard_normal(13)


def start(rank):
    return np.random.default_rng([99, rank]).standard_normal(13)


failures = []
state = ring.elastic.ObjectState(w=start(r), step=0)  # rank r's own start: run syncs rank 0's
attempts, resets = [], []
state.register_reset_callbacks([lambda: resets.append(state.step)])


@ring.elastic.run
def train(state):
    attempts.append(state.step)
    for step in range(state.step, STEPS):
        state.w -= LR * ring.allreduce(grad(step, r), op=ring.Sum, name="g")  # in place
        state.step = step + 1
        if len(attempts) == 1 and step == FAIL_AT:
            raise ring.elastic.HorovodInternalError(f"step {step} failed on every rank (test)")
        if state.step % COMMIT_EVERY == 0:
            state.commit()
    return state.w


got = train(state)
want = start(0)
for step in range(STEPS):
    want = want - LR * sum(grad(step, q) for q in range(n))
if not np.allclose(got, want, rtol=1e-12, atol=1e-12):
    failures.append(f"weights differ from a run without the failure by {np.abs(got - want).max()}")
if attempts != [0, 8] or resets != [8]:
    failures.append(f"attempts {attempts}, resets {resets}: want a restore to the commit at step 8")
same = ring.allgather_object(got.tobytes())
if len(set(same)) != 1:
    failures.append("the ranks' weights differ")
try:
    ring.elastic.ObjectState(w=np.zeros(2)).restore()
except Exception as exc:  # a fresh state restores to its own start
    failures.append(f"restore of a fresh state: {exc!r}")
if failures:
    raise SystemExit(f"RANK_FAIL {r}: " + "; ".join(failures))
print(f"RING_ELASTIC_OK {r}", flush=True)

"""The allreduce's algorithm, kept between calls, follows every change of what it depends on.

The runtime works out the eager limit and each size's algorithm once and keeps them
(``algorithms.eager_limit``, ``algorithms.algorithm``, ``Runtime.chosen``) until the header
buffers' ``wiring`` or the config's ``revision`` changes; a prepared lane runs only under the
revision it was prepared under. Every rank checks, by the algorithm its trace recorded and by its
exact result (integer-valued float32 sums, so every order of terms gives the same bits):

- the setting changed while running (``config().allreduce``): a prepared 4 KiB lane leaves the
  eager path for the forced algorithm at the next call, and comes back to it;
- the shared-memory threshold changed while running: the same size leaves shared memory and
  comes back;
- a join (3+ ranks): with ``eager_bytes`` 256 KiB the eager limit is 256 KiB / (n-1); once a
  rank has joined, the remaining ranks' limit grows, and a size just above the world's limit
  rides in the agreement message; after every rank joined, the world's limit again;
- a process set (3+ ranks): its own world, its own limit, calls alternated with the world's;
- shutdown and init with another setting.

Prints ``RANK_OK <rank>`` or ``RANK_FAIL <rank>: ...``.
"""

import sys

import numpy as np

import jupyter_ring.runtime as ring
from jupyter_ring.runtime import _api
from jupyter_ring.runtime._engine.algorithm_choice import RD_MAX_BYTES

KiB = 1 << 10
EAGER = 256 * KiB
failures = []


def data(seed, q, count):
    """Rank ``q``'s input: small integers as float32 (sums exact in any order)."""
    return np.random.default_rng([seed, q, count]).integers(-8, 9, count).astype(np.float32)


def last(rt):
    """The algorithm of ``rt``'s last recorded collective."""
    return rt.trace.records[-1][6]


def call(label, count, seed, want, members=None, process_set=None, in_place=False, name=None):
    """One Sum allreduce of ``count`` float32 over ``members`` (default: every rank); checks the
    result and, where ``want`` is not None, the algorithm that ran."""
    members = list(range(n)) if members is None else members
    xs = [data(seed, q, count) for q in range(n)]
    total = sum(xs[q] for q in members)
    if in_place:
        got = xs[r].copy()
        ring.allreduce_(got, op=ring.Sum, name=name or label, process_set=process_set)
    else:
        got = ring.allreduce(xs[r], op=ring.Sum, name=name or label, process_set=process_set)
    if not np.array_equal(got, total):
        failures.append(f"{label}: result differs from the sum at {np.flatnonzero(got != total)[:3]}")
    engine = _api._proc.engine if process_set is None else _api._member_engine(process_set)
    ran = last(engine.rt)
    if want is not None and ran != want:
        failures.append(f"{label}: {count * 4} bytes ran {ran!r}, want {want!r}")
    return ran


ring.init(eager_bytes=EAGER)
r, n = ring.rank(), ring.size()
rt = _api._proc.rt
config = ring.config()
slots = rt.shm is not None
if n > 1 and not slots:
    failures.append("no shared-memory slots on one host: the threshold's part tests nothing")
cap = EAGER // max(1, n - 1)  # the eager limit of n ranks (algorithm_choice.eager_limit)
above = (cap + 4 * KiB) // 4  # float32 elements just above it (and above the 64 KiB shm threshold)
messages = "rd" if above * 4 <= RD_MAX_BYTES else "ring"


def forced(algorithm):
    return algorithm if n > 1 else "local"


# -- the setting changed under a prepared lane
lane_key = ("small", True)
for i in range(3):
    call(f"lane {i}", 1024, 10 + i, "eager", in_place=True, name="small")
lane = _api._proc.engine.lanes.get(lane_key)
if lane is None or lane.prepared is None:
    failures.append("the 4 KiB allreduce_ left no prepared lane (nothing tested)")
for setting, step in (("rd", 20), ("ring", 30), ("auto", 40)):
    config.allreduce = setting
    for i in range(3):
        call(f"lane under {setting} {i}", 1024, step + i, forced(setting) if setting != "auto" else "eager",
             in_place=True, name="small")
lane = _api._proc.engine.lanes.get(lane_key)
if lane is None or lane.prepared is None or lane.revision != config.revision:
    failures.append("back under auto, the 4 KiB allreduce_ is not on a lane prepared under the present config")

# -- the shared-memory threshold changed: the same size leaves the slots and comes back
if n > 1:
    threshold = config.shm_threshold
    call("above the eager limit", above, 50, "shm" if slots else messages)
    config.shm_threshold = 0
    call("shared memory off", above, 51, messages)
    call("shared memory off again", above, 52, messages)
    config.shm_threshold = threshold
    call("shared memory back", above, 53, "shm" if slots else messages)

# -- a join: the remaining ranks' eager limit grows (256 KiB / (n-2) > the size > 256 KiB / (n-1))
if n >= 3:
    call("before the join", above, 60, "shm" if slots else messages)
    if r == n - 1:
        ring.join()
    else:
        others = list(range(n - 1))
        # the first call learns of the join in its agreement (its algorithm was chosen before)
        call("the join announced", above, 61, None, members=others)
        call("rank n-1 joined", above, 62, "eager", members=others)
        call("rank n-1 joined, again", above, 63, "eager", members=others)
        ring.join()
    call("every rank back", above, 64, "shm" if slots else messages)

# -- a process set of two ranks: its own limit (256 KiB), the world's alternated with it
if n >= 3:
    pair = [0, 1]
    ps = ring.add_process_set(pair)
    for i in range(2):
        call(f"the world {i}", above, 70 + i, "shm" if slots else messages)
        if r in pair:
            call(f"the pair {i}", above, 72 + i, "eager", members=pair, process_set=ps)
    ring.remove_process_set(ps)

ring.shutdown()

# -- shutdown, then init with another setting: nothing kept survives the runtime
ring.init(allreduce="rd", eager_bytes=EAGER)
for i in range(2):
    call(f"after init(allreduce='rd') {i}", 1024, 80 + i, forced("rd"), in_place=True, name="small")
ring.shutdown()

if failures:
    print(f"RANK_FAIL {r}: " + "; ".join(failures[:10]), flush=True)
    sys.exit(1)
print(f"RANK_OK {r}", flush=True)

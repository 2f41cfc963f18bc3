"""The device transport over gloo on CPU tensors: failures, abort and rebuild, the shared group.

Run with JUPYTER_RING_DEVICE_TRANSPORT=gloo. Every rank asserts its own results and prints
``TORCH_DEVICE_OK <rank>`` when every case passed. Three grouped allreduces in flight at once
are exact (each holds its own fusion buffer). Cases with 2+ ranks:

* a shape mismatch raises CollectiveMismatchError on every rank, naming both shapes;
* bad arguments on one rank: that rank's own error there, PeerError naming it on the others;
* an interrupt while the transfer is in flight (a peer holds back its launch after the
  agreement): KeyboardInterrupt here within a second, the peer's transfer fails at once
  (RingError, not a hang), and the next collectives, same name and shape, are exact;
* a stall: StallError after the stall timeout, the same recovery;
* a rank that called join(): the others' device allreduces (plain, grouped, DistributedOptimizer's
  buckets) go through the ring with its zeros, other collectives raise naming join();
* torch.distributed's default group made by user code (init_process_group) is shared by the
  transport, aborted and re-created in place: the user's own dist.all_reduce and a DDP model made
  before the failure are right afterwards.
"""

import os
import signal
import sys
import threading
import time
import zlib

import _checks
import torch
import torch.distributed as dist

import jupyter_ring.runtime.torch as hvd
from jupyter_ring.runtime._device import transport as _device
from jupyter_ring.runtime._device import process_groups

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
failures = []
transport = _device.transport()


def expect(label, condition, detail=""):
    if not condition:
        failures.append(f"{label}: {detail}")


def rand_ints(seed, shape, dtype=torch.int64):
    """Random integers (exact sums in every dtype used here), the same on every rank for a seed."""
    return torch.randint(-999, 999, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def exact_round(tag):
    """Collectives with awkward sizes on random data, exact on every rank (integers)."""
    seed = zlib.crc32(tag.encode())
    for length in (0, 1, n - 1, n + 1, 1009):
        xs = [rand_ints(seed + 7919 * q + length, (length,)) for q in range(n)]
        got = hvd.allreduce(xs[r], op=hvd.Sum, name=f"{tag}.sum{length}")
        expect(f"{tag} allreduce {length}", torch.equal(got, sum(xs)), f"{got[:4]} vs {sum(xs)[:4]}")
        root = length % n
        got = hvd.broadcast(xs[r], root, name=f"{tag}.bcast{length}")
        expect(f"{tag} broadcast {length}", torch.equal(got, xs[root]))


def raises(label, fn, kinds):
    try:
        fn()
    except kinds as exc:
        return exc
    except BaseException as exc:  # noqa: BLE001 - reported as a failure
        failures.append(f"{label}: raised {type(exc).__name__}: {exc}")
        return None
    failures.append(f"{label}: did not raise")
    return None


exact_round("start")

# grouped collectives in flight at once: each has its own fusion buffer (a shared one let the
# second's inputs overwrite the first's before its transfer and copy-out)
for dtype in (torch.float32, torch.int64):
    def member(q, k, length):
        return rand_ints(1000 * q + 10 * k + length, (length,), dtype)

    lengths = (1000, 7, 13)
    groups = [[member(r, k, length) for length in lengths] for k in range(3)]
    handles = [hvd.grouped_allreduce_async_(g, op=hvd.Sum, name=f"inflight.{dtype}.{k}") for k, g in enumerate(groups)]
    for k in (2, 0, 1):
        hvd.synchronize(handles[k])
    for k, g in enumerate(groups):
        want = [sum(member(q, k, length) for q in range(n)) for length in lengths]
        expect(f"grouped in flight {dtype} {k}", all(torch.equal(a, b) for a, b in zip(g, want)),
               str([t[:3].tolist() for t in g]))

if n > 1:
    # ---- mismatch: every rank raises, naming both shapes
    exc = raises("mismatch", lambda: hvd.allreduce(torch.zeros(17 + r), name="mismatch"),
                 hvd.CollectiveMismatchError)
    if exc is not None:
        expect("mismatch message", "(17,)" in str(exc) and "(18,)" in str(exc), str(exc))
    exact_round("after-mismatch")

    # ---- bad arguments on rank 1: its ValueError there, PeerError naming rank 1 elsewhere
    root = n if r == 1 else 0
    exc = raises("bad root", lambda: hvd.broadcast(rand_ints(r, (3,), torch.float32), root, name="badroot"),
                 (ValueError, hvd.RingError))
    if exc is not None:
        if r == 1:
            expect("bad root on the rank at fault", type(exc) is ValueError, repr(exc))
        else:
            expect("bad root on the others", "rank 1 could not join" in str(exc), str(exc))
    exact_round("after-bad-args")

    # ---- interrupt while the transfer is in flight: rank 0 launches, the others hold back
    def hold(seconds):
        def before(kind, name):
            if name == "held" and r != 0:
                time.sleep(seconds)
        return before

    transport.before_launch = hold(2.5)
    if r == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    exc = raises("interrupt", lambda: hvd.allreduce(rand_ints(r, (100003,), torch.float32), name="held"),
                 (KeyboardInterrupt, hvd.RingError))
    took = time.monotonic() - t0
    if r == 0:
        expect("interrupt raises KeyboardInterrupt", isinstance(exc, KeyboardInterrupt), repr(exc))
        expect("interrupt within the notebook's grace", took < _checks.INTERRUPT_S, f"{took:.2f} s")
    else:
        # the peer's transfer fails at once once it launches (the connection is gone), no hang
        expect("peer of the interrupted rank", isinstance(exc, hvd.RingError) and "gave it up" in str(exc),
               repr(exc))
        expect("peer fails without waiting", took < 2.5 + _checks.INTERRUPT_S, f"{took:.2f} s")
    transport.before_launch = None
    exact_round("after-interrupt")
    group = transport.group("cpu")
    expect("the group was re-created", group.generation == 1, f"generation {group.generation}")

    # ---- stall: the others hold back longer than the stall timeout
    import jupyter_ring.runtime as ring

    ring.config().stall_timeout = 1.0
    transport.before_launch = hold(3.0)
    t0 = time.monotonic()
    exc = raises("stall", lambda: hvd.allreduce(rand_ints(r, (5,), torch.float32), name="held"), hvd.RingError)
    took = time.monotonic() - t0
    if r == 0:
        expect("stall raises StallError", isinstance(exc, hvd.StallError), repr(exc))
        expect("stall after the timeout", 0.9 < took < 1.0 + _checks.INTERRUPT_S, f"{took:.2f} s")
    transport.before_launch = None
    ring.config().stall_timeout = 60.0
    exact_round("after-stall")

    # ---- join(): the last rank is out of data, before DistributedOptimizer's first step; the
    # others' device allreduces (plain, grouped, the optimizer's buckets and its first step's
    # bucket order) go through the ring with its zeros, as in Horovod; other collectives raise on
    # every active rank; join() returns the rank that joined last
    joiner = n - 1
    model = torch.nn.Linear(6, 3)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    if r == joiner:
        last = hvd.join()
    else:
        active = range(n - 1)
        for length in (0, 1, n + 2, 1009):
            xs = [torch.randint(-9, 9, (length,), generator=torch.Generator().manual_seed(100 * q + length)).double()
                  for q in range(n)]
            got = hvd.allreduce(xs[r], op=hvd.Sum, name=f"joined.sum{length}")
            want = sum(xs[q] for q in active) if length else xs[r]
            expect(f"joined Sum {length}", torch.equal(got, want), f"{got[:4]} vs {want[:4]}")
            got = hvd.allreduce(xs[r], op=hvd.Average, name=f"joined.avg{length}")
            want = sum(xs[q] for q in active) / n if length else xs[r]
            expect(f"joined Average (divided by every rank) {length}", torch.allclose(got, want), f"{got[:4]} vs {want[:4]}")
        def pair_of(q):
            return [rand_ints(200 + q, (4,)).double(), rand_ints(300 + q, (2, 3)).double()]

        pair = pair_of(r)
        hvd.grouped_allreduce_(pair, op=hvd.Sum, name="joined.grouped")
        want_pair = [sum(pair_of(q)[k] for q in active) for k in range(2)]
        expect("joined grouped", all(torch.equal(t, w) for t, w in zip(pair, want_pair)), str(pair))
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(400 + r))  # this rank's own batch
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()  # buckets on the transport: averaged over every rank, the joined one's zeros too
        # d(sum of outputs)/d(bias) is the batch's row count on every active rank, 0 on the joined one
        want_bias = before[1] - (n - 1) / n * 3.0
        expect("joined DistributedOptimizer", torch.allclose(model.bias.detach(), want_bias),
               f"{model.bias.tolist()} vs {want_bias.tolist()}")
        exc = raises("joined broadcast", lambda: hvd.broadcast(rand_ints(r, (3,), torch.float32), 0, name="joined.bcast"),
                     hvd.CollectiveMismatchError)
        if exc is not None:
            expect("joined broadcast names join()", "join()" in str(exc), str(exc))
        last = hvd.join()
    expect("join returns an active rank (one that joined after the joiner)", last in range(n - 1), str(last))
    lasts = hvd.allgather(torch.tensor([last]), name="joined.last")
    expect("join returns the same rank everywhere", bool((lasts == lasts[0]).all()), str(lasts))
    exact_round("after-join")

    # ---- the user's default group, shared by the transport, aborted and re-created in place
    process_groups.install_recording()
    port = _checks.free_port(ring)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n))
    dist.init_process_group("gloo")
    world = dist.group.WORLD
    expect("the default group is recorded", process_groups.registry.find(world) is not None)
    model = torch.nn.Linear(4, 3)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.randn(2, 4)).sum().backward()
    mine = [rand_ints(500 + q, (7,)) for q in range(n)]
    got = hvd.allreduce(mine[r], op=hvd.Sum, name="shared")
    expect("transport on the shared group", transport.group("cpu").pg is world,
           transport.group("cpu").label)
    expect("allreduce on the shared group", torch.equal(got, sum(mine)), f"{got} vs {sum(mine)}")
    transport.before_launch = hold(2.5)
    if r == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    raises("interrupt on the shared group", lambda: hvd.allreduce(rand_ints(r, (11,), torch.float32), name="held"),
           (KeyboardInterrupt, hvd.RingError))
    transport.before_launch = None
    exact_round("after-shared-interrupt")  # the transport re-creates the shared group first
    theirs = [rand_ints(600 + q, (5,)) for q in range(n)]
    t = theirs[r].clone()
    dist.all_reduce(t)
    expect("user all_reduce after the rebuild", torch.equal(t, sum(theirs)), f"{t} vs {sum(theirs)}")
    for step in range(2):
        model.zero_grad()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + r))
        ddp(x).sum().backward()
    grads = hvd.allgather(model.weight.grad.reshape(1, -1), name="ddp.grads")
    expect("DDP gradients identical after the rebuild", all(torch.equal(grads[0], g) for g in grads))
    expect("the same ProcessGroup object", dist.group.WORLD is world)
    dist.destroy_process_group()

if failures:
    print(f"rank {r}: " + "; ".join(failures), flush=True)
    sys.exit(1)
print(f"TORCH_DEVICE_OK {r}", flush=True)

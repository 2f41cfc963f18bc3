"""Helpers shared by the one-launch test scripts here (they run as scripts: this folder is on sys.path)."""

# An interrupt ends a collective within the notebook's interrupt_grace (5 s), also with 4 ranks on
# a loaded 2-core machine; the typical latency (milliseconds) is measured by benchmarks/interrupt.py.
# tests/bounds.py holds the same bound (INTERRUPT_S) for the tests run by pytest itself.
INTERRUPT_S = 5.0


def expect_raises(failures, label, exc_types, fn):
    """Append to ``failures`` unless ``fn()`` raises one of ``exc_types``."""
    try:
        fn()
    except exc_types:
        return
    except Exception as exc:  # noqa: BLE001 - reported
        failures.append(f"{label}: raised {type(exc).__name__}: {str(exc)[:200]}")
        return
    failures.append(f"{label}: did not raise")


def close(failures, label, got, want, tol):
    """Append to ``failures`` unless ``got`` and ``want`` have one shape and agree within ``tol``."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        failures.append(f"{label}: shape {got.shape} != {want.shape}")
    elif not np.allclose(got, want, rtol=tol, atol=tol):
        failures.append(f"{label}: max abs diff {np.abs(got - want).max():.3g}")


def rank_gpu(hvd):
    """This rank's GPU (local rank modulo the GPUs there), made current; its torch device."""
    import torch

    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def forbid_for_cuda(module, attr, message):
    """Make ``module.attr(tensor)`` raise AssertionError(``message``) for a CUDA tensor, so a
    path that must not be taken fails the test instead of passing slowly."""
    original = getattr(module, attr)

    def forbidden(tensor):
        if tensor.is_cuda:
            raise AssertionError(message)
        return original(tensor)
    setattr(module, attr, forbidden)


def free_port(ring):
    """A free loopback port picked by rank 0, the same on every rank."""
    import socket

    port = None
    if ring.rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    return ring.broadcast_object(port, 0, name="test.free_port")


def train_matches_one_process(hvd, dev, failures, steps=4, bucket_bytes=1024):
    """DistributedOptimizer on ``dev`` (small buckets: several launched during backward), every
    rank its shard of a batch, against one process's SGD on the full batch. Returns the wrapper."""
    import torch

    r, n = hvd.rank(), hvd.size()

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(13, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                   torch.nn.Tanh(), torch.nn.Linear(64, 5)).to(dev)

    model, reference = mlp(), mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), bucket_bytes=bucket_bytes)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    batch = 6 * n
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(batch, 13, generator=g).to(dev), torch.randn(batch, 5, generator=g).to(dev)
        per = batch // n
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per]).backward()
        launched = [b.handle is not None for b in opt._buckets[:-1]]
        if step == steps - 1 and (len(opt._buckets) < 3 or not all(launched)):
            failures.append(f"buckets not launched during backward: {launched}")
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if not torch.allclose(p, q, rtol=1e-4, atol=1e-5):
            failures.append(f"DistributedOptimizer {name}: {p.flatten()[:3].tolist()} vs one process "
                            f"{q.flatten()[:3].tolist()}")
    return opt


class Meeting:
    """Ranks meet outside the runtime: ``meet()`` returns once every rank has called it as often.

    Where every rank must have raised (an interrupt, a stall) before any goes on (a released rank's
    next collective would pair with a waiting one's), the ranks meet here instead of sleeping to a
    shared deadline: no time is guessed, so a loaded machine neither breaks it nor pays for it. A
    non-blocking barrier on a communicator of its own, polled with sleeps (4 ranks on 2 cores do
    not spin). Create it on every rank at the same point, after ``init()``.
    """

    def __init__(self):
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD.Dup()

    def meet(self, timeout=60.0):  # under the tests' mpiexec timeouts (90-120 s): this message first
        import time

        request = self.comm.Ibarrier()
        deadline = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                raise AssertionError(f"not every rank came to the meeting in {timeout} s")
            time.sleep(0.002)

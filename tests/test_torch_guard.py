"""The torch.distributed guard's stall check on groups whose backend keeps no sequence number.

The guard (``engines/_torch.TorchGuard``) compares each managed group's collective count with its
peers' to find a rank that never arrived. A backend that cannot tell its count (torch's "fake"
backend raises "does not yet support sequence numbers") must be passed over, not end the whole
check with a TypeError before the groups after it are looked at: here a real gloo group whose
peer is behind comes after such a group (whose peer did publish a count) and must still be
aborted as stalled.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch", reason="the guard watches torch.distributed groups: pip install 'jupyter_ring[torch]'")

SCRIPT = textwrap.dedent("""
    import datetime, tempfile, time
    import torch, torch.distributed as dist
    from torch._C._distributed_c10d import FakeProcessGroup, HashStore
    import jupyter_ring.runtime as ring
    from jupyter_ring.engines._torch import TorchGuard
    from jupyter_ring.runtime._device.process_groups import ManagedGroup

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
    dist.all_reduce(torch.ones(3))          # this rank's count moves past its peer's
    timeout = datetime.timedelta(seconds=30)
    fake_store, gloo_store = HashStore(), HashStore()
    gloo_store.set("jupyter_ring/seq/1", "0")  # the peer published count 0 and never came
    fake_store.set("jupyter_ring/seq/1", "0")  # a peer's backend told its count; this rank's cannot
    fake = ManagedGroup(label="fake group", key="fake", pg=None,
                        backends={"cpu": FakeProcessGroup._create_internal(0, 2)}, kinds={"cpu": "fake"},
                        store=fake_store, rank=0, size=2, timeout=timeout)
    watched = ManagedGroup(label="gloo group", key="gloo", pg=None, backends={"cpu": gloo},
                           kinds={"cpu": "gloo"}, store=gloo_store, rank=0, size=2, timeout=timeout)
    ring.init()                             # a one-rank world (MPI singleton)
    guard = TorchGuard(ring, "127.0.0.1:0", None)
    now = time.monotonic()
    guard._still_since = now - ring.config().stall_timeout - 1
    guard._check_stall([fake, watched], now)
    print("fake aborted:", repr(fake.aborted))
    print("gloo aborted:", repr(watched.aborted))
    print("notes:", guard.notes)
    dist.destroy_process_group()
""")


def test_a_group_without_sequence_numbers_does_not_stop_the_stall_check(tmp_path):
    env = dict(os.environ, JUPYTER_RING_STALL_TIMEOUT="5")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gloo aborted: 'stalled on rank 0'" in out.stdout, out.stdout + out.stderr
    assert "stalled on rank 0; closed the connections of" in out.stdout and "gloo group" in out.stdout, out.stdout

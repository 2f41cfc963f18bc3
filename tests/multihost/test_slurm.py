"""A cluster across two hosts through Slurm (slurmctld and a slurmd on each host, munge), started
from a real kernel: with ``--launcher slurm`` (sbatch) and inside an ``salloc`` allocation."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_hydra_ssh import ALLREDUCE_CHECK, HostKernel, topology, wait_no_cluster  # noqa: E402
from twohosts import SlurmHosts, built, slurm_missing  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm():
    """Two hosts with Slurm; torn down in a finally, and nothing of them may be left."""
    why = slurm_missing()
    if why:
        pytest.skip(f"Slurm on two simulated hosts: {why}")
    with built(SlurmHosts) as two:
        yield two


def slurm_env(hosts):
    # no HYDRA_LAUNCHER*: inside the job Hydra must find Slurm and start its proxies with srun
    return dict(os.environ, SLURM_CONF=hosts.conf, UCX_TLS="tcp,self", PYTHONUNBUFFERED="1")


def check_cluster(kernel, hosts, start_line):
    a, b = hosts.hosts
    t0 = time.monotonic()
    out = kernel.ok(start_line, timeout=180)
    took = time.monotonic() - t0
    assert f"controller listening on {a['ip']}" in out, out
    table = re.findall(r"^(\d+)\s+(\S+)\s+\d+\s+cpu$", out, re.M)
    assert sorted(h for _, h in table) == sorted([a["name"]] * 2 + [b["name"]] * 2), out
    out = kernel.ok("%%distributed\n" + ALLREDUCE_CHECK, timeout=120)
    topo = topology(out)
    assert sorted(topo) == [0, 1, 2, 3], out
    assert all(local_size == 2 and cross_size == 2 for _, local_size, _, cross_size
               in topo.values()), out
    assert sorted(local for local, _, _, _ in topo.values()) == [0, 0, 1, 1], out
    kernel.ok("%ring stop", timeout=60)
    left = wait_no_cluster(hosts, 20)
    assert not left, f"%ring stop left processes: {left}"
    left = os.listdir(kernel.cwd)
    assert not left, f"files left in the notebook's folder (sbatch script, job output): {left}"
    print(f"{start_line}: cluster started in {took:.1f} s")


def test_launcher_slurm_places_ranks_on_both_nodes(slurm):
    """--launcher slurm --nodes 2 --ntasks-per-node 2: sbatch with our own script, Hydra inside
    the job; two ranks per node, exact allreduce over TCP, nothing left after %ring stop."""
    k = HostKernel(slurm, 0, slurm_env(slurm))
    try:
        k.ok("%load_ext jupyter_ring")
        check_cluster(k, slurm, "%ring start --launcher slurm --nodes 2 --ntasks-per-node 2 "
                                "--partition jr --time 10 --gpus none")
    finally:
        k.close()


def test_inside_salloc_uses_the_allocation(slurm):
    """A kernel started under salloc -N 2 --ntasks-per-node 2: plain %ring start finds the
    allocation (SLURM_JOB_ID, SLURM_NTASKS) and runs 4 ranks across its two nodes."""
    k = HostKernel(slurm, 0, slurm_env(slurm),
                   prefix=["salloc", "-N", "2", "--ntasks-per-node", "2", "--quiet"])
    try:
        k.ok("%load_ext jupyter_ring")
        check_cluster(k, slurm, "%ring start --gpus none")
    finally:
        k.close()


def test_kernel_killed_under_launcher_slurm_leaves_nothing(slurm):
    """SIGKILL to the kernel of a --launcher slurm cluster: the watchdog ends the controller;
    the engines (a Slurm job, not this host's children) miss its heartbeat and end, and the
    job leaves the queue; nothing is left on either host."""
    k = HostKernel(slurm, 0, slurm_env(slurm))
    try:
        k.ok("%load_ext jupyter_ring")
        k.ok("%ring start --launcher slurm --nodes 2 --ntasks-per-node 1 --gpus none",
             timeout=180)
        t0 = time.monotonic()
        k.km.provisioner.process.send_signal(signal.SIGKILL)
        left = wait_no_cluster(slurm, 60)
        took = time.monotonic() - t0
        assert not left, f"cluster processes left 60 s after the kernel was killed: {left}"
        queue = subprocess.run(slurm.cmd(0, ["squeue", "-h"]), env=slurm_env(slurm),
                               capture_output=True, text=True, timeout=20).stdout
        print(f"both Slurm nodes clean {took:.1f} s after the kernel was killed; queue: {queue!r}")
    finally:
        k.close()

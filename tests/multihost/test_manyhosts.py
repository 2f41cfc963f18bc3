"""Four simulated hosts of two ranks on a bridge, links shaped to 10 GbE (issue 33, item 3): the
rig builds and leaves nothing behind, and every allreduce algorithm is exact across it."""

import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from manyhosts import ManyHosts  # noqa: E402
from twohosts import built, missing  # noqa: E402


def test_every_allreduce_algorithm_is_exact_on_four_shaped_hosts():
    why = missing()
    if why:
        pytest.skip(f"simulated hosts: {why}")
    root = os.path.dirname(os.path.dirname(HERE))
    script = os.path.join(os.path.dirname(HERE), "mpi", "rt_algorithms.py")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    with built(lambda: ManyHosts(4, 2, "10GbE")) as hosts:
        qdisc = subprocess.run(["ip", "netns", "exec", hosts.hosts[3]["ns"], "tc", "qdisc", "show", "dev",
                                hosts.veth[3]], capture_output=True, text=True, timeout=20).stdout
        assert "rate 10Gbit" in qdisc, qdisc
        env = dict(os.environ, **hosts.env(), UCX_TLS="tcp,self", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(hosts.cmd(0, [mpiexec, "-f", hosts.hostfile, "-n", "8", sys.executable, script,
                                            "auto,hier"]),
                              env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        ok = sorted(int(rank) for rank in re.findall(r"RANK_OK (\d+)", proc.stdout))
        assert proc.returncode == 0 and ok == list(range(8)), proc.stdout[-3000:] + proc.stderr[-3000:]

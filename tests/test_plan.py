"""The launch plan: read what %ring start would run, for one host, several, Slurm, without
starting anything (the machine's facts are given, so a laptop reads a Slurm plan)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from jupyter_ring.cluster import (ENVIRONMENT_LAYERS, THREAD_VARS, HostSlot, LaunchPlan, Machine,
                                  RingCluster, TorchWorld, plan_launch, torchrun_environment)

GiB = 1 << 30


class Given(Machine):
    """A machine whose every fact is given: nothing is probed, nothing runs."""

    def __init__(self, environ=None, cpus=8, driver_gpus=0, allocation=(), slurm_nodes=(),
                 flavour="mpich", address="10.0.0.1"):
        super().__init__(environ or {})
        # cached_property reads the instance dict first: these are the answers
        self.__dict__.update(cpus=cpus, driver_gpus=driver_gpus, pid=4242,
                             mpiexec="/opt/mpi/bin/mpiexec",
                             local_mpiexec="/opt/mpi/bin/mpiexec.gforker",
                             mpi_flavour=flavour, profile_dir="/home/u/.ipython/profile_default")
        self.allocation, self.nodes, self.address = list(allocation), list(slurm_nodes), address
        self.asked = []   # the hosts the controller's address was asked for

    def slurm_allocation(self):
        return self.allocation

    def slurm_nodes(self, partition=""):
        return self.nodes

    def address_towards(self, hosts):
        self.asked.append(hosts)
        return self.address


def plan(machine=None, **options):
    return RingCluster(**options).plan(machine or Given())


def test_one_host_default_is_loopback_gforker_and_fair_threads():
    p = plan(Given(cpus=8))
    assert isinstance(p, LaunchPlan)
    assert (p.n, p.one_host, p.slots, p.gpus, p.note) == (8, True, (), None, "")
    assert p.controller_ip == "127.0.0.1" and not p.send_engines_connection_env
    assert p.mpiexec.endswith("gforker") and p.mpi_args == ("-exitinfo",)
    assert p.engine_launcher == "mpi" and p.engine_args == () and p.slurm is None
    # only what differs from the kernel's environment: MPI's loopback, 1 thread per rank
    assert p.environment["UCX_NET_DEVICES"] == "lo"
    assert all(p.environment[v] == "1" for v in THREAD_VARS)
    assert "--IPController.enable_curve=True" in p.controller_args
    assert "--HeartMonitor.max_heartmonitor_misses=50" in p.controller_args  # 5 s of 100 ms


def test_n_beyond_the_share_plans_anyway_and_says_so():
    p = plan(Given(environ={"CPU_LIMIT": "3"}, cpus=8), n=5)
    assert p.n == 5 and "-n 5 is more than this server's share" in p.note
    assert p.environment["OMP_NUM_THREADS"] == "1"           # 3 cores / 5 ranks, at least 1
    p = plan(Given(environ={"CPU_LIMIT": "3", "MEM_LIMIT": str(4 * GiB)}, cpus=8))
    assert p.n == 2 and p.note == "" and p.environment["OMP_NUM_THREADS"] == "1"


def test_kernel_settings_win_and_engine_env_wins_over_all():
    p = plan(Given(environ={"OMP_NUM_THREADS": "3", "UCX_NET_DEVICES": "eth0"}, cpus=4), n=2,
             engine_env=["MKL_NUM_THREADS=7", "EXTRA=a=b"])
    assert "OMP_NUM_THREADS" not in p.environment and "UCX_NET_DEVICES" not in p.environment
    assert p.environment["MKL_NUM_THREADS"] == "7" and p.environment["EXTRA"] == "a=b"
    assert p.environment["OPENBLAS_NUM_THREADS"] == "2"
    with pytest.raises(ValueError, match="'NOEQUALS' is not NAME=VALUE"):
        plan(engine_env=["NOEQUALS"])


def test_environment_layers_are_the_one_place():
    # what a layer adds reaches the plan; the order says who wins
    names = [layer.__name__ for layer in ENVIRONMENT_LAYERS]
    assert names == ["_mpi_layer", "_thread_layer", "_respawn_layer", "_crash_layer", "_user_layer"]
    # a rank crashing in native code writes its Python stacks to the engines' output
    assert plan(Given(), n=2).environment["PYTHONFAULTHANDLER"] == "1"
    assert "PYTHONFAULTHANDLER" not in plan(Given(environ={"PYTHONFAULTHANDLER": ""}), n=2).environment


def test_ranks_run_under_their_keepers_where_a_dead_rank_can_be_replaced():
    # one host under gforker: a dead rank is replaced in place (--max-restarts, default 3)
    p = plan(Given(), n=2)
    assert p.keeper and p.environment["MPIR_CVAR_NO_COLLECTIVE_FINALIZE"] == "1"
    # turned off: the old way, no keeper, MPI_Finalize as MPICH's default
    p = plan(Given(), n=2, max_restarts=0)
    assert not p.keeper and "MPIR_CVAR_NO_COLLECTIVE_FINALIZE" not in p.environment
    # several hosts (Hydra) and Slurm: a dead rank ends the job, as before
    for options in ({"hosts": ["a:1", "b:1"]}, {"launcher": "slurm", "nodes": 2}):
        p = plan(Given(slurm_nodes=["a", "b"]), **options)
        assert not p.keeper and "MPIR_CVAR_NO_COLLECTIVE_FINALIZE" not in p.environment


@pytest.mark.parametrize("spec,environ,driver,want", [
    ("auto", {}, 0, None),                          # no GPU: CUDA_VISIBLE_DEVICES left alone
    ("auto", {}, 2, ("0", "1")),
    ("auto", {"CUDA_VISIBLE_DEVICES": "3,1"}, 8, ("3", "1")),
    ("none", {"CUDA_VISIBLE_DEVICES": "0"}, 1, ()),   # hidden on every rank
    ("0,2", {}, 0, ("0", "2")),
])
def test_gpus_and_one_rank_per_gpu(spec, environ, driver, want):
    p = plan(Given(environ=environ, driver_gpus=driver, cpus=16), gpus=spec)
    assert p.gpus == want
    if want:
        assert p.n == len(want) and "OMP_NUM_THREADS" in p.environment


def test_hosts_and_hostfile(tmp_path):
    machine = Given()
    p = plan(machine, hosts=["a:2", "b:3"], launcher="ssh")
    assert (p.n, p.one_host) == (5, False)
    assert p.slots == (HostSlot("a", 2), HostSlot("b", 3))
    assert p.mpiexec == "/opt/mpi/bin/mpiexec" and p.mpi_args == ("-launcher", "ssh", "-hosts",
                                                                   "a:2,b:3")
    assert p.controller_ip == "10.0.0.1" and machine.asked == [["a", "b"]]
    assert p.send_engines_connection_env and p.engine_args == ("--IPEngine.max_heartbeat_misses=8",)
    assert "UCX_NET_DEVICES" not in p.environment and "OMP_NUM_THREADS" not in p.environment
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA\nnodeB  # one each\n")
    p = plan(Given(flavour="openmpi"), hostfile=str(hostfile), controller_ip="192.168.1.5")
    assert (p.n, p.controller_ip, p.mpi_args) == (2, "192.168.1.5", ("--hostfile", str(hostfile)))
    assert plan(Given(flavour="openmpi"), hosts=["a", "b"], n=4).mpi_args == ("--host", "a,b")


def test_inside_a_slurm_allocation():
    environ = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "6"}
    machine = Given(environ=environ, allocation=["n1", "n2"])
    p = plan(machine)
    assert (p.n, p.one_host, p.engine_launcher, p.mpi_args) == (6, False, "mpi", ())
    assert p.slots == (HostSlot("n1", None), HostSlot("n2", None))
    assert machine.asked == [["n1", "n2"]]


def test_launcher_slurm():
    p = plan(Given(slurm_nodes=["n1", "n2", "n3"]), launcher="slurm", nodes=2,
             ntasks_per_node=3, partition="gpu", time_limit="1:00:00")
    assert (p.n, p.one_host) == (6, False)
    assert p.engine_launcher == "jupyter_ring.cluster._slurm.RingSlurmEngineSetLauncher"
    assert p.slurm.batch_file == "/home/u/.ipython/profile_default/log/jupyter_ring-slurm-4242.sbatch"
    assert (p.slurm.nodes, p.slurm.ntasks_per_node, p.slurm.partition, p.slurm.time_limit) == \
        (2, 3, "gpu", "1:00:00")
    with pytest.raises(ValueError, match="--partition 'a b'"):
        plan(launcher="slurm", nodes=2, partition="a b")
    with pytest.raises(ValueError, match=r"--time '1\{2\}': no spaces or braces"):
        plan(launcher="slurm", time_limit="1{2}")


def _torchrun_world(p, hosts):
    """Every rank's torchrun environment for ``hosts`` (one a rank), as RingCluster computes it."""
    address = p.torch.master_addr or "10.0.0.7"   # across hosts rank 0 finds its own address
    return [torchrun_environment(r, hosts, address, 29500, "run-1") for r in range(p.n)]


def _column(envs, name):
    return [int(e[name]) for e in envs]


def test_torchrun_world_on_one_host_several_hosts_and_slurm():
    # one host: the rendezvous on loopback, one node, LOCAL_RANK = RANK
    p = plan(Given(cpus=4), n=3, torch_distributed=True)
    assert p.torch == TorchWorld("127.0.0.1", "auto")
    envs = _torchrun_world(p, ["here"] * 3)
    assert _column(envs, "RANK") == _column(envs, "LOCAL_RANK") == [0, 1, 2]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], e["GROUP_WORLD_SIZE"])
            for e in envs} == {("3", "3", "0", "1")}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["TORCHELASTIC_RUN_ID"]) for e in envs} == \
        {("127.0.0.1", "29500", "run-1")}
    assert plan(Given(cpus=4), n=2).torch == TorchWorld("127.0.0.1", None)  # no --torch-distributed

    # several hosts: rank 0 picks its routable address at start; Hydra fills a:2 then b:3
    p = plan(Given(), hosts=["a:2", "b:3"])
    assert p.torch == TorchWorld("", None)
    envs = _torchrun_world(p, ["a", "a", "b", "b", "b"])
    assert _column(envs, "RANK") == _column(envs, "ROLE_RANK") == [0, 1, 2, 3, 4]
    assert _column(envs, "GROUP_RANK") == [0, 0, 1, 1, 1]
    assert _column(envs, "LOCAL_RANK") == [0, 1, 0, 1, 2]
    assert _column(envs, "LOCAL_WORLD_SIZE") == [2, 2, 3, 3, 3]
    assert {(e["WORLD_SIZE"], e["GROUP_WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs} == \
        {("5", "2", "10.0.0.7")}
    # hosts named without counts: Hydra deals the ranks round-robin; RANK stays the ring's rank,
    # nodes are numbered in the order of their first rank
    envs = _torchrun_world(plan(Given(), hosts=["a", "b"], n=5), ["a", "b", "a", "b", "b"])
    assert _column(envs, "GROUP_RANK") == [0, 1, 0, 1, 1]
    assert _column(envs, "LOCAL_RANK") == [0, 0, 1, 1, 2]
    assert _column(envs, "LOCAL_WORLD_SIZE") == [2, 3, 2, 3, 3]

    # Slurm (--launcher slurm, or inside an allocation): nodes as Slurm placed the ranks
    for p in (plan(Given(slurm_nodes=["n1", "n2", "n3"]), launcher="slurm", nodes=2,
                   ntasks_per_node=3, torch_distributed=True),
              plan(Given(environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "6"},
                         allocation=["n1", "n2"]), torch_distributed=True)):
        assert p.n == 6 and p.torch == TorchWorld("", "auto")
        envs = _torchrun_world(p, ["n1"] * 3 + ["n2"] * 3)
        assert _column(envs, "GROUP_RANK") == [0, 0, 0, 1, 1, 1]
        assert _column(envs, "LOCAL_RANK") == [0, 1, 2, 0, 1, 2]
        assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) for e in envs} == \
            {("6", "3", "2")}
    with pytest.raises(ValueError, match=r"rank 2 is not one of the 2 ranks placed on \['a', 'b'\]"):
        torchrun_environment(2, ["a", "b"], "127.0.0.1", 29500, "run-1")


def test_slurm_launcher_writes_our_batch_script():
    from jupyter_ring.cluster._slurm import RingSlurmEngineSetLauncher

    launcher = RingSlurmEngineSetLauncher(nodes=2, ntasks_per_node=3, time_limit="1:00:00",
                                          mpiexec="/opt/mpi/bin/mpiexec")
    text = launcher.batch_template
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=3\n#SBATCH --time=1:00:00\n" in text
    assert text.rstrip().endswith("/opt/mpi/bin/mpiexec -n {n} {program_and_args}")


def test_bad_hosts_fail_before_anything_starts():
    with pytest.raises(ValueError, match="'b:0' is not host or host:ranks"):
        plan(hosts=["a:2", "b:0"])
    with pytest.raises(ValueError, match="a cluster needs at least 1 rank"):
        plan(n=0)


def test_planning_here_starts_nothing_and_writes_nothing(tmp_path):
    """This machine probed for real, in a fresh process (no IPython shell, IPYTHONDIR empty)."""
    code = textwrap.dedent("""
        import json, os, psutil
        from jupyter_ring.cluster import RingCluster, plan_launch
        p = plan_launch(RingCluster(n=2, gpus="none"))
        print(json.dumps([p.n, p.gpus, p.one_host, p.profile_dir, os.path.exists(p.profile_dir),
                          [c.pid for c in psutil.Process().children(recursive=True)]]))
    """)
    env = dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    n, gpus, one_host, profile, made, children = json.loads(out)
    assert (n, gpus, one_host) == (2, [], True)
    assert profile == str(tmp_path / "ipython" / "profile_default")
    assert not made, "planning made the profile"
    assert children == [], "planning left processes running"


@pytest.mark.parametrize("n, cpus, cpu_limit, allowance", [
    (2, 2, "", 0.0), (8, 8, "", 0.0), (3, 2, "", 3.0), (16, 2, "", 42.0), (64, 2, "", 186.0),
    (64, 8, "2", 186.0),  # JupyterHub's CPU_LIMIT is the share the ranks queue for
])
def test_engine_and_setup_timeouts_grow_with_the_ranks_beyond_the_cores(n, cpus, cpu_limit, allowance):
    environ = {"CPU_LIMIT": cpu_limit} if cpu_limit else {}
    p = plan(Given(environ, cpus=cpus), n=n, engine_timeout=45)
    assert (p.start_allowance, p.engine_timeout) == (allowance, 45 + allowance)
    assert p.crowded == allowance / 3  # the ranks beyond the cores (the interrupt's grace grows by it)
    # the controller keeps an accepted engine's registration while its heart is not beating yet
    # (it starts after the engine's nanny and kernel) as long: else it drops the engine
    assert f"--IPController.registration_timeout={45 + int(allowance)}" in p.controller_args


def test_ranks_on_other_hosts_get_the_timeouts_as_given():
    p = plan(Given(cpus=2), hosts=["a:32", "b:32"], engine_timeout=45)
    assert (p.n, p.one_host, p.crowded, p.start_allowance, p.engine_timeout) == (64, False, 0.0, 0.0, 45)
    assert "--IPController.registration_timeout=45" in p.controller_args
    # never below ipyparallel's own 30 s
    assert "--IPController.registration_timeout=30" in plan(Given(), engine_timeout=5).controller_args

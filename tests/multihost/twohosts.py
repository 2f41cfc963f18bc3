"""Two simulated hosts on this machine: network namespaces joined by a veth pair, each with its
own hostname (``unshare --uts``) and its own Debian ``sshd``, a key made for the run, and an ssh
wrapper that MPICH's Hydra launches through (``HYDRA_LAUNCHER_EXEC``). Needs root.

Everything it creates (namespaces, veth, ``/etc/netns/<ns>``, sshd processes, keys, configs) has a
name unique to the run and is removed by :meth:`TwoHosts.close`, which also kills every process
still in either namespace. The same venv (same filesystem) runs on both "hosts".
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

__all__ = ["TwoHosts", "SlurmHosts", "missing", "slurm_missing", "built"]

SSHD = "/usr/sbin/sshd"


def missing():
    """Why two hosts cannot be built here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth and sshd)"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install iproute2 util-linux openssh-client)"
    if not os.path.exists(SSHD):
        return "needs Debian's openssh-server (scripts/setup.sh installs it when run as root)"
    return ""


@contextlib.contextmanager
def built(cls=None):
    """``with built(TwoHosts) as hosts``: opened, and closed in a finally that then fails if
    any namespace, process or file of theirs is left."""
    hosts = (cls or TwoHosts)().open()
    try:
        yield hosts
    finally:
        hosts.close()
        left = hosts.leftovers()
        if left:
            raise AssertionError(f"the simulated hosts left behind: {left}")


def _tail(path, n=1500):
    try:
        with open(path, errors="replace") as f:
            return f"--- {os.path.basename(path)}\n{f.read()[-n:]}\n"
    except OSError:
        return ""


def _run(*cmd, check=True, timeout=20):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


class TwoHosts:
    """``hosts[i]`` is ``{"name", "ns", "ip"}``; :meth:`cmd` runs a command on host i."""

    def __init__(self, subnet="10.77.0"):
        tag = f"{os.getpid() % 100000:05d}{int(time.time() * 1000) % 1000:03d}"
        self.tag = tag
        self.dir = tempfile.mkdtemp(prefix=f"jr_hosts_{tag}_")
        self.hosts = [{"name": f"jrhost{tag}{c}", "ns": f"jr{tag}{c}", "ip": f"{subnet}.{i + 1}"}
                      for i, c in enumerate("ab")]
        self.veth = [f"jv{tag}{c}" for c in "ab"]
        self.sshd = []             # Popen of `unshare --uts` (sshd runs -D under it)
        self._made_run_sshd = False
        self._made_etc_netns = not os.path.isdir("/etc/netns")
        self.ssh_wrapper = os.path.join(self.dir, "ssh")
        self.hostfile = os.path.join(self.dir, "hostfile")

    # ------------------------------------------------------------------------------ build
    def open(self):
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self):
        names = "".join(f"{h['ip']} {h['name']}\n" for h in self.hosts)
        for h in self.hosts:
            _run("ip", "netns", "add", h["ns"])
            os.makedirs(f"/etc/netns/{h['ns']}", exist_ok=True)
            with open(f"/etc/netns/{h['ns']}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{names}")
        self._link()
        for h, dev in zip(self.hosts, self.veth):
            _run("ip", "-n", h["ns"], "addr", "add", f"{h['ip']}/24", "dev", dev)
            _run("ip", "-n", h["ns"], "link", "set", dev, "up")
            _run("ip", "-n", h["ns"], "link", "set", "lo", "up")
        self._build_ssh()

    def _link(self):
        """The network between the hosts: here one veth pair from a to b."""
        a, b = self.hosts
        _run("ip", "link", "add", self.veth[0], "netns", a["ns"], "type", "veth",
             "peer", "name", self.veth[1], "netns", b["ns"])

    def _build_ssh(self):
        key = os.path.join(self.dir, "id_ed25519")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
        hostkey = os.path.join(self.dir, "host_ed25519")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", hostkey)
        shutil.copy(key + ".pub", os.path.join(self.dir, "authorized_keys"))
        sshd_config = os.path.join(self.dir, "sshd_config")
        with open(sshd_config, "w") as f:
            f.write(f"HostKey {hostkey}\nAuthorizedKeysFile {self.dir}/authorized_keys\n"
                    "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                    "AcceptEnv *\nPermitUserEnvironment no\nMaxStartups 100\nMaxSessions 100\n"
                    f"PidFile none\nListenAddress 0.0.0.0\nLogLevel ERROR\n")
        ssh_config = os.path.join(self.dir, "ssh_config")
        with open(ssh_config, "w") as f:
            f.write(f"Host *\n  IdentityFile {key}\n  IdentitiesOnly yes\n"
                    "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                    "  LogLevel ERROR\n  BatchMode yes\n  ConnectTimeout 5\n"
                    "  ServerAliveInterval 2\n  ServerAliveCountMax 3\n")
        with open(self.ssh_wrapper, "w") as f:
            f.write(f"#!/bin/sh\nexec ssh -F {ssh_config} \"$@\"\n")
        os.chmod(self.ssh_wrapper, 0o755)
        with open(self.hostfile, "w") as f:
            f.write("".join(f"{h['name']}:2\n" for h in self.hosts))
        if not os.path.isdir("/run/sshd"):  # sshd's privilege-separation dir
            os.makedirs("/run/sshd", mode=0o755)
            self._made_run_sshd = True
        self._sshd_config = sshd_config
        for i in range(len(self.hosts)):
            self._start_sshd(i)
        self._wait_sshd(self.hosts)

    def _start_sshd(self, i):
        # sshd -D stays in the foreground under unshare, in a UTS namespace of its own whose
        # hostname is the host's name: everything started over ssh sees that name.
        h = self.hosts[i]
        self.sshd.append(subprocess.Popen(
            ["ip", "netns", "exec", h["ns"], "unshare", "--uts", "sh", "-c",
             f"hostname {h['name']} && exec {SSHD} -D -e -f {self._sshd_config}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.dir, f"sshd_{h['name']}.log"), "a"),
            start_new_session=True))

    def restart_sshd(self, i):
        """Start host i's sshd again (after a test killed every process on the host)."""
        self._start_sshd(i)
        self._wait_sshd([self.hosts[i]])

    def _wait_sshd(self, hosts):
        deadline = time.monotonic() + 15
        for h in hosts:
            while True:
                probe = subprocess.run(self.cmd(0, [self.ssh_wrapper, h["name"], "hostname"]),
                                       capture_output=True, text=True, timeout=15)
                if probe.returncode == 0 and probe.stdout.strip() == h["name"]:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {h['name']} did not answer in 15 s: "
                                       f"{probe.stderr.strip()}")
                time.sleep(0.1)

    # ------------------------------------------------------------------------------ use
    def cmd(self, i, argv):
        """``argv`` run on host i: in its namespace (with its /etc/hosts), under its hostname."""
        h = self.hosts[i]
        return ["ip", "netns", "exec", h["ns"], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', h["name"], *argv]

    def env(self):
        """What a process on these hosts needs to launch over ssh with Hydra."""
        return {"HYDRA_LAUNCHER_EXEC": self.ssh_wrapper, "HYDRA_LAUNCHER": "ssh"}

    def pids(self, i):
        """Pids of the processes in host i's network namespace (sshd's included)."""
        out = _run("ip", "netns", "pids", self.hosts[i]["ns"], check=False).stdout
        return [int(p) for p in out.split()]

    def user_pids(self, i):
        """Pids in host i's namespace other than its sshd (what a cluster left behind)."""
        sshd = {p.pid for p in self.sshd}
        keep = []
        for pid in self.pids(i):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if pid in sshd or (argv and argv[0].endswith(b"sshd") and b"-D" in argv):
                continue
            keep.append(pid)
        return keep

    def cut(self, i):
        """Take host i's end of the veth down: it is cut off from the other host."""
        _run("ip", "-n", self.hosts[i]["ns"], "link", "set", self.veth[i], "down")

    def heal(self, i):
        """Bring host i's end of the veth back up."""
        _run("ip", "-n", self.hosts[i]["ns"], "link", "set", self.veth[i], "up")

    # ------------------------------------------------------------------------------ tear down
    def close(self):
        """Kill every process in both namespaces, delete them (and the veth), remove all files."""
        for proc in self.sshd:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for _ in range(50):
            left = [p for i in range(len(self.hosts)) for p in self.pids(i)]
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for proc in self.sshd:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for h in self.hosts:
            _run("ip", "netns", "delete", h["ns"], check=False)  # takes the veth pair with it
            shutil.rmtree(f"/etc/netns/{h['ns']}", ignore_errors=True)
        if self._made_run_sshd:
            shutil.rmtree("/run/sshd", ignore_errors=True)
        if self._made_etc_netns:
            try:
                os.rmdir("/etc/netns")
            except OSError:  # another run's namespace is in it
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def leftovers(self):
        """What close() failed to remove (for the fixture's check); [] when clean."""
        out = []
        names = _run("ip", "netns", "list", check=False).stdout
        for h in self.hosts:
            if h["ns"] in names:
                out.append(f"namespace {h['ns']}")
            if os.path.exists(f"/etc/netns/{h['ns']}"):
                out.append(f"/etc/netns/{h['ns']}")
        if os.path.exists(self.dir):
            out.append(self.dir)
        for proc in self.sshd:
            if proc.poll() is None:
                out.append(f"sshd pid {proc.pid}")
        return out


if __name__ == "__main__":  # a smoke run: python tests/multihost/twohosts.py [CMD ...] (on host a)
    t0 = time.monotonic()
    hosts = TwoHosts().open()
    print(f"set up in {time.monotonic() - t0:.2f} s: {hosts.hosts}")
    try:
        argv = sys.argv[1:] or [hosts.ssh_wrapper, hosts.hosts[1]["name"], "hostname"]
        env = dict(os.environ, **hosts.env(), JR_HOSTFILE=hosts.hostfile)
        out = subprocess.run(hosts.cmd(0, argv), capture_output=True, text=True, timeout=60, env=env)
        print(out.returncode, out.stdout, out.stderr)
    finally:
        t0 = time.monotonic()
        hosts.close()
        print(f"torn down in {time.monotonic() - t0:.2f} s; left: {hosts.leftovers()}", file=sys.stderr)


# ---------------------------------------------------------------------------------------- Slurm
def slurm_missing():
    """Why Slurm cannot run on the two hosts here ("" when it can)."""
    why = missing()
    if why:
        return why
    for tool in ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged"):
        if not os.path.exists(tool):
            return (f"needs {tool} (Debian's slurmctld, slurmd and munge; scripts/setup.sh "
                    f"installs them when run as root)")
    return ""


class SlurmHosts(TwoHosts):
    """Two hosts plus a Slurm cluster on them: munged (own key and socket, shared by both),
    slurmctld on host a, slurmd on both, partition ``jr``; clients need ``self.env()``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conf = os.path.join(self.dir, "slurm.conf")

    def _build(self):
        super()._build()
        d = self.dir
        munge_key = os.path.join(d, "munge.key")
        with open(munge_key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(munge_key, 0o400)
        sock = os.path.join(d, "munge.sock")
        self.sshd.append(subprocess.Popen(
            ["/usr/sbin/munged", "-F", "--force", f"--socket={sock}", f"--key-file={munge_key}",
             f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
             f"--seed-file={d}/munged.seed"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True))
        a, b = self.hosts
        os.makedirs(f"{d}/state", exist_ok=True)
        nodes = "".join(f"NodeName={h['name']} NodeAddr={h['ip']} CPUs={os.cpu_count()} "
                        f"State=UNKNOWN\n" for h in self.hosts)
        with open(self.conf, "w") as f:
            f.write(f"ClusterName=jr{self.tag}\nSlurmctldHost={a['name']}({a['ip']})\n"
                    f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={sock}\n"
                    f"SlurmUser=root\nSlurmdUser=root\nStateSaveLocation={d}/state\n"
                    f"SlurmdSpoolDir={d}/spool_%n\nSlurmctldPidFile={d}/slurmctld.pid\n"
                    f"SlurmdPidFile={d}/slurmd_%n.pid\nSlurmctldLogFile={d}/slurmctld.log\n"
                    f"SlurmdLogFile={d}/slurmd_%n.log\nProctrackType=proctrack/linuxproc\n"
                    "TaskPlugin=task/none\nMpiDefault=none\nSchedulerType=sched/builtin\n"
                    "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
                    "ReturnToService=2\nJobCompType=jobcomp/none\n"
                    "AccountingStorageType=accounting_storage/none\nSlurmdTimeout=30\n"
                    + nodes +
                    "PartitionName=jr Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
                    "OverSubscribe=FORCE:4\n")
        with open(os.path.join(d, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\n")
        env = dict(os.environ, SLURM_CONF=self.conf)
        self.sshd.append(subprocess.Popen(
            self.cmd(0, ["/usr/sbin/slurmctld", "-D", "-i", "-f", self.conf]), env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(f"{d}/slurmctld.err", "w"), start_new_session=True))
        for i, h in enumerate(self.hosts):
            self.sshd.append(subprocess.Popen(
                self.cmd(i, ["/usr/sbin/slurmd", "-D", "-N", h["name"], "-f", self.conf]),
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=open(f"{d}/slurmd_{h['name']}.err", "w"), start_new_session=True))
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run(self.cmd(0, ["sinfo", "-h", "-N", "-o", "%N %T"]), env=env,
                                 capture_output=True, text=True, timeout=20)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if len(states) == 2 and all(s in ("idle", "mixed") for s in states.values()):
                break
            if time.monotonic() > deadline:
                logs = "".join(_tail(os.path.join(d, name)) for name in sorted(os.listdir(d))
                               if name.endswith((".log", ".err")))
                raise RuntimeError(f"Slurm nodes not idle in 30 s: {out.stdout} {out.stderr}\n"
                                   f"{logs}")
            time.sleep(0.3)

    def env(self):
        return dict(super().env(), SLURM_CONF=self.conf)

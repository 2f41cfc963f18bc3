# A JupyterHub for a teaching lab with jupyter_ring: real Unix accounts, one shared environment.
#
#   sudo scripts/lab-env.sh                       # builds /opt/jupyter_ring-lab once for all
#   sudo /opt/jupyter_ring-lab/bin/jupyterhub -f examples/jupyterhub_config.py
#
# Every student is a Unix account on this host (useradd -m alice; passwd alice) and logs in with
# that password (PAM). The hub runs as root and starts each student's server as that student
# (LocalProcessSpawner: setuid to the account, HOME = its home), so files, processes and
# jupyter_ring clusters belong to the student: another student cannot read their connection files,
# signal their ranks or reach their server (see docs/teaching-lab.md). Everything a student runs
# comes from the shared, root-owned, world-readable environment built by scripts/lab-env.sh.
#
# Settings read from the environment (all optional), so that one file serves a course and the
# project's tests: JUPYTER_RING_LAB (the lab environment), LAB_USERS (comma-separated allowed
# students), LAB_CPU_LIMIT / LAB_MEM_LIMIT (each student's share), LAB_PORT, LAB_HUB_PORT,
# LAB_PROXY_API_PORT, LAB_STATE_DIR (hub database and cookie secret).
import os

c = get_config()  # noqa: F821 (provided by JupyterHub when it loads this file)

lab = os.environ.get("JUPYTER_RING_LAB", "/opt/jupyter_ring-lab")
state = os.environ.get("LAB_STATE_DIR", "/srv/jupyterhub")

# ---- network: the public proxy port is the only one meant for browsers; everything else is on
# loopback. Put a TLS-terminating reverse proxy in front of LAB_PORT for a real course, or set
# c.JupyterHub.ssl_key / ssl_cert and ip = "".
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = int(os.environ.get("LAB_PORT", "8000"))
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = int(os.environ.get("LAB_HUB_PORT", "8081"))
c.ConfigurableHTTPProxy.command = [os.path.join(lab, "node", "bin", "configurable-http-proxy")]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{os.environ.get('LAB_PROXY_API_PORT', '8001')}"
c.JupyterHub.db_url = f"sqlite:///{os.path.join(state, 'jupyterhub.sqlite')}"
c.JupyterHub.cookie_secret_file = os.path.join(state, "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = os.path.join(state, "jupyterhub-proxy.pid")

# ---- who may log in: Unix accounts (PAM), only the students listed
c.JupyterHub.authenticator_class = "pam"
users = {u.strip() for u in os.environ.get("LAB_USERS", "").split(",") if u.strip()}
if users:
    c.Authenticator.allowed_users = users

# ---- each student's server: their own Unix account, the shared environment
c.JupyterHub.spawner_class = "localprocess"
# umask 077: every file a student's processes create (notebooks, logs, jupyter_ring's and
# ipyparallel's files) is theirs alone unless they chmod it
c.Spawner.cmd = ["/bin/sh", "-c", 'umask 077 && exec "$0" "$@"',
                 os.path.join(lab, "bin", "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = "~"
c.Spawner.ip = "127.0.0.1"
c.Spawner.environment = {
    # the lab's python, jupyter, mpiexec (MPICH wheel) first; nothing from root's PATH
    "PATH": f"{os.path.join(lab, 'bin')}:/usr/local/bin:/usr/bin:/bin",
}
# Each student's share of the machine. LocalProcessSpawner does not enforce these (it only sets
# CPU_LIMIT and MEM_LIMIT in the server's environment); jupyter_ring reads them: `%ring start`
# without -n starts min(cores, CPU_LIMIT, MEM_LIMIT / 2 GiB) ranks and gives each rank
# CPU_LIMIT / ranks threads (OMP/MKL/OpenBLAS/torch). For hard limits use a spawner that enforces
# them (systemdspawner: cgroups) with the same two settings.
c.Spawner.cpu_limit = float(os.environ.get("LAB_CPU_LIMIT", "1"))
c.Spawner.mem_limit = os.environ.get("LAB_MEM_LIMIT", "4G")
c.Spawner.start_timeout = 60
c.Spawner.http_timeout = 60

# ---- nothing outlives a student's session: stopping (or culling) the server shuts its kernels
# down, and each kernel's jupyter_ring watchdog kills its cluster even if the kernel is killed.
# The idle culler (jupyterhub-idle-culler, in jupyter_ring[hub]) stops servers idle for
# LAB_CULL_TIMEOUT seconds (default one hour; 0: no culler), which frees their share.
cull_timeout = int(os.environ.get("LAB_CULL_TIMEOUT", "3600"))
if cull_timeout > 0:
    c.JupyterHub.services = [{
        "name": "idle-culler",
        "command": [os.path.join(lab, "bin", "python"), "-m", "jupyterhub_idle_culler",
                    f"--timeout={cull_timeout}", f"--cull-every={max(1, min(300, cull_timeout // 4))}"],
    }]
    c.JupyterHub.load_roles = [{
        "name": "idle-culler", "services": ["idle-culler"],
        "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
    }]
c.JupyterHub.cleanup_servers = True

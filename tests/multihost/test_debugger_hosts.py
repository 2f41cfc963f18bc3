"""The notebook's debugger on a cluster across two hosts (issue 35, item 6): the rig of
test_hydra_ssh (network namespaces, each with its hostname and sshd; Hydra over ssh), the kernel
on host a, ranks 2 and 3 on host b. The prompt records travel through the profile's where folder,
on the file system both hosts share (as a shared home on a real cluster). The kernel's interrupt
of a cell reaches the ranks of host b through the controller and their nannies (the control
channel), also a rank that has not begun the cell."""

import os
import re
import tempfile

from test_hydra_ssh import hosts, kernel  # noqa: F401  (the rig and a kernel on host a)

BREAKPOINT = """%%distributed
import socket
import numpy as np
here = socket.gethostname()
seen = np.random.default_rng().integers(100, 999, 3)
if ring.rank() == 3:
    breakpoint()
total = ring.allreduce(np.ones(3) * (ring.rank() + 1), op=ring.Sum, name="after_the_stop")
print(f"rank {ring.rank()} on {here} total={total.tolist()} seen={int(seen.sum())}")
"""

FAILING = """%%distributed
def check(part):
    limit = 10 * ring.rank()
    if ring.rank() == 2:
        raise RuntimeError(f"rank 2 on {here}: part {part} over {limit}")
check(ring.rank() + 100)
"""

# every rank has set kept before rank 2 stops (the first allreduce): the interrupt then finds the
# cell begun everywhere, and what it must keep is known
INTERRUPTED = """%%distributed
kept = ring.rank() * 7
ring.allreduce(np.ones(1), name="all_kept")
if ring.rank() == 2:
    breakpoint()
ring.allreduce(np.ones(2), name="never")
"""

# Rank 3, on host b, is held by an earlier request of its own when the kernel's interrupt comes
HOLD = """import os, time
while not os.path.exists({release!r}):
    time.sleep(0.01)
held = 'released'
"""

# the ranks that began (each marks it once its ran_y is set: the interrupt comes when ranks 0-2 have)
# wait in a collective rank 3 never joins: the next cell resyncs every rank
# across the two hosts (see test_resync_hosts.py)
NOT_BEGUN = """%%distributed
import os
ran_y = ring.rank()
open(os.path.join({marks!r}, str(ring.rank())), 'w').close()
ring.allreduce(np.ones(2), name="waits_for_rank_3")
"""


class Script:
    def __init__(self, lines):
        self.lines, self.prompts = list(lines), []

    def __call__(self, prompt, text):
        self.prompts.append(prompt)
        return self.lines.pop(0)


def test_prompt_post_mortem_and_interrupt_on_a_rank_of_the_other_host(hosts, kernel):  # noqa: F811
    a, b = hosts.hosts
    kernel.ok(f"%ring start --hostfile {hosts.hostfile} --gpus none", timeout=120)

    # breakpoint() on rank 3, on host b; the others wait for it in an allreduce
    script = Script(["p here", "p int(seen.sum())", "c"])
    out, error = kernel.execute(BREAKPOINT, answer=script, timeout=120)
    assert error is None and not script.lines, (error, out, script.prompts)
    assert all(p.startswith("(Pdb rank 3)") for p in script.prompts), script.prompts
    assert f"\n'{b['name']}'\n" in out, out
    for rank, host in ((0, a), (1, a), (2, b), (3, b)):
        assert f"rank {rank} on {host['name']} total=[10.0, 10.0, 10.0] seen=" in out, out
    seen = re.search(r"rank 3 on \S+ total=\[[^]]*\] seen=(\d+)", out).group(1)
    assert f"\n{seen}\n" in out, out  # p int(seen.sum()) at rank 3's prompt

    # post-mortem on rank 2, on host b
    out, error = kernel.execute(FAILING, timeout=60)
    assert error is not None and "RuntimeError: rank 2 on " + b["name"] in error["evalue"], error
    script = Script(["p part, limit", "q"])
    out, error = kernel.execute("%ring debug", answer=script, timeout=60)
    assert error is None and not script.lines, (error, out)
    assert script.prompts[0].startswith("(Pdb rank 2)"), script.prompts
    assert "post-mortem of In[" in out and "\n(102, 20)\n" in out, out

    # the kernel's interrupt while rank 2 sits at its prompt on host b: the cell ends, state kept
    asked = []
    out, error = kernel.execute(INTERRUPTED, timeout=120, answer=lambda p, t: asked.append(p),
                                interrupt_when=lambda: bool(asked))
    assert asked and asked[0].startswith("(Pdb rank 2)"), asked
    assert error is not None and "Interrupt" in error["ename"] + error["evalue"], (error, out)
    out, error = kernel.execute("%%distributed\nprint('kept', ring.rank(), kept, "
                                "ring.allreduce(np.ones(2), op=ring.Sum, name='next').tolist())", timeout=120)
    assert error is None, (error, out)
    assert sorted(re.findall(r"kept (\d) (\d+) \[4\.0, 4\.0\]", out)) == [
        (str(r), str(7 * r)) for r in range(4)], out

    # the kernel's interrupt while rank 3, on host b, has not begun the cell (an earlier request
    # holds it): the interrupt waits there for the cell, which stops as it begins, and the request
    # ends unharmed; the next cell runs clean on every rank
    marks = tempfile.mkdtemp(dir=hosts.dir)
    release = os.path.join(marks, "release")
    kernel.ok("_rc = get_ipython().magics_manager.registry['RingMagics'].cluster\n"
              f"_held = _rc.client[_rc.engine_ids[3]].execute({HOLD.format(release=release)!r}, "
              "block=False)")
    messages = []

    def release_once_rank_3_waits(got):
        if any("had not begun the cell" in m["content"].get("text", "") for m in got):
            open(release, "w").close()

    try:
        out, error = kernel.execute(NOT_BEGUN.format(marks=marks), timeout=120, messages=messages,
                                    during=release_once_rank_3_waits,
                                    interrupt_when=lambda: all(os.path.exists(os.path.join(marks, str(r))) for r in range(3)))
    finally:
        open(release, "w").close()
    kernel.ok("_held.wait(60)\nassert _held.successful(), _held.get()")  # not interrupted
    assert "(rank(s) 3 had not begun the cell when interrupted" in out, out
    assert error is not None and error["ename"] == "CellInterrupted", (error, out)
    assert error["evalue"].endswith(", rank 3 before the cell began (none of its code ran)"), error
    out, error = kernel.execute("%%distributed\nprint('ran', ring.rank(), globals().get('ran_y'), "
                                "globals().get('held'), ring.allreduce(np.ones(2), op=ring.Sum, "
                                "name='after_not_begun').tolist())", timeout=120)
    assert error is None, (error, out)
    assert sorted(re.findall(r"ran (\d) (\w+) (\w+) \[4\.0, 4\.0\]", out)) == [
        ("0", "0", "None"), ("1", "1", "None"), ("2", "2", "None"), ("3", "None", "released")], out
    kernel.ok("%ring stop", timeout=60)

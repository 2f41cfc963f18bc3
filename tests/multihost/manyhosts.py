"""Several simulated hosts on this machine (issue 33, item 3): ``TwoHosts`` grown to ``count``
network namespaces, each joined by a veth to a bridge in a namespace of its own, each host's link
shaped to a LAN's bandwidth (``LINKS``). Needs root.

The links' rate is shaped by a token bucket (``tc tbf``) on each host's egress. Their latency
is the veth's and the kernel's own: ``tc netem`` (which would add a LAN's delay) needs the
``sch_netem`` module, which this machine's kernel does not have; ``netem_missing()`` says so, and
where it is there ``LINKS``' delays are added too.

Like ``TwoHosts`` everything it creates has a name unique to the run and is removed by
:meth:`ManyHosts.close` (the bridge's namespace too). The cores are this machine's: the links
are what is simulated, not the hosts' CPUs.
"""

import os

from twohosts import TwoHosts, _run

__all__ = ["ManyHosts", "LINKS", "netem_missing"]

# A host's egress rate and the one-way latency netem adds where it can (on top of the veth's own):
# a switch hop and the NICs of a datacentre LAN, as tc writes them. MTU 9000 (jumbo frames).
LINKS = {
    "10GbE": {"delay": "10us", "rate": "10gbit"},
    "100GbE": {"delay": "2us", "rate": "100gbit"},
    "none": {},
}


def netem_missing():
    """Why ``tc netem`` cannot add delay here ("" when it can): tried in a scratch namespace."""
    ns = f"jrnetem{os.getpid()}"
    _run("ip", "netns", "add", ns)
    try:
        out = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us",
                   check=False)
        return out.stderr.strip() and f"tc netem: {out.stderr.strip()} (no sch_netem in this kernel)"
    finally:
        _run("ip", "netns", "delete", ns, check=False)


class ManyHosts(TwoHosts):
    """``count`` hosts of ``ranks`` slots each (the hostfile), links shaped as ``LINKS[link]``."""

    def __init__(self, count=8, ranks=2, link="10GbE", subnet="10.78.0"):
        super().__init__(subnet)
        tag = self.tag
        self.hosts = [{"name": f"jrh{tag}{i}", "ns": f"jr{tag}h{i}", "ip": f"{subnet}.{i + 1}"}
                      for i in range(count)]
        self.veth = [f"jv{tag}h{i}" for i in range(count)]
        self.bridge_ns = f"jr{tag}br"
        self.ranks = ranks
        self.link = link

    def _link(self):
        br = self.bridge_ns
        _run("ip", "netns", "add", br)
        _run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", br, "link", "set", "br0", "mtu", "9000")
        _run("ip", "-n", br, "link", "set", "br0", "up")
        for i, h in enumerate(self.hosts):
            port = f"jb{self.tag}h{i}"
            _run("ip", "link", "add", self.veth[i], "netns", h["ns"], "type", "veth", "peer", "name", port,
                 "netns", br)
            for ns, dev in ((br, port), (h["ns"], self.veth[i])):
                _run("ip", "-n", ns, "link", "set", dev, "mtu", "9000")
            _run("ip", "-n", br, "link", "set", port, "master", "br0")
            _run("ip", "-n", br, "link", "set", port, "up")

    def _build(self):
        super()._build()
        shape = LINKS[self.link]
        self.delayed = bool(shape) and not netem_missing()
        for h, dev in zip(self.hosts, self.veth):
            tc = ["ip", "netns", "exec", h["ns"], "tc", "qdisc", "add", "dev", dev, "root"]
            if self.delayed:
                _run(*tc, "netem", "delay", shape["delay"], "rate", shape["rate"], "limit", "100000")
            elif shape:
                _run(*tc, "tbf", "rate", shape["rate"], "burst", "512kb", "latency", "50ms")
        with open(self.hostfile, "w") as f:
            f.write("".join(f"{h['name']}:{self.ranks}\n" for h in self.hosts))

    def close(self):
        super().close()
        _run("ip", "netns", "delete", self.bridge_ns, check=False)

    def leftovers(self):
        out = super().leftovers()
        if self.bridge_ns in _run("ip", "netns", "list", check=False).stdout:
            out.append(f"namespace {self.bridge_ns}")
        return out

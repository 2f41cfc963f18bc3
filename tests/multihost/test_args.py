"""Multi-host arguments checked before anything starts (no root, no cluster needed)."""

import os

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from jupyter_ring.cluster import ClusterError, host_slots, routable_address


def test_host_slots_read_hosts_and_hostfiles(tmp_path):
    assert host_slots(["a:2", "b.example.org:3", "c"]) == [("a", 2), ("b.example.org", 3),
                                                           ("c", None)]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the lab\nnodeA:2\n\nnodeB:2  # second\n")
    assert host_slots([], str(hostfile)) == [("nodeA", 2), ("nodeB", 2)]


@pytest.mark.parametrize("entry", ["a:0", "a:x", "a b", "a:2:3", ""])
def test_bad_host_entries_name_the_entry_and_the_form(entry):
    with pytest.raises(ValueError) as info:
        host_slots([entry])
    assert repr(entry) in str(info.value) and "host:ranks" in str(info.value)


def test_missing_or_empty_hostfile_says_so(tmp_path):
    with pytest.raises(ValueError, match="No such file"):
        host_slots([], str(tmp_path / "nope"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="names no host"):
        host_slots([], str(tmp_path / "empty"))


def test_routable_address_is_not_loopback_or_says_how_to_choose(monkeypatch):
    import socket

    try:
        addr = routable_address(["localhost"])
    except ClusterError as exc:  # a machine whose only address is loopback
        assert "--ip ADDR" in str(exc)
    else:
        assert not addr.startswith("127."), addr
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    with pytest.raises(ClusterError, match="--ip ADDR"):
        routable_address(["localhost"])


def test_percent_ring_start_bad_hosts_is_a_usage_error(tmp_path):
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "jupyter_ring")
    with pytest.raises(UsageError, match="'b:0' is not host or host:ranks"):
        shell.run_line_magic("ring", "start --hosts a:2,b:0")
    with pytest.raises(UsageError, match="--hostfile"):
        shell.run_line_magic("ring", f"start --hostfile {os.path.join(tmp_path, 'none')}")

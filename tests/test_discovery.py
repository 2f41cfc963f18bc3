"""Host discovery's source (``cluster._discovery``): real scripts run as subprocesses, real
callables imported by name; what they print parsed into host -> slots, or a clear error."""

import stat
import sys
import textwrap
import time

import pytest

from jupyter_ring.cluster._discovery import DiscoveryError, HostDiscovery, parse_hosts, resolve, wanted


def script(tmp_path, body, name="discover.sh"):
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.parametrize("text, hosts", [
    ("localhost:3\n", {"localhost": 3}),
    ("a:2\n\n# a comment\nb\nc:5  # trailing\n", {"a": 2, "b": 1, "c": 5}),
    ("a:2\na:1\n", {"a": 3}),
    ("", {}),
    ("node-7.cluster.local:13", {"node-7.cluster.local": 13}),
])
def test_lines_of_host_and_slots_are_parsed(text, hosts):
    assert parse_hosts(text, "s") == hosts


@pytest.mark.parametrize("text, says", [
    ("localhost:x\n", "line 1 is 'localhost:x', not 'host:slots'"),
    ("a:2\nhello world\n", "line 2 is 'hello world'"),
    ("a:0\n", "line 1 gives a 0 slots"),
    ("a:-2\n", "line 1 is 'a:-2'"),
    ("a:2:3\n", "line 1 is 'a:2:3'"),
])
def test_garbage_is_an_error_naming_the_line(text, says):
    with pytest.raises(DiscoveryError, match="host discovery src") as info:
        parse_hosts(text, "src")
    assert says in str(info.value)


def test_a_script_is_run_each_time_it_is_asked(tmp_path):
    slots = tmp_path / "slots"
    slots.write_text("2")
    path = script(tmp_path, f'echo "localhost:$(cat {slots})"\n')
    ask = resolve(path)
    assert ask() == {"localhost": 2}
    slots.write_text("5")
    assert ask() == {"localhost": 5}


@pytest.mark.parametrize("body, says", [
    ("echo oops >&2\nexit 3\n", "exited 3: oops"),
    ("echo 'not a host line'\n", "line 1 is 'not a host line'"),
])
def test_a_failing_script_says_why(tmp_path, body, says):
    ask = resolve(script(tmp_path, body))
    with pytest.raises(DiscoveryError) as info:
        ask()
    assert says in str(info.value)


def test_a_missing_or_unexecutable_script_is_refused_at_once(tmp_path):
    with pytest.raises(DiscoveryError, match="is not an executable file"):
        resolve(str(tmp_path / "nowhere.sh"))
    plain = tmp_path / "plain.sh"
    plain.write_text("echo localhost:2\n")
    with pytest.raises(DiscoveryError, match="chmod"):
        resolve(str(plain))
    with pytest.raises(DiscoveryError, match="give a script"):
        resolve("  ")


def test_a_callable_by_name(tmp_path, monkeypatch):
    (tmp_path / "e34_hosts.py").write_text(textwrap.dedent("""
        answer = "a:2\\nb:1"
        def text(): return answer
        def mapping(): return {"a": 4}
        def lines(): return ["a:1", "b:2"]
        def number(): return 7
        def boom(): raise RuntimeError("no inventory")
        not_callable = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve("e34_hosts:text")() == {"a": 2, "b": 1}
    assert resolve("e34_hosts:mapping")() == {"a": 4}
    assert resolve("e34_hosts:lines")() == {"a": 1, "b": 2}
    with pytest.raises(DiscoveryError, match=r"e34_hosts:number\(\) returned int"):
        resolve("e34_hosts:number")()
    with pytest.raises(DiscoveryError, match=r"e34_hosts:boom\(\) raised RuntimeError: no inventory"):
        resolve("e34_hosts:boom")()
    with pytest.raises(DiscoveryError, match="is not callable"):
        resolve("e34_hosts:not_callable")
    with pytest.raises(DiscoveryError, match="cannot import it"):
        resolve("e34_no_such_module:f")


@pytest.mark.parametrize("slots, low, high, n", [
    (3, 1, None, 3), (1, 2, None, None), (9, 1, 4, 4), (2, 2, 2, 2), (0, 1, None, None)])
def test_wanted_keeps_within_min_and_max(slots, low, high, n):
    got, why = wanted(slots, low, high)
    assert got == n
    assert (why == "") == (n == slots)


def test_the_poller_follows_the_source_and_keeps_its_failures(tmp_path):
    slots = tmp_path / "slots"
    slots.write_text("localhost:2")
    discovery = HostDiscovery(script(tmp_path, f"cat {slots}\n"), interval=0.05)
    discovery.start()
    try:
        def until(check, limit=20.0):
            deadline = time.monotonic() + limit
            while not check(discovery.latest()):
                assert time.monotonic() < deadline, discovery.latest()
                time.sleep(0.02)
        until(lambda f: f.slots == 2)
        slots.write_text("localhost:3\nother:1")
        until(lambda f: f.slots == 4 and f.hosts == {"localhost": 3, "other": 1})
        slots.write_text("garbage here")
        until(lambda f: f.slots is None and "line 1 is 'garbage here'" in f.error)
        seq = discovery.latest().seq
        until(lambda f: f.seq > seq + 2)  # a failure never ends the thread
        slots.write_text("localhost:1")
        until(lambda f: f.slots == 1 and f.error == "")
    finally:
        discovery.stop()
    assert discovery._thread is None
    with pytest.raises(DiscoveryError, match="interval must be > 0"):
        HostDiscovery(sys.executable, interval=0)

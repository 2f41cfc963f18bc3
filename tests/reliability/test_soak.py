"""Soak: 40,000 collectives of random kinds and sizes on 2 ranks (JUPYTER_RING_SOAK_OPS=100000 for
the long soak of docs/reliability.md), exact results, with a deliberate mismatch or bad argument
every 500th op; RSS grows < 10 % after warm-up, open files and threads not at all."""

import json
import os
import re

import pytest


@pytest.mark.timeout(600)
def test_random_collectives_exact_and_no_leaks(mpirun):
    count = int(os.environ.get("JUPYTER_RING_SOAK_OPS", "40000"))
    result = mpirun("rel_soak.py", 2, count, timeout=560)
    text = re.sub(r"(?=SOAK \{)", "\n", result.stdout)
    soaks = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("SOAK {")]
    assert sorted(s["rank"] for s in soaks) == [0, 1]
    for soak in soaks:
        warm, end = soak["warm"], soak["end"]
        growth = end["rss"] / warm["rss"] - 1
        print(f"rank {soak['rank']}: {soak['ops']} ops, {soak['errors']} deliberate errors, RSS "
              f"{warm['rss'] / 2**20:.1f} -> {end['rss'] / 2**20:.1f} MiB ({growth:+.1%}), fds "
              f"{warm['fds']} -> {end['fds']}, threads {warm['tasks']} -> {end['tasks']}")
        assert soak["errors"] == count // 500
        assert growth < 0.10, soak
        assert end["fds"] == warm["fds"] and end["tasks"] == warm["tasks"], soak

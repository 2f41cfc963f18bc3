"""Issue: bad input. 16 cases under a real mpiexec: every rank raises a clear error at once (far
inside the stall timeout), the rank at fault with its own error, and the next collective is exact.
"""

import json
import re
import statistics

import pytest

EXPECT = {
    # case: (exception on the ranks that called correctly, on the rank at fault, text in the message)
    "shape": ("CollectiveMismatchError", "CollectiveMismatchError", "shape (17, 17, 17) on rank 0 but (18, 18, 18) on rank 1"),
    "dtype": ("CollectiveMismatchError", "CollectiveMismatchError", "but float64 on rank 1"),
    "count": ("CollectiveMismatchError", "CollectiveMismatchError", "trailing shape (3,) on ranks 0"),
    "reduce op": ("CollectiveMismatchError", "CollectiveMismatchError", "reduce op Sum on ranks 0"),
    "root": ("CollectiveMismatchError", "CollectiveMismatchError", "root rank 0 on ranks 0"),
    "name": ("CollectiveMismatchError", "CollectiveMismatchError", "name weight on ranks 0"),
    "number of tensors": ("CollectiveMismatchError", "CollectiveMismatchError", "number of tensors 2 on ranks 0"),
    "kind": ("CollectiveMismatchError", "CollectiveMismatchError", "called allreduce on ranks 0"),
    "object type": ("PeerError", "TypeError", "cannot be pickled"),
    "non-contiguous": ("PeerError", "ValueError", "needs a C-contiguous array"),
    "read-only": ("PeerError", "ValueError", "read-only"),
    "unsupported dtype": ("PeerError", "TypeError", "dtype <U1 is not supported"),
    "root out of range": ("PeerError", "ValueError", "root_rank 8 is out of range"),
    "alltoall splits": ("PeerError", "ValueError", "must be 3 non-negative row counts"),
    "adasum everywhere": ("ValueError", "ValueError", "op=Adasum is not supported"),
    "int prescale": ("TypeError", "TypeError", "need a floating-point tensor"),
}


def records(result):
    text = re.sub(r"(?=CASE \{)", "\n", result.stdout)
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("CASE {")]


@pytest.mark.timeout(240)
def test_sixteen_kinds_of_bad_input_raise_on_every_rank_and_the_next_collective_works(mpirun, tmp_path):
    n, repeats = 3, 3
    result = mpirun("rel_bad_input.py", n, repeats, env={"JUPYTER_RING_STALL_TIMEOUT": "10"}, timeout=200)
    recs = records(result)
    assert sorted(int(line.split()[1]) for line in result.lines("RANK_OK")) == list(range(n))
    assert {r["case"] for r in recs} == set(EXPECT)
    rows = []
    for case, (peer_type, fault_type, needle) in EXPECT.items():
        mine = [r for r in recs if r["case"] == case]
        assert len(mine) == n * repeats, case
        for rec in mine:
            at_fault = rec["rank"] == (0 if case == "object type" else 1)
            want = fault_type if at_fault else peer_type
            assert rec["type"] == want, (case, rec)
            assert needle in rec["message"], (case, rec["message"])
            if rec["type"] == "PeerError":
                assert f"rank {0 if case == 'object type' else 1} could not join" in rec["message"]
            assert rec["seconds"] < 2.0, (case, rec)  # the stall timeout is 10 s: nobody waited for it
        times = [r["seconds"] for r in mine]
        rows.append((case, len(mine), statistics.median(times), max(times)))
    # figures for docs/reliability.md
    (tmp_path / "bad_input.json").write_text(json.dumps(rows))
    print("\n| case | raises (ranks x repeats) | median ms | max ms |")
    for case, count, med, worst in rows:
        print(f"| {case} | {count} | {med * 1e3:.1f} | {worst * 1e3:.1f} |")

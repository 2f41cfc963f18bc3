"""Issue: bad input. 16 cases under a real mpiexec at 2, 3 and 4 ranks: every rank raises a clear
error at once (far inside the stall timeout) naming the ranks and values of its world, the rank at
fault with its own error, and the next collective is exact.
"""

import json
import re
import statistics

import pytest
from bounds import REPORT_S


def ranks(qs):
    """How the runtime's messages list ranks: 'rank 0' or 'ranks 0, 2, 3'."""
    return f"rank {qs[0]}" if len(qs) == 1 else "ranks " + ", ".join(map(str, qs))


def expect(n):
    """Case: (exception on the ranks that called correctly, on the rank at fault, text in the
    message), the text for a world of ``n`` ranks where rank 1 misbehaves (rank 0 for the object)."""
    rest = ranks([q for q in range(n) if q != 1])
    shapes = ", ".join(f"({17 + q}, {17 + q}, {17 + q}) on rank {q}" for q in range(1, n))
    return {
        "shape": ("CollectiveMismatchError", "CollectiveMismatchError", f"shape (17, 17, 17) on rank 0 but {shapes}."),
        "dtype": ("CollectiveMismatchError", "CollectiveMismatchError", f"dtype float32 on {rest} but float64 on rank 1"),
        "count": ("CollectiveMismatchError", "CollectiveMismatchError", f"trailing shape (3,) on {rest} but (4,) on rank 1"),
        "reduce op": ("CollectiveMismatchError", "CollectiveMismatchError", f"reduce op Sum on {rest} but Max on rank 1"),
        "root": ("CollectiveMismatchError", "CollectiveMismatchError", f"root rank 0 on {rest} but 1 on rank 1"),
        "name": ("CollectiveMismatchError", "CollectiveMismatchError", f"name weight on {rest} but bias on rank 1"),
        "number of tensors": ("CollectiveMismatchError", "CollectiveMismatchError",
                              f"number of tensors 2 on {rest} but 3 on rank 1"),
        "kind": ("CollectiveMismatchError", "CollectiveMismatchError", f"called allreduce on {rest} but broadcast on rank 1"),
        "object type": ("PeerError", "TypeError", "cannot be pickled"),
        "non-contiguous": ("PeerError", "ValueError", "needs a C-contiguous array"),
        "read-only": ("PeerError", "ValueError", "read-only"),
        "unsupported dtype": ("PeerError", "TypeError", "dtype <U1 is not supported"),
        "root out of range": ("PeerError", "ValueError", f"root_rank {n + 5} is out of range for {n} ranks (0..{n - 1})"),
        "alltoall splits": ("PeerError", "ValueError", f"splits {[n + 1] + [0] * (n - 1)} must be {n} non-negative "
                            f"row counts summing to dim 0 ({n})"),
        "adasum everywhere": ("ValueError", "ValueError", "op=Adasum is not supported"),
        "int prescale": ("TypeError", "TypeError", "need a floating-point tensor"),
    }


def records(result):
    text = re.sub(r"(?=CASE \{)", "\n", result.stdout)
    # raw_decode: mpiexec may glue another rank's line after the JSON
    return [json.JSONDecoder().raw_decode(line[5:])[0] for line in text.splitlines() if line.startswith("CASE {")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3, 4])  # 4 ranks outnumber the cores here
def test_sixteen_kinds_of_bad_input_raise_on_every_rank_and_the_next_collective_works(mpirun, tmp_path, n):
    repeats = 3
    cases = expect(n)
    result = mpirun("rel_bad_input.py", n, repeats, env={"JUPYTER_RING_STALL_TIMEOUT": "10"}, timeout=200)
    recs = records(result)
    assert sorted(int(line.split()[1]) for line in result.lines("RANK_OK")) == list(range(n))
    assert {r["case"] for r in recs} == set(cases)
    rows = []
    for case, (peer_type, fault_type, needle) in cases.items():
        mine = [r for r in recs if r["case"] == case]
        assert len(mine) == n * repeats, case
        for rec in mine:
            at_fault = rec["rank"] == (0 if case == "object type" else 1)
            want = fault_type if at_fault else peer_type
            assert rec["type"] == want, (case, rec)
            assert needle in rec["message"], (case, rec["message"])
            if rec["type"] == "PeerError":
                assert f"rank {0 if case == 'object type' else 1} could not join" in rec["message"]
            assert rec["seconds"] < REPORT_S, (case, rec)  # the stall timeout is 10 s: nobody waited for it
        times = [r["seconds"] for r in mine]
        rows.append((case, len(mine), statistics.median(times), max(times)))
    # figures for docs/reliability.md
    (tmp_path / "bad_input.json").write_text(json.dumps(rows))
    print(f"\n{n} ranks\n| case | raises (ranks x repeats) | median ms | max ms |")
    for case, count, med, worst in rows:
        print(f"| {case} | {count} | {med * 1e3:.1f} | {worst * 1e3:.1f} |")

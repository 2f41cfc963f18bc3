"""An α–β cost model of each allreduce algorithm, fitted to benchmarks/scaling.py's measured points.

    .venv/bin/python benchmarks/cost_model.py RESULTS.json [MORE.json ...] [--ranks 2,4,...,1024]
        [--alpha-us A --beta-gbps B]

Each algorithm's time for ``m`` bytes over ``n`` ranks is ``α·S + o·M + β·V``: ``S`` dependent
message steps (latencies one after the other), ``M`` messages a rank sends (per-message overhead:
the agreement's n−1 headers are here), ``V`` bytes a rank sends (table ``COSTS``). An algorithm
named ``…·log`` starts with the agreement relayed in ⌈log2 n⌉ steps (``JUPYTER_RING_AGREEMENT=log``:
``L`` steps and ``L`` messages instead of one step and n−1 messages); ``agree`` is the agreement
alone (``ring.barrier()``, scaling.py's ``barrier`` row). ``α``, ``o``
and ``β`` are fitted by least squares (relative error) to every measured point of every
algorithm at once, MPI_Allreduce's too (MPICH: recursive doubling up to 2 KiB a rank... modelled
as Rabenseifner's reduce-scatter + allgather, its choice for the sizes measured). Prints the
fit, each algorithm's median error, and the model's times at 2 … 1,024 ranks for 4 KiB, 1 MiB
and 64 MiB with the winner; ``--alpha-us``/``--beta-gbps`` replace the fitted network figures by
a LAN's (e.g. 10 GbE: ``--alpha-us 10 --beta-gbps 1.25``) for the projection.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable

import numpy as np

KiB, MiB = 1 << 10, 1 << 20


def _log(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0


def _fold(n: int) -> int:
    return 0 if n & (n - 1) == 0 else 2


# algorithm -> (S, M, V) for n ranks, m bytes (the agreement: one step, n−1 header messages)
COSTS: dict[str, Callable[[int, int], tuple[float, float, float]]] = {
    "agree": lambda n, m: (1, n - 1, 56 * (n - 1)),  # 56-byte headers (wire.HEADER_BYTES)
    "eager": lambda n, m: (1, n - 1, (n - 1) * m),
    "rd": lambda n, m: (1 + _log(n) + _fold(n), (n - 1) + _log(n) + _fold(n) / 2, (_log(n) + _fold(n) / 2) * m),
    "ring": lambda n, m: (1 + 2 * (n - 1), (n - 1) + 2 * (n - 1), 2 * (n - 1) / n * m),
    "mpi": lambda n, m: (2 * _log(n), 2 * _log(n), 2 * (n - 1) / n * m),
}
PER_HOST = 8  # ranks a host in the projection's hierarchy (set by --per-host)


def _hier(n: int, m: int) -> tuple[float, float, float]:
    """Ring reduce-scatter and allgather inside a host of L ranks, the slice m/L across hosts by
    recursive doubling (up to 256 KiB) or a ring."""
    per = min(PER_HOST, n)
    hosts = max(1, n // per)
    local = 2 * (per - 1)
    cross = COSTS["rd" if m / per <= 256 * KiB else "ring"](hosts, int(m / per)) if hosts > 1 else (1, 0, 0)
    return (local + cross[0], (n - 1) + local + cross[1] - (hosts - 1),
            2 * (per - 1) / per * m + cross[2])


COSTS["hier"] = _hier


def _relayed(direct: Callable[[int, int], tuple[float, float, float]]) -> Callable[[int, int], tuple[float, float, float]]:
    """``direct``'s costs with the agreement relayed: ⌈log2 n⌉ steps and messages instead of 1 and n−1."""
    def cost(n: int, m: int) -> tuple[float, float, float]:
        s, msgs, v = direct(n, m)
        return (s - 1 + _log(n), msgs - (n - 1) + _log(n), v)
    return cost


for _alg in ("agree", "rd", "ring", "hier"):
    COSTS[f"{_alg}·log"] = _relayed(COSTS[_alg])


def fit(points: list[tuple[str, int, int, float]]) -> np.ndarray:
    """(α, o, β) minimising the relative error of every (algorithm, n, m, seconds) point."""
    rows = np.array([COSTS[alg](n, m) for alg, n, m, _t in points], float)
    times = np.array([t for *_rest, t in points], float)
    weighted = rows / times[:, None]
    coef, *_ = np.linalg.lstsq(weighted, np.ones(len(times)), rcond=None)
    return np.maximum(coef, 0.0)


def predict(coef: np.ndarray, alg: str, n: int, m: int) -> float:
    return float(np.dot(coef, COSTS[alg](n, m)))


def load(paths: list[str]) -> list[tuple[str, int, int, float]]:
    """Measured points of scaling.py's JSON: forced algorithms and MPI_Allreduce."""
    points = []
    for path in paths:
        with open(path) as fh:
            for entry in json.load(fh):
                n, m = entry["ranks"], entry["bytes"]
                points.append(("mpi", n, m, entry["mpi_s"]))
                for alg in ("rd", "ring", "eager"):
                    if f"ring_s_{alg}" in entry and (alg != "eager" or m <= 64 * KiB):
                        points.append((alg, n, m, entry[f"ring_s_{alg}"]))
                # --agreements all,log: auto's choice under each agreement (the barrier row: the agreement alone)
                for agreement, suffix in (("all", ""), ("log", "·log")):
                    ran = entry.get(f"ran_auto, agreement {agreement}")
                    alg = "agree" if ran == "barrier" else ran
                    if alg in ("agree", "eager", "rd", "ring") and f"{alg}{suffix}" in COSTS:
                        points.append((f"{alg}{suffix}", n, m, entry[f"ring_s_auto, agreement {agreement}"]))
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--ranks", default=",".join(str(1 << k) for k in range(1, 11)))
    parser.add_argument("--alpha-us", type=float, help="a LAN's step latency for the projection (µs)")
    parser.add_argument("--beta-gbps", type=float, help="a LAN's bandwidth for the projection (GB/s)")
    parser.add_argument("--overhead-us", type=float, help="a message's overhead for the projection (µs)")
    parser.add_argument("--per-host", type=int, default=8, help="ranks a host in the hierarchy's projection")
    args = parser.parse_args()
    global PER_HOST
    PER_HOST = args.per_host
    points = load(args.results)
    coef = fit(points)
    print(f"fitted: α {coef[0] * 1e6:.1f} µs a step, o {coef[1] * 1e6:.1f} µs a message, "
          f"β {coef[2] * 1e9:.3f} ns a byte ({1 / coef[2] / 1e9 if coef[2] else float('inf'):.2f} GB/s)")
    print("\n| algorithm | points | median model ÷ measured | worst |\n|---|---|---|---|")
    for alg in COSTS:
        mine = [(n, m, t) for a, n, m, t in points if a == alg]
        if mine:
            ratios = [predict(coef, alg, n, m) / t for n, m, t in mine]
            print(f"| {alg} | {len(mine)} | {np.median(ratios):.2f} | {max(ratios, key=lambda r: abs(math.log(r))):.2f} |")
    if args.alpha_us is not None:
        coef[0] = args.alpha_us * 1e-6
    if args.beta_gbps is not None:
        coef[2] = 1 / (args.beta_gbps * 1e9)
    if args.overhead_us is not None:
        coef[1] = args.overhead_us * 1e-6
    print(f"\nprojection with α {coef[0] * 1e6:.1f} µs, o {coef[1] * 1e6:.1f} µs, β {coef[2] * 1e9:.3f} ns/B\n")
    algs = ("eager", "rd", "ring", "hier", "mpi")
    print("| ranks (ms) | " + " | ".join(f"{label} {alg}" for label in ("4 KiB", "1 MiB", "64 MiB") for alg in algs)
          + " | ours' best |")
    print("|---|" + "---|" * (3 * len(algs) + 1))
    for n in [int(r) for r in args.ranks.split(",")]:
        cells, winners = [], []
        for m in (4 * KiB, MiB, 64 * MiB):
            times = {alg: predict(coef, alg, n, m) for alg in algs}
            cells += [f"{times[alg] * 1e3:,.3g}" for alg in times]
            ours = {a: t for a, t in times.items() if a != "mpi" and (a != "eager" or m <= 64 * KiB)}
            winners.append(min(ours, key=ours.__getitem__))
        print(f"| {n} | " + " | ".join(cells) + " | " + ", ".join(winners) + " |")
    print("\n| ranks (ms) | agreement | agreement·log | 4 KiB best | 4 KiB rd·log | 1 MiB best | 1 MiB hier·log | 4 KiB mpi |")
    print("|---|" + "---|" * 7)
    for n in [int(r) for r in args.ranks.split(",")]:
        best = {m: min(predict(coef, a, n, m) for a in ("eager", "rd", "ring", "hier") if a != "eager" or m <= 64 * KiB)
                for m in (4 * KiB, MiB)}
        cells = [predict(coef, "agree", n, 0), predict(coef, "agree·log", n, 0), best[4 * KiB],
                 predict(coef, "rd·log", n, 4 * KiB), best[MiB], predict(coef, "hier·log", n, MiB),
                 predict(coef, "mpi", n, 4 * KiB)]
        print(f"| {n} | " + " | ".join(f"{t * 1e3:,.3g}" for t in cells) + " |")


if __name__ == "__main__":
    main()

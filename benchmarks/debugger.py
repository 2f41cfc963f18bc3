"""What a breakpoint on a rank costs (issue 35): its prompt's latency, and the CPU while it holds.

Usage: python benchmarks/debugger.py [--ranks 2] [--stops 8] [--commands 30] [--post-mortems 8] [--hold 10]

A real kernel (jupyter_client, ``allow_stdin``) with ``%ring start -n RANKS``, answering the kernel's
input requests as a front end does:

- breakpoint -> prompt: from rank 1's ``breakpoint()`` (its ``time.time()`` just before, read back
  with ``p``) to the input request reaching this client, ``--stops`` cells;
- a command's round trip: ``p 1`` sent -> the next input request here, ``--commands`` times;
- ``%ring debug`` -> prompt: from the request's sending to the post-mortem's input request here,
  after a cell that failed on rank 1, ``--post-mortems`` times (each ended with ``q``);
- CPU over ``--hold`` seconds while rank 1 sits at its prompt and rank 0 waits for it in an
  allreduce (every other rank, at more than 2 ranks): each engine process's and the kernel's
  (psutil, user + system), against the same processes idle between cells for as long; at more
  than 2 ranks the waiting ranks' highest share is shown.
"""

import argparse
import json
import os
import queue
import statistics
import tempfile
import time

import psutil
from jupyter_client.manager import start_new_kernel

CELL = """%%distributed
import time, numpy as np
if ring.rank() == 1:
    t_break = time.time()
    breakpoint()
    pass
total = ring.allreduce(np.ones(3), op=ring.Sum, name="held")
"""


class Session:
    def __init__(self):
        work = tempfile.mkdtemp(prefix="jupyter_ring_bench_debugger_")
        for var in ("IPYTHONDIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR"):
            os.environ[var] = os.path.join(work, var.lower())
        self.km, self.kc = start_new_kernel(kernel_name="python3")

    def run(self, code, timeout=120):
        msg_id = self.kc.execute(code, stop_on_error=False)
        deadline = time.monotonic() + timeout
        out = []
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            if msg["msg_type"] == "error":
                raise RuntimeError(msg["content"]["evalue"])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(out)
        raise TimeoutError(code)

    def next_prompt(self, timeout=30):
        """Wait for the next input request; (its prompt, time.time() it arrived)."""
        msg = self.kc.get_stdin_msg(timeout=timeout)
        return msg["content"]["prompt"], time.time()

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def t_break_of(session, msg_id, errors=None):
    """Wait for the cell's end; the time rank 1 printed with ``p t_break`` (the first large number).
    ``errors``: a list the cell's error (ename: evalue), if it raised, is appended to."""
    deadline = time.monotonic() + 60
    text = []
    while time.monotonic() < deadline:
        try:
            msg = session.kc.get_iopub_msg(timeout=0.1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        if msg["msg_type"] == "error" and errors is not None:
            errors.append(f"{msg['content']['ename']}: {msg['content']['evalue'][:200]}")
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    for line in "".join(text).splitlines():
        try:
            value = float(line)
        except ValueError:
            continue
        if value > 1e9:
            return value
    return float("nan")


def post_mortem_latencies(session, times):
    """Seconds from sending ``%ring debug`` to its prompt here, after a cell failed on rank 1."""
    msg_id = session.kc.execute("%%distributed\nif ring.rank() == 1:\n    raise ValueError('x')",
                                stop_on_error=False)
    t_break_of(session, msg_id)  # waits for the cell's end
    out = []
    for _ in range(times):
        sent = time.time()
        msg_id = session.kc.execute("%ring debug", stop_on_error=False, allow_stdin=True)
        _, arrived = session.next_prompt()
        out.append(arrived - sent)
        session.kc.input("q")
        t_break_of(session, msg_id)
    return out


def cpu(procs):
    return [sum(p.cpu_times()[:2]) for p in procs]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stops", type=int, default=8)
    parser.add_argument("--commands", type=int, default=30)
    parser.add_argument("--post-mortems", type=int, default=8)
    parser.add_argument("--hold", type=float, default=10.0)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    session = Session()
    try:
        session.run("%load_ext jupyter_ring")
        session.run(f"%ring start -n {args.ranks}")
        pids = json.loads(session.run(
            "import json\nc = get_ipython().magics_manager.registry['RingMagics'].cluster\n"
            "print(json.dumps([row['pid'] for row in c.ranks]))").strip().splitlines()[-1])
        procs = [psutil.Process(pid) for pid in pids] + [psutil.Process(session.km.provisioner.process.pid)]
        names = ["rank 0 (waiting)", "rank 1 (at the prompt)"] + [f"rank {r} (waiting)" for r in range(2, len(pids))] \
            + ["kernel (in input())"]

        before = cpu(procs)
        time.sleep(args.hold)
        idle = [(b - a) / args.hold for a, b in zip(before, cpu(procs))]

        stops = []
        for _ in range(args.stops):
            msg_id = session.kc.execute(CELL, stop_on_error=False, allow_stdin=True)
            _, arrived = session.next_prompt()
            session.kc.input("p t_break")
            session.next_prompt()
            session.kc.input("c")
            stops.append(arrived - t_break_of(session, msg_id))

        msg_id = session.kc.execute(CELL, stop_on_error=False, allow_stdin=True)
        session.next_prompt()
        trips = []
        for _ in range(args.commands):
            sent = time.perf_counter()
            session.kc.input("p 1")
            session.next_prompt()
            trips.append(time.perf_counter() - sent)
        before = cpu(procs)  # the last prompt is not answered: rank 1 is held there, rank 0 waits
        time.sleep(args.hold)
        held = [(b - a) / args.hold for a, b in zip(before, cpu(procs))]
        session.kc.input("c")
        held_errors = []
        t_break_of(session, msg_id, held_errors)  # the held cell ends well: no stall error
        post_mortems = post_mortem_latencies(session, args.post_mortems)
        print(f"breakpoint -> prompt here, {len(stops)} times: median "
              f"{statistics.median(stops) * 1e3:.0f} ms, max {max(stops) * 1e3:.0f} ms")
        print(f"a command's round trip ('p 1'), {len(trips)} times: median "
              f"{statistics.median(trips) * 1e3:.1f} ms, max {max(trips) * 1e3:.1f} ms")
        print(f"%ring debug -> prompt here, {len(post_mortems)} times: median "
              f"{statistics.median(post_mortems) * 1e3:.0f} ms, max {max(post_mortems) * 1e3:.0f} ms")
        print(f"CPU over {args.hold:g} s, share of one core (idle cluster -> rank 1 held at its prompt):")
        for name, a, b in zip(names, idle, held):
            print(f"  {name:24s} {a:7.2%} -> {b:7.2%}")
        waiting = [b for name, b in zip(names, held) if "(waiting)" in name]
        print(f"  the {len(waiting)} waiting ranks: at most {max(waiting):.2%} of a core each")
        print(f"the cell held {args.hold:g} s at the prompt then continued: "
              f"{'; '.join(held_errors) or 'ended without an error (no StallError)'}")
        print(f"load average: {os.getloadavg()[0]:.1f}")
    finally:
        session.close()


if __name__ == "__main__":
    main()

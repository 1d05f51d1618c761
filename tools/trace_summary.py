"""Where the host time of a profiled sync goes: Python functions by inclusive time.

Reads a Chrome trace written by ``bench_sync.py --profile`` (``trace.json.gz``, recorded
with Python stacks) and prints the functions of our packages by total inclusive time
with their call counts; torch's own frames are left out. Per-call Python work that
scales with the number of tensors shows up here long before it shows in kernel tables.

``--phases`` lists per ``dte.*`` range on the device (detect, encode, send) its wall
time, the device time of the kernels, copies and fills started in it, and those by name:
where a phase's device time goes.

``--gaps`` lists instead the stretches where the GPU sat idle (no kernel, copy or memset)
for longer than ``--min-gap-us``, each with the innermost of our Python functions that
covered most of it: the host work a sync waits on, from the start of its first ``dte.*``
range (the profiler's own set-up lands in the first launch it sees, ~2.5 ms on an H200).
A trace recorded without Python stacks (``profile_delta_timeline``: its idle time is
close to an unprofiled run's) names the ``dte.*`` ranges and torch ops instead.

    python tools/trace_summary.py OUT/profile_delta/trace.json.gz --top 40
    python tools/trace_summary.py OUT/profile_delta/trace.json.gz --gaps
    python tools/trace_summary.py OUT/profile_delta/trace.json.gz --phases
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

_OURS = ("dte_", "areal_dte")
_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def _events(trace: Path) -> list[dict]:
    with gzip.open(trace, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def summary(trace: Path, top: int) -> list[tuple[float, int, str]]:
    total, calls = collections.Counter(), collections.Counter()
    for event in _events(trace):
        if event.get("cat") == "python_function":
            total[event["name"]] += event["dur"]
            calls[event["name"]] += 1
    rows = [(us / 1e3, calls[name], name) for name, us in total.most_common()
            if "torch/" not in name]
    return rows[:top]


def gaps(trace: Path, min_gap_us: float) -> list[tuple[float, list[str]]]:
    """Idle stretches of the device, in order, with up to three of our Python functions
    (innermost first) that each covered at least 30 % of the stretch."""
    events = _events(trace)
    device = sorted((e for e in events if e.get("cat") in _DEVICE), key=lambda e: e["ts"])
    ours = [e for e in events if e.get("cat") == "python_function"
            and any(tag in e["name"] for tag in _OURS)]
    if not ours:  # no Python stacks recorded: the sync's ranges and torch's ops
        ours = [e for e in events if e.get("cat") in ("user_annotation", "cpu_op")]
    begun = [e["ts"] for e in events
             if e.get("cat") == "user_annotation" and e["name"].startswith("dte.")]
    if begun:  # from the sync's first range to its first device op: the host's front
        device.insert(0, {"ts": min(begun), "dur": 0})
    rows = []
    for before, after in zip(device, device[1:]):
        start, end = before["ts"] + before["dur"], after["ts"]
        if end - start <= min_gap_us:
            continue
        covering = sorted((e["dur"], e["name"]) for e in ours
                          if min(end, e["ts"] + e["dur"]) - max(start, e["ts"])
                          > 0.3 * (end - start))
        rows.append(((end - start) / 1e3, [name.split("src/")[-1] for _, name in covering[:3]]))
    return rows


def phases(trace: Path, top: int) -> list[tuple[str, float, float, list[tuple[float, int, str]]]]:
    """Per ``dte.*`` device range, in order: its name, wall ms, device ms of the work
    started in it, and that work by name (ms, count, name), largest first."""
    events = _events(trace)
    device = [e for e in events if e.get("cat") in _DEVICE]
    rows = []
    for phase in sorted((e for e in events if e.get("cat") == "gpu_user_annotation"
                         and e["name"].startswith("dte.")), key=lambda e: e["ts"]):
        start, end = phase["ts"], phase["ts"] + phase["dur"]
        total, calls = collections.Counter(), collections.Counter()
        for e in device:
            if start <= e["ts"] < end:
                total[e["name"]] += e["dur"]
                calls[e["name"]] += 1
        rows.append((phase["name"], phase["dur"] / 1e3, sum(total.values()) / 1e3,
                     [(us / 1e3, calls[name], name) for name, us in total.most_common(top)]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--gaps", action="store_true", help="idle device stretches instead")
    p.add_argument("--phases", action="store_true",
                   help="device time per dte.* range and kernel instead")
    p.add_argument("--min-gap-us", type=float, default=200.0)
    args = p.parse_args()
    if args.phases:
        for name, wall, busy, kernels in phases(args.trace, args.top):
            print(f"{name}: wall {wall:.2f} ms, device {busy:.2f} ms")
            for ms, count, kernel in kernels:
                print(f"{ms:9.3f} ms {count:5d}  {kernel[:100]}")
        return
    if args.gaps:
        rows = gaps(args.trace, args.min_gap_us)
        print(f"{sum(ms for ms, _ in rows):9.1f} ms idle in {len(rows)} gaps")
        for ms, names in rows:
            print(f"{ms:9.2f} ms  {' | '.join(names)}")
        return
    for ms, count, name in summary(args.trace, args.top):
        print(f"{ms:9.1f} ms {count:7d}  {name}")


if __name__ == "__main__":
    main()

"""Where the host time of a profiled sync goes: Python functions by inclusive time.

Reads a Chrome trace written by ``bench_sync.py --profile`` (``trace.json.gz``, recorded
with Python stacks) and prints the functions of our packages by total inclusive time
with their call counts; torch's own frames are left out. Per-call Python work that
scales with the number of tensors shows up here long before it shows in kernel tables.

    python tools/trace_summary.py OUT/profile_delta/trace.json.gz --top 40
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path


def summary(trace: Path, top: int) -> list[tuple[float, int, str]]:
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    total, calls = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == "python_function":
            total[event["name"]] += event["dur"]
            calls[event["name"]] += 1
    rows = [(us / 1e3, calls[name], name) for name, us in total.most_common()
            if "torch/" not in name]
    return rows[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    for ms, count, name in summary(args.trace, args.top):
        print(f"{ms:9.1f} ms {count:7d}  {name}")


if __name__ == "__main__":
    main()

"""Show what is live at a bench case's GPU memory peak, by the mlite source line that allocated it.

Where a bench case's peak GPU memory goes: run a few steps of the case (as `mlite bench` does), record
the allocator's history over one more, replay it to find the moment of the peak, and list what was live
then, grouped by the innermost mlite source line that allocated it.

    python3 scripts/memory_peak.py dsv4-flash-4l-4k [--set KEY=VALUE] [--rows 30]
"""

from __future__ import annotations

import argparse
import collections

import torch

from mlite import bench


def _where(frames) -> str:
    ours = [f for f in frames if "/mlite/" in f["filename"] and "memory_peak" not in f["filename"]]
    if not ours:
        f = frames[0] if frames else {"filename": "?", "line": 0, "name": "?"}
        return f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}"
    inner = ours[0]
    return f"{inner['filename'].split('/mlite/')[-1]}:{inner['line']} {inner['name']}"


def peak_report(name: str, overrides: list[str], rows: int) -> None:
    step, _runtime, _last = bench.case_step(name, overrides=overrides)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    # what exists before the step (parameters, optimizer state): by the line that allocated it is lost,
    # so record from the start of a fresh history only the step's own allocations
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    live: dict[int, tuple[int, str]] = {}
    total, best, best_live = 0, -1, {}
    for trace in snap["device_traces"]:
        for event in trace:
            if event["action"] == "alloc":
                live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
                total += event["size"]
                if total > best:
                    best, best_live = total, dict(live)
            elif event["action"] == "free_completed" and event["addr"] in live:
                total -= live.pop(event["addr"])[0]
    groups: collections.Counter = collections.Counter()
    for size, where in best_live.values():
        groups[where] += size
    gb = 1e9
    print(f"{name}: peak {peak / gb:.2f} GB; before the step {base / gb:.2f} GB (parameters, optimizer "
          f"state, anything kept); the step's own allocations at its peak {best / gb:.2f} GB")
    for where, size in groups.most_common(rows):
        print(f"  {size / gb:7.3f} GB  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    for name in args.cases:
        peak_report(name, args.overrides, args.rows)


if __name__ == "__main__":
    main()

"""Where a step's compute stream idles, read from a Chrome trace of `scripts/profile_step.py --trace`.

Each gap between two kernels on the compute stream (the stream with the most non-NCCL kernel time) is
put down to one of two causes, from the launch of the kernel that ends it:
- **host late**: that kernel was launched after the gap began, so the GPU waited for the host; the gap
  is charged to the CPU ops open around the launch (on the launching thread: the main thread, or
  autograd's for the backward);
- **waited**: the kernel was queued before the gap began and waited on another stream (a collective, a
  copy) or an event.

    python3 scripts/trace_gaps.py trace.json [--min-us 20] [--rows 20]
"""

from __future__ import annotations

import argparse
import collections
import json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--min-us", type=float, default=20.0, help="ignore gaps shorter than this")
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    cpu_ops = collections.defaultdict(list)  # tid -> ops
    for e in events:
        if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and e.get("ph") == "X":
            cpu_ops[e["tid"]].append(e)

    busy = collections.Counter()
    for k in kernels:
        if "nccl" not in k["name"].lower():
            busy[k["args"].get("stream")] += k["dur"]
    stream = busy.most_common(1)[0][0]
    compute = sorted((k for k in kernels if k["args"].get("stream") == stream), key=lambda k: k["ts"])
    span = compute[-1]["ts"] + compute[-1]["dur"] - compute[0]["ts"]
    print(f"compute stream {stream}: {len(compute)} kernels, {sum(k['dur'] for k in compute) / 1e3:.1f} ms "
          f"busy of {span / 1e3:.1f} ms")

    late = collections.Counter()
    waited = collections.Counter()
    late_total = waited_total = 0.0
    for prev, kernel in zip(compute, compute[1:]):
        gap_start = prev["ts"] + prev["dur"]
        gap = kernel["ts"] - gap_start
        if gap < args.min_us:
            continue
        launch = launches.get(kernel["args"].get("correlation"))
        if launch is not None and launch["ts"] > gap_start:
            late_total += gap
            # the CPU ops open on the launching thread at the launch, outermost first
            open_ops = [op for op in cpu_ops[launch["tid"]]
                        if op["ts"] <= launch["ts"] <= op["ts"] + op["dur"]]
            open_ops.sort(key=lambda op: (op["ts"], -op["dur"]))
            names = [op["name"] for op in open_ops if not op["name"].startswith("ProfilerStep")]
            late[" > ".join(names[:3])[:160] or "(no op open)"] += gap
        else:
            waited_total += gap
            waited[kernel["name"][:100]] += gap
    print(f"gaps >= {args.min_us:g} us: host late {late_total / 1e3:.1f} ms, "
          f"waited {waited_total / 1e3:.1f} ms")
    print("\nhost late, by the ops open at the late launch (outermost first):")
    for name, us in late.most_common(args.rows):
        print(f"  {us / 1e3:8.2f} ms  {name}")
    print("\nwaited, by the kernel that waited:")
    for name, us in waited.most_common(args.rows):
        print(f"  {us / 1e3:8.2f} ms  {name}")


if __name__ == "__main__":
    main()

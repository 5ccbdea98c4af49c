"""Speed of ``mooncakectl simulate`` on a trace, with decode runs vs one event a step.

    python tools/bench_simulate.py --trace ../shared/data/traces/conversation_trace.jsonl
    python tools/bench_simulate.py --trace FILE --count 3000 --prefill 8 --decode 8

Both modes place every request alike; on the unit tests' fixtures their
times agree too, and on the full conversation trace a few requests' times
differ (the summary lines show how far). The ratio is what coalescing
decode-only steps into runs saves. CPU seconds are the
process's own (``time.process_time``), so a busy machine slows the wall
clock but not them.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from mooncakectl.bench.trace import TraceSlice, read_trace
from mooncakectl.simulate.cluster import Shape, SimConfig, simulate
from mooncakectl.simulate.costs import preset_node
from mooncakectl.simulate.results import sim_summary
from mooncaked.cluster.placement import ConductorParams, EarlyReject, Policy
from mooncaked.cluster.slo import Slo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="Mooncake trace (JSON lines)")
    p.add_argument("--count", type=int, help="records to replay (default: all)")
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--preset", default="llama3-70b-8xa800")
    p.add_argument("--policy", default="conductor", choices=[v.value for v in Policy])
    p.add_argument("--skip-baseline", action="store_true", help="time the runs mode only")
    args = p.parse_args()
    records = read_trace(args.trace, TraceSlice(count=args.count))
    cfg = SimConfig(
        Shape(args.prefill, args.decode),
        preset_node(args.preset),
        params=ConductorParams(policy=Policy(args.policy), early_reject=EarlyReject.PREDICTED),
        slo=Slo(30.0, 0.1),
    )
    modes = [("decode runs", cfg)]
    if not args.skip_baseline:
        modes.append(("event per step", replace(cfg, coalesce_decode=False)))
    cpu: dict[str, float] = {}
    print(f"{len(records)} requests on {cfg.shape.label()} ({args.preset}, {args.policy})")
    for name, c in modes:
        t0, w0 = time.process_time(), time.perf_counter()
        res = simulate(c, records)
        cpu[name] = time.process_time() - t0
        wall = time.perf_counter() - w0
        s = sim_summary(res)
        print(
            f"  {name:15} cpu {cpu[name]:6.1f} s  wall {wall:6.1f} s  events {res.num_events:9d}"
            f"  mean TTFT {s.ttft_ms['mean']:.1f} ms  SLO attainment {100 * s.slo_attainment:.2f}%"
        )
    if len(cpu) == 2:
        print(
            f"  event per step / decode runs, cpu: {cpu['event per step'] / cpu['decode runs']:.2f}x"
        )


if __name__ == "__main__":
    main()

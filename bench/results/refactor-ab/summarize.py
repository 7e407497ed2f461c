"""Summarise the issue-27 A/B JSONs: medians and ranges per side."""
import json, statistics, sys, pathlib
d = pathlib.Path(sys.argv[1])
def rng(xs): return f"median {statistics.median(xs):.4g} (range {min(xs):.4g}-{max(xs):.4g}, n={len(xs)})"
for side in ("before", "after"):
    ps = sorted(d.glob(f"persist-{side}-*.json"))
    if ps:
        r = [json.loads(p.read_text())["results"][0] for p in ps]
        print(f"persist {side}: pccheck s {rng([x['pccheck_s'] for x in r])}; raw_odirect s {rng([x['raw_odirect_s'] for x in r])}; "
              f"pccheck GB/s / raw GB/s {rng([x['pccheck_over_raw_odirect'] for x in r])}")
    os_ = sorted(d.glob(f"overhead-{side}-*.json"))
    if os_:
        cells = [c for p in os_ for c in json.loads(p.read_text())["emulated"]["cells"]]
        for iv in sorted({c["interval"] for c in cells}):
            for sysm in ("none", "pccheck_N2"):
                cs = [c for c in cells if c["interval"] == iv and c["system"] == sysm]
                if cs:
                    print(f"overhead {side} interval {iv} {sysm}: it/s {rng([c['it_per_s'] for c in cs])}; slowdown {rng([c['slowdown'] for c in cs])}")

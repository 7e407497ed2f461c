"""The tiers benchmark's figure: ``python -m bench.tiers_plot RESULT.json [OUT.png]`` (bench.tiers
draws it too, beside its JSON).

Left: the loop's slowdown per configuration at interval 1 (``slowdown``; the memory tier's target
as a line). Right: restore times (``restore_s``): after a process crash from memory and from disk,
after a node loss from the peer, the remote tier and DCP, and the raw gloo link.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from bench.harness.common import pyplot, save_figure

__all__ = ["plot", "main"]

RESTORES = (("crash_memory_s", "crash: memory"), ("crash_disk_s", "crash: disk"),
            ("node_loss_peer_s", "node loss: peer"), ("node_loss_remote_s", "node loss: remote"),
            ("node_loss_dcp_s", "node loss: DCP load"), ("raw_link_s", "raw gloo link"))


def plot(res: Mapping[str, Any], path: Path) -> bool:
    """Draws ``res`` (bench.tiers' JSON) into ``path``; False when there is nothing to draw (the
    kill trials alone) or matplotlib is missing."""
    slow, rest = res.get("slowdown") or {}, res.get("restore_s") or {}
    plt = pyplot(path)
    if plt is None or not slow:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(slow)
    left.barh(names, [slow[c] for c in names], color=["tab:gray" if c == "none" else "tab:blue" for c in names])
    left.axvline(1.05, color="tab:red", linestyle="--", linewidth=1, label="target 1.05x (memory)")
    left.set_xlabel("loop slowdown vs no checkpoint (every iteration)")
    left.set_xlim(0.8, max(max(slow.values()) * 1.05, 1.2))
    left.invert_yaxis()
    left.legend(fontsize=8, loc="lower right")
    shown = [(label, rest[key]) for key, label in RESTORES if rest.get(key) is not None]
    right.barh([lb for lb, _ in shown], [v for _, v in shown], color="tab:green")
    right.set_xlabel("restore time (s)")
    right.invert_yaxis()
    mib = res.get("size_bytes_per_rank", 0) / 2**20
    fig.suptitle(f"memory tier: 2 nodes x 1 rank, {mib:.0f} MiB per rank, t = {res.get('iter_time_s')} s "
                 f"(GPU emulated)", fontsize=9)
    save_figure(fig, path)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m bench.tiers_plot RESULT.json [OUT.png]", file=sys.stderr)
        return 2
    src = Path(args[0])
    out = Path(args[1]) if len(args) == 2 else src.with_suffix(".png")
    if not plot(json.loads(src.read_text(encoding="utf-8")), out):
        print(f"nothing drawn for {src} (no loop configurations, or no matplotlib)", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

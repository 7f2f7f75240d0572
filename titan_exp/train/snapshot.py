"""What a CUDA rank held at its allocated peak, read from the allocator's memory snapshot
(`profiling.enable_memory_snapshot`: <run dir>/memory_snapshot/rank<r>_memory_snapshot.pickle).

The snapshot keeps the blocks live when it was taken and the allocator's last actions
(`device_traces`). Replaying those actions backwards from the live blocks gives what was live when
the recorded window opened; replaying them forwards, the allocated total after each action, its
peak, and the blocks live there, grouped by where they were allocated: the innermost frame of the
project's code (`titan_exp/`), else the innermost Python frame; "backward" where an allocation had
no Python frame (autograd's engine runs the backward in C++); "before the window" for a block the
trace never saw allocated and whose frames were not recorded (the parameters, made before
`profiling.enable_memory_snapshot` starts recording).

    python -m titan_exp.train.snapshot rank0_memory_snapshot.pickle [--top 20]
"""

from __future__ import annotations

import argparse
import json
import pickle
from collections import defaultdict
from pathlib import Path

GIB = 2**30
LIVE = ("active_allocated", "active_awaiting_free")


def site(frames: list[dict]) -> str:
    """Where a block was allocated, in one line (frames are innermost first)."""
    if not frames:
        return "backward (no Python frame)"
    own = next((f for f in frames if "titan_exp/" in f["filename"]), None)
    inner = frames[0]
    where = f"{inner['filename'].rsplit('/', 1)[-1]}:{inner['line']} {inner['name']}"
    if own is None or own is inner:
        return where
    return f"{own['filename'].split('titan_exp/', 1)[1]}:{own['line']} {own['name']} <- {where}"


def peak(snapshot: dict, device: int = 0, top: int = 20) -> dict:
    """The allocated peak in the snapshot's recorded window, and what was live there by site."""
    live_end = {b["address"]: (b["size"], b.get("frames", []))
                for seg in snapshot["segments"] if seg.get("device", device) == device
                for b in _blocks(seg) if b["state"] in LIVE}
    events = [e for e in snapshot["device_traces"][device] if e["action"] in ("alloc", "free_completed")]
    # Backwards: an alloc in the window was not live before it; a freed block was.
    live = {a: s for a, (s, _) in live_end.items()}
    for e in reversed(events):
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        else:
            live[e["addr"]] = e["size"]
    # Their frames where the snapshot kept them; none: made before recording began.
    start = {a: (s, live_end.get(a, (0, None))[1] or None) for a, s in live.items()}
    total = best = sum(s for s, _ in start.values())
    at = -1
    current = dict(start)
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            current[e["addr"]] = (e["size"], e.get("frames", []))
            total += e["size"]
            if total > best:
                best, at = total, i
        else:
            size, _ = current.pop(e["addr"], (e["size"], None))
            total -= size
    current = dict(start)
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            current[e["addr"]] = (e["size"], e.get("frames", []))
        else:
            current.pop(e["addr"], None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in current.values():
        g = groups["before the window" if frames is None else site(frames)]
        g[0] += size
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"peak_allocated_gib": best / GIB, "window_start_gib": sum(s for s, _ in start.values()) / GIB,
            "end_gib": sum(s for s, _ in live_end.values()) / GIB, "actions": len(events),
            "peak_at_action": at, "by_site": [{"site": k, "gib": round(v[0] / GIB, 4), "blocks": v[1]}
                                             for k, v in ranked[:top]],
            "other_gib": round(sum(v[0] for _, v in ranked[top:]) / GIB, 4)}


def _blocks(seg: dict) -> list[dict]:
    """A segment's blocks with their addresses (a snapshot gives sizes in order from the segment's)."""
    out, address = [], seg["address"]
    for b in seg["blocks"]:
        out.append({**b, "address": b.get("address", address)})
        address += b["size"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot", type=Path)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(peak(pickle.loads(args.snapshot.read_bytes()), args.device, args.top), indent=1))


if __name__ == "__main__":
    main()

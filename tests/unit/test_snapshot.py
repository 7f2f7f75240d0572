"""titan_exp.train.snapshot on a snapshot in the form torch.cuda.memory._snapshot() gives (its
`segments` with their blocks, `device_traces` with the allocator's actions): a CUDA rank's file is
read on a GPU (BENCHMARKS.md, the 3B's peaks); here, the replay's arithmetic."""

from __future__ import annotations

import pickle

from titan_exp.train.snapshot import GIB, main, peak


def frames(*names: str) -> list[dict]:
    """Innermost first, as the allocator records them."""
    return [{"filename": f"/site/{n.split(':')[0]}", "line": 1, "name": n.split(":")[1]} for n in names]


def snapshot() -> dict:
    # One segment of 8 GiB: the parameters (2 GiB, allocated before recording began, so the trace
    # never saw them) live at the end, the rest free.
    segments = [{"device": 0, "address": 0, "total_size": 8 * GIB, "blocks": [
        {"size": 2 * GIB, "state": "active_allocated", "frames": []},
        {"size": 6 * GIB, "state": "inactive", "frames": []}]}]
    act = frames("torch/nn/functional.py:linear", "titan_exp/models/llama.py:forward")
    trace = [
        {"action": "free_completed", "addr": 7 * GIB, "size": GIB, "frames": []},  # made before the window
        {"action": "alloc", "addr": 2 * GIB, "size": 3 * GIB, "frames": act},
        {"action": "alloc", "addr": 5 * GIB, "size": GIB, "frames": []},  # the backward: no Python frame
        {"action": "free_requested", "addr": 2 * GIB, "size": 3 * GIB, "frames": []},
        {"action": "free_completed", "addr": 2 * GIB, "size": 3 * GIB, "frames": []},
        {"action": "free_completed", "addr": 5 * GIB, "size": GIB, "frames": []},
        {"action": "alloc", "addr": 2 * GIB, "size": GIB, "frames": act},
        {"action": "free_completed", "addr": 2 * GIB, "size": GIB, "frames": []},
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_the_peak_and_what_was_live_there_by_site():
    """2 GiB of parameters and 1 GiB made before the window, then 3 GiB of activations and 1 GiB of
    the backward's: 6 GiB at the second allocation, not at the later, smaller one."""
    got = peak(snapshot())
    assert got["window_start_gib"] == 3 and got["end_gib"] == 2 and got["peak_allocated_gib"] == 6
    assert got["peak_at_action"] == 2  # of the window's allocs and completed frees
    assert {g["site"]: g["gib"] for g in got["by_site"]} == {
        "models/llama.py:1 forward <- functional.py:1 linear": 3, "before the window": 2,
        "backward (no Python frame)": 1}


def test_the_command_reads_a_pickled_snapshot(tmp_path, capsys):
    path = tmp_path / "rank0_memory_snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot()))
    main([str(path), "--top", "1"])
    out = capsys.readouterr().out
    assert '"peak_allocated_gib": 6.0' in out and '"other_gib": 3.0' in out  # the two other sites

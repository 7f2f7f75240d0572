"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

    store.py    the folder on disk: step dirs, the completeness marker with checksums, the safe reader
    states.py   what a checkpoint holds: one Stateful adapter per part (model, optimizer, ...)
    manager.py  during training: what a run loads, the launcher's preflight, the Checkpointer
    export.py   a checkpoint's model as one file (`python -m titan_exp.checkpoint export RUN`)
"""

from titan_exp.checkpoint.export import export
from titan_exp.checkpoint.manager import Checkpointer, load_source, preflight
from titan_exp.checkpoint.states import PARTS
from titan_exp.checkpoint.store import (
    EXPORT_DTYPES,
    EXPORT_FORMATS,
    MARKER,
    CheckpointError,
    checkpoint_folder,
    complete_steps,
    incomplete_dirs,
    read_marker,
    read_metadata,
    step_dir,
    verify,
)

__all__ = ["EXPORT_DTYPES", "EXPORT_FORMATS", "MARKER", "PARTS", "CheckpointError", "Checkpointer", "checkpoint_folder",
           "complete_steps", "export", "incomplete_dirs", "load_source", "preflight", "read_marker", "read_metadata",
           "step_dir", "verify"]

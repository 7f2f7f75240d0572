"""A rank entry for tests/test_launch.py (`run_local(..., entry="tests.rank_probe")`): what a rank's
process sees from inside, written to RUN_DIR/probe-RANK.json."""

import ctypes
import json
import os
import sys
from pathlib import Path

import torch


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mmaps(size: int) -> bool:
    """Whether glibc's malloc serves `size` bytes with its own mmap, just after freeing a larger
    mmapped block: under glibc's dynamic threshold that free raised the threshold above `size`
    (so no), under a fixed one below `size` (MALLOC_MMAP_THRESHOLD_, cluster.cpu_malloc_mmap_threshold_mib) it
    did not."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = Mallinfo2
    libc.free(libc.malloc(size + (4 << 20)))
    before = libc.mallinfo2().hblks
    block = libc.malloc(size)
    mapped = libc.mallinfo2().hblks > before
    libc.free(block)
    return mapped


if __name__ == "__main__":
    from titan_exp.cluster.forkserver import RANK_LIBRARIES

    preloaded = [name for name in RANK_LIBRARIES if name in sys.modules]  # before this rank imports any
    import datasets.config

    keys = ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "PYTHONPATH", "TITAN_EXP_PROBE",
            "PYTORCH_TITAN_EXP_PROBE")
    record = {"argv": sys.argv[1:], "threads": torch.get_num_threads(), "parent": os.getppid(),
              "name": Path("/proc/self/comm").read_text().strip(), "preloaded": preloaded,
              "hf_datasets_cache": str(datasets.config.HF_DATASETS_CACHE),  # as datasets read it on import
              "mmaps_17_mib": mmaps(17 << 20), **{k: os.environ.get(k) for k in keys}}
    Path(sys.argv[1], f"probe-{os.environ['RANK']}.json").write_text(json.dumps(record))

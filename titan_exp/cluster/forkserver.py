"""Local CPU ranks forked from a server that imported them once.

A rank started as `python -m titan_exp.train.rank RUN_DIR` spends about 5 s of a 2-core machine
importing torch, DTensor, DCP and dynamo before it does anything, and a launch of N ranks pays that
N times at once. Here the launcher's process starts Python's forkserver once, with the rank's
modules imported (`ready`), and each launch's ranks fork from it in a fraction of a second: every
launch after the first in one process (a Hydra sweep, autotune's trials, a test session) pays no
import at all. The server also imports the libraries every rank imports where it first needs them
(RANK_LIBRARIES): `datasets` alone took 0.8 s of each rank's start on a 2-core machine. A forked
rank is then made what the fresh process would have been (`start_rank`): the launcher's environment
at this launch, its share of threads and its malloc threshold (which a fresh process takes from the
environment at start), and ENTRY run as `__main__`.

What a fork cannot give: the variables torch, the OpenMP runtime, glibc's malloc and the Hugging Face
libraries read when they are imported or loaded (IMPORT_TIME) hold their values from the server's
start. A launch where one of them has changed since starts fresh processes, as does a launch on GPUs
(run_local): a server that never touches CUDA is safe to fork from, and that has not been checked on a
GPU yet.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import sys
import time
import traceback
from typing import Optional

from titan_exp import signals
from titan_exp.cluster.env import TRAIN, checkout_path, scoped_env

logger = logging.getLogger(__name__)

# Imported by every rank, not at the top of its modules (the launcher need not pay for them):
# data.sources.open_dataset's `datasets`, data.corpus's `tokenizers`, targets.build's `hydra.utils`.
RANK_LIBRARIES = ("datasets", "tokenizers", "hydra.utils")
# Read when a library is imported or loaded: torch's logging, dynamo's and inductor's configuration,
# the OpenMP and MKL runtimes, glibc's malloc; the Hugging Face caches, offline switches and
# frameworks that a rank's data depends on (datasets.config, huggingface_hub.constants: HF_HOME
# defaults under XDG_CACHE_HOME). Not their download settings, which no rank uses, and which
# libraries set in the launcher's process: importing lm_eval (validating eval.tasks) sets
# HF_XET_HIGH_PERFORMANCE, and HF_HUB_ENABLE_HF_TRANSFER where hf_transfer is installed.
# TORCHINDUCTOR_CACHE_DIR is read when compiling (titan_exp's compile cache sets it in the rank:
# titan_exp.parallel.compile).
IMPORT_TIME = ("TORCH_", "TORCHDYNAMO_", "TORCHINDUCTOR_", "PYTORCH_", "OMP_", "MKL_", "GOMP_", "MALLOC_",
               "HF_HOME", "HF_DATASETS_", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_MODULES_CACHE", "HF_ASSETS_CACHE",
               "HUGGINGFACE_HUB_CACHE", "HUGGINGFACE_ASSETS_CACHE", "XDG_CACHE_HOME", "USE_TORCH", "USE_TF", "USE_JAX")
READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR",)
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter: what MALLOC_MMAP_THRESHOLD_ sets at a process's start
PR_SET_NAME = 15  # prctl's: the process's name (comm)
PEER_FIRST_S = 1.0  # a raising rank's wait before it exits (start_rank): 10 of the agent's 0.1 s polls

# The environment this module was imported in: in the launcher, its own; in a forked rank, the
# server's at its start (start_rank tells the elastic agent's variables from it).
IMPORTED_IN = dict(os.environ)
_server_started_with: Optional[dict[str, str]] = None  # the launcher's read_on_import() when it started the server


def read_on_import(env) -> dict[str, str]:
    """The variables of `env` that a library reads on import or load (IMPORT_TIME)."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in READ_WHEN_USED}


def ready() -> bool:
    """Whether this launch's ranks can fork from the server: started at this process's first call
    (outside any launch's environment), and used while no IMPORT_TIME variable has changed since."""
    global _server_started_with
    if _server_started_with is None:
        _server_started_with = read_on_import(os.environ)
        multiprocessing.get_context("forkserver").set_forkserver_preload([__name__, TRAIN, *RANK_LIBRARIES])
    now, then = read_on_import(os.environ), _server_started_with
    changed = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
    if changed:
        logger.info("ranks start as fresh processes: %s changed since their forkserver started", ", ".join(changed))
        return False
    with scoped_env(**checkout_path()):  # the launcher's titan_exp: Python 3.11's server ignores its sys.path
        multiprocessing.forkserver.ensure_running()
    return True


def start_rank(entry: str, path: str, env: dict[str, str]) -> None:
    """A rank forked from the server, made what `python -m ENTRY PATH` starts: in `env` (the
    launcher's at this launch) with the variables torch's elastic agent set for this rank, then
    ENTRY run as `__main__`, ending with the exit code, traceback or signal a fresh process would;
    one that stopped for a stop signal ends with EXIT_INTERRUPTED (`finish`)."""
    agent = {k: v for k, v in os.environ.items() if IMPORTED_IN.get(k) != v}
    os.environ.clear()
    os.environ.update({**env, **agent})
    import torch

    libc = ctypes.CDLL(None)
    # for ps, top, pgrep: its command line is the server's
    libc.prctl(PR_SET_NAME, f"titan-rank-{os.environ['RANK']}".encode()[:15])
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if "MALLOC_MMAP_THRESHOLD_" in env:
        libc.mallopt(M_MMAP_THRESHOLD, int(env["MALLOC_MMAP_THRESHOLD_"]))
    sys.argv = [entry, path]
    sys.modules.pop(entry, None)  # ENTRY runs as __main__ alone, as in a fresh process (runpy warns otherwise)
    try:
        runpy.run_module(entry, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    except KeyboardInterrupt:  # as the interpreter ends on one: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except Exception:  # noqa: BLE001 - as the interpreter ends on one: its traceback, exit code 1
        traceback.print_exc()
        # torch's agent reports only the first process of a function entry point to fail: a rank
        # that raised because a peer died (a reset connection) waits, so that the peer is the one.
        time.sleep(PEER_FIRST_S)
        sys.exit(1)
    finish()


def finish() -> None:
    """The end of a rank whose ENTRY succeeded. Returning hands torch's agent this rank's return
    value, and torch then keeps the process waiting until the agent has read every rank's. An
    agent that is shutting down (it passed SIGTERM or SIGINT to the ranks: the launcher got one)
    reads none, and would SIGKILL the rank 30 s later; a launcher that died never would. So a rank
    that stopped for a stop signal exits at once instead, with EXIT_INTERRUPTED: an agent still
    polling (a signal sent to the ranks alone) reports the exit, and the run's summary says
    `interrupted`."""
    if signals.received():
        sys.exit(signals.EXIT_INTERRUPTED)

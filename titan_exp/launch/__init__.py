"""From a composed config to a finished (or queued) run: preflight steps, then the run record,
then the executor, then the outcome. `launch.py` (and Hydra's multirun) call `launch`."""

from titan_exp.launch.launcher import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_INVALID, EXIT_OK, launch

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_INVALID", "EXIT_OK", "launch"]

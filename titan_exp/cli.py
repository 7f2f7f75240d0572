"""The single entry point: `titan-exp [group=option ...] [key=value ...]` (the console script),
`python -m titan_exp ...` or, in a checkout, `python launch.py ...`: all three are `main` here.

Hydra composes conf/config.yaml (the checkout's top-level conf/, or the copy an installed wheel
carries, so `titan-exp` works from any directory) with the chosen groups against the typed
schemas in titan_exp.config; titan_exp.launch does the rest.
"""

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from titan_exp.config import CONF, refusal, register_configs

sweep_dirs: list[str] = []  # a multirun's dir, for its exit status once Hydra returns


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
def run(cfg: DictConfig) -> int | float:
    """One run. In a multirun it returns the exit code, or with `sweep.objective` that number
    of the member's summary, for sweepers that optimise it (hydra/sweeper=optuna)."""
    from titan_exp.launch import launch

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    refusals_to_stderr()
    code = launch(cfg, hc.runtime.output_dir, multirun=multirun, sweep_dir=hc.sweep.dir if multirun else "",
                  overrides_name=hc.job.override_dirname if multirun else "")
    if code and not multirun:
        sys.exit(code)
    if multirun and hc.sweep.dir not in sweep_dirs:
        sweep_dirs.append(hc.sweep.dir)
    if multirun and cfg.sweep.objective:
        from titan_exp.record import RunDir, objective_value

        return objective_value(RunDir(hc.runtime.output_dir).read_summary(), cfg.sweep.objective)
    return code


class _Refusals(logging.Filter):
    """Passes the launcher's refusals (records logged with `extra={"refusal": True}`), or all but them."""

    def __init__(self, passes: bool):
        super().__init__()
        self.passes = passes

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "refusal", False) == self.passes


def refusals_to_stderr() -> None:
    """On the console a refusal is one line on stderr, `titan_exp: refused, nothing was started:
    field = value: ...`, as the guard's are: the launcher's refusal records leave Hydra's console
    handler (stdout, with its time stamp) for a stderr handler of their own; the run's log file
    keeps them."""
    root = logging.getLogger()
    if any(isinstance(f, _Refusals) for h in root.handlers for f in h.filters):
        return  # a multirun's later member, logging not configured anew
    for handler in root.handlers:
        if type(handler) is logging.StreamHandler:  # the console's, not the log file's
            handler.addFilter(_Refusals(False))
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setFormatter(logging.Formatter("titan_exp: %(message)s"))
    to_stderr.addFilter(_Refusals(True))
    root.addHandler(to_stderr)


def main() -> None:
    from titan_exp.guard import check_argv

    refused = check_argv(sys.argv[1:])  # typos, types and disallowed _target_s, before Hydra reads anything
    if refused:
        print("\n".join(f"titan_exp: {refusal(e)}" for e in refused), file=sys.stderr)
        sys.exit(2)
    register_configs()
    run()
    # A multirun ends here: non-zero unless every member finished ok (or is queued on SLURM),
    # as its members' run records say.
    from titan_exp.report import sweep_exit_code

    sys.exit(max((sweep_exit_code(d) for d in sweep_dirs), default=0))

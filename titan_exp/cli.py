"""The single entry point: `titan-exp [group=option ...] [key=value ...]` (the console script),
`python -m titan_exp ...` or, in a checkout, `python launch.py ...`: all three are `main` here.

Hydra composes conf/config.yaml (the checkout's top-level conf/, or the copy an installed wheel
carries, so `titan-exp` works from any directory) with the chosen groups against the typed
schemas in titan_exp.config; titan_exp.launch does the rest.
"""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from titan_exp.config import CONF, register_configs

sweep_dirs: list[str] = []  # a multirun's dir, for its exit status once Hydra returns


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
def run(cfg: DictConfig) -> int | float:
    """One run. In a multirun it returns the exit code, or with `sweep.objective` that number
    of the member's summary, for sweepers that optimise it (hydra/sweeper=optuna)."""
    from titan_exp.launch import launch

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
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


def main() -> None:
    from titan_exp.guard import check_argv

    refused = check_argv(sys.argv[1:])  # typos and disallowed _target_s, before Hydra reads anything
    if refused:
        print("titan_exp: refused, nothing was started:\n  - " + "\n  - ".join(refused), file=sys.stderr)
        sys.exit(2)
    register_configs()
    run()
    # A multirun ends here: non-zero unless every member finished ok (or is queued on SLURM),
    # as its members' run records say.
    from titan_exp.report import sweep_exit_code

    sys.exit(max((sweep_exit_code(d) for d in sweep_dirs), default=0))

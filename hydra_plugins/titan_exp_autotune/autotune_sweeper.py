"""The autotune sweeper, registered the Hydra way: Hydra finds Sweeper subclasses in the
`hydra_plugins` namespace package, and the config below is `hydra/sweeper=autotune`.

It composes nothing itself: each member is launched by the configured Hydra launcher with the
command line's overrides plus the candidate's, so members get Hydra's numbered run dirs under the
sweep dir and the multirun callbacks (titan_exp's report) run as for any sweep. The search, its
rounds and its record are titan_exp.perf.autotune's.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


@dataclass
class AutotuneSweeperConf:
    _target_: str = "hydra_plugins.titan_exp_autotune.autotune_sweeper.AutotuneSweeper"


ConfigStore.instance().store(group="hydra/sweeper", name="autotune", node=AutotuneSweeperConf, provider="titan_exp")


class AutotuneSweeper(Sweeper):
    def __init__(self) -> None:
        self.config: Optional[DictConfig] = None
        self.launcher: Optional[Launcher] = None
        self.hydra_context: Optional[HydraContext] = None
        self.job_idx = 0

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def launch_batch(self, batch: List[List[str]]) -> List[Path]:
        """Run one round's members; their run dirs."""
        assert self.launcher is not None
        self.validate_batch_is_legal(batch)
        returns = self.launcher.launch(batch, initial_job_idx=self.job_idx)
        self.job_idx += len(batch)
        return [Path(r.hydra_cfg.hydra.runtime.output_dir) for r in returns]

    def sweep(self, arguments: List[str]) -> Any:
        from titan_exp.config import to_job_config
        from titan_exp.perf.autotune import Autotune

        assert self.config is not None
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        return Autotune(to_job_config(self.config), list(arguments), self.launch_batch, sweep_dir).run()

"""Objects built from `_target_` (titan_exp.targets): a user's trainer, model, optimizer, lr
schedule and loader plug in from the command line, and the allow-list holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, SMALL, job_config

from titan_exp.guard import check_argv
from titan_exp.validation import validate

PLUGINS = REPO / "tests" / "plugins"


def test_a_users_classes_plug_in_from_the_command_line(tmp_path):
    """Every built object is the user's, with the user's keyword arguments: a real run (its rank
    a real process) with the trainer, model, optimizer, schedule and loader all swapped."""
    run_dir = tmp_path / "run"
    args = [*SMALL, "training.steps=4", "allowed_targets=[mylab]",
            "training._target_=mylab.RecordingTrainer",
            "model._target_=mylab.TaggedTransformer", "+model.kwargs.tag=mine",
            "optimizer._target_=torch.optim.SGD", "optimizer.lr=0.1", "+optimizer.kwargs.momentum=0.9",
            "lr_scheduler._target_=torch.optim.lr_scheduler.StepLR",
            "+lr_scheduler.kwargs.step_size=2", "+lr_scheduler.kwargs.gamma=0.5",
            "data._target_=mylab.CountingLoader", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "launch.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    built = json.loads((run_dir / "mylab.json").read_text())
    assert built == {"trainer": "RecordingTrainer", "model": "TaggedTransformer", "tag": "mine", "optimizer": "SGD",
                     "momentum": 0.9, "scheduler": "StepLR", "loader": "CountingLoader", "batches": 4}
    # StepLR(step_size=2, gamma=0.5) from SGD's lr 0.1, logged after each step's schedule step;
    # the default WSD schedule would have warmed up from 0.05.
    lrs = [json.loads(line)["lr"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([0.1, 0.05, 0.05, 0.025])


@pytest.mark.parametrize("argv, message", [
    (["optimizer._target_=mylab.Lion"],
     "optimizer: _target_ 'mylab.Lion' is not allowed; a config may only instantiate titan_exp.*, torch.optim.*, "
     "torch.nn.*, hydra.experimental.callbacks.*; add your own module with allowed_targets=[mylab]"),
    (["allowed_targets=[os]"], "allowed_targets: 'os' would allow os.*"),
    (["allowed_targets=[hydra]"], "allowed_targets: 'hydra' would allow hydra.utils.*"),
    (["allowed_targets=['']"], "allowed_targets: '' an empty prefix would allow everything"),
    (["optimizer.name=Adam"], "optimizer.name: renamed; optimizer._target_ names the class now"),
    # A prefix is whole modules: allowing `torch.optim` is not allowing `torch.optimx`.
    (["model._target_=torch.optimx.Evil"], "model: _target_ 'torch.optimx.Evil' is not allowed"),
])
@pytest.mark.quick
def test_the_guard_refuses_targets_outside_the_allow_list(argv, message):
    assert any(message in e for e in check_argv(argv)), check_argv(argv)


def test_the_guard_takes_allowed_targets_from_the_users_config(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "lion.yaml").write_text(
        "# @package _global_\nallowed_targets: [mylab]\noptimizer:\n  _target_: mylab.Lion\n")
    assert check_argv(["--config-dir", str(tmp_path), "+experiment=lion"]) == []
    (tmp_path / "experiment" / "lion.yaml").write_text("# @package _global_\noptimizer:\n  _target_: mylab.Lion\n")
    assert any("_target_ 'mylab.Lion' is not allowed" in e for e in check_argv(["--config-dir", str(tmp_path)]))


@pytest.mark.parametrize("overrides, message", [
    (["optimizer._target_=torch.optim.NoSuchOptimizer"],
     "optimizer._target_ = 'torch.optim.NoSuchOptimizer': no such class or function; check the spelling"),
    (["allowed_targets=[mylab]", "data._target_=mylab.NoSuchLoader"],
     "data._target_ = 'mylab.NoSuchLoader': no such class or function; check the spelling, and that its module is "
     "on PYTHONPATH"),
    (["training._target_=collections.OrderedDict"],
     "training._target_ = 'collections.OrderedDict': is not under an allowed prefix (titan_exp, torch.optim, "
     "torch.nn); if it is your own code, add its module: allowed_targets=[collections]"),
    (["allowed_targets=[plugins]", "model._target_=plugins.broken.Model"],
     "model._target_ = 'plugins.broken.Model': its module fails to import (RuntimeError: this module needs a driver"),
    (["allowed_targets=[subprocess]"], "allowed_targets = 'subprocess': would allow subprocess.*"),
    (["model._target_=torch.nn.init"], "model._target_ = 'torch.nn.init': is not a class or function"),
    # A keyword the target does not take is caught here, not as a TypeError inside every rank.
    (["+optimizer.kwargs.momentum=0.9"], "optimizer.kwargs.momentum = 0.9: torch.optim.AdamW takes no argument "
                                          "'momentum'; it takes params, lr, betas"),
])
def test_validation_names_a_target_that_cannot_be_built(overrides, message):
    errors = validate(job_config(overrides), cuda=False)
    assert any(message in e for e in errors), errors


def test_a_refused_target_is_not_built_even_past_validation():
    """build() checks the allow-list itself: a job that skipped validation still builds nothing refused."""
    from titan_exp import targets

    job = job_config(["optimizer._target_=collections.OrderedDict"])
    with pytest.raises(ValueError, match="optimizer._target_ = 'collections.OrderedDict': is not allowed"):
        targets.build(job, "optimizer", [])

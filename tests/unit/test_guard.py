"""Bad input at the command line, in data files and in the environment: each is refused with a
message naming the field or file, the value and the fix, before anything is written or started.
(Field ranges and layouts: test_config.py; checkpoints: test_checkpoint.py; SLURM fields:
test_slurm.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from conftest import REPO, SMALL, job_config, launch_cli

TYPOS = [
    (["optimizer.lr_rate=1e-3"], "optimizer.lr_rate: unknown key; did you mean optimizer.lr?"),
    (["optimiser.lr=1e-3"], "optimiser.lr: unknown key; did you mean optimizer.lr?"),
    (["trainig.steps=5"], "trainig.steps: unknown key; did you mean training.steps?"),
    (["trainig.stpes=5"], "trainig.stpes: unknown key; did you mean training.steps?"),
    (["training.stpes=5"], "training.stpes: unknown key; did you mean training.steps?"),
    (["parallelism.tensor_paralel_degree=2"], "unknown key; did you mean parallelism.tensor_parallel_degree or "),
    (["parallelism=fsdpp"], "parallelism=fsdpp: no such preset in parallelism/ of conf; did you mean fsdp or hsdp?"),
    (["model=llama3_9b"], "model=llama3_9b: no such preset in model/ of conf; did you mean"),
    (["+sweep=layout_2"], "+sweep=layout_2: no such preset; did you mean layouts_2?"),
    (["-m", "training.stepz=1,2"], "training.stepz: unknown key; did you mean training.steps?"),
    (["-m", "hydra/launcher=submitit_slurm", "optimizer.lr=1e-3,2e-3"], "use cluster=slurm"),
]
TARGETS = [
    (["+hydra.callbacks.x._target_=os.system", "+hydra.callbacks.x.command='touch PWNED'"],
     "hydra.callbacks.x: _target_ 'os.system' is not allowed"),
    (["+hydra.callbacks={x: {_target_: subprocess.call, args: [touch, PWNED]}}"],
     "hydra.callbacks.x: _target_ 'subprocess.call' is not allowed"),
    (["+hydra.callbacks.x._target_=hydra.utils.call"], "_target_ 'hydra.utils.call' is not allowed"),
    (["+hydra.callbacks.x._target_=builtins.open", "+hydra.callbacks.x.file=PWNED", "+hydra.callbacks.x.mode=w"],
     "hydra.callbacks.x: _target_ 'builtins.open' is not allowed"),
]


@pytest.mark.parametrize("args,message", TYPOS + TARGETS, ids=[" ".join(a) for a, _ in TYPOS + TARGETS])
@pytest.mark.quick
def test_launch_refuses_before_hydra_runs(tmp_path, args, message):
    out = subprocess.run([sys.executable, str(REPO / "launch.py"), *args, f"hydra.run.dir={tmp_path / 'run'}",
                          f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run dir, no PWNED


def test_a_refused_target_would_run_without_the_guard(tmp_path, monkeypatch):
    """The control for the test above: Hydra instantiates every callback's _target_ when a run
    starts. Hydra 1.3.8's own blocklist stops os.system, but not builtins.open, which creates a
    file here: the allow-list is what stands between a config and the callables it names."""
    from conftest import compose
    from hydra._internal.callbacks import Callbacks
    from hydra.errors import InstantiationException

    monkeypatch.chdir(tmp_path)
    Callbacks(compose(["+hydra.callbacks.x._target_=builtins.open", "+hydra.callbacks.x.file=PWNED",
                       "+hydra.callbacks.x.mode=w"], with_hydra=True))
    assert (tmp_path / "PWNED").exists()
    with pytest.raises(InstantiationException, match="blocklisted"):
        Callbacks(compose(["+hydra.callbacks.x._target_=os.system", "+hydra.callbacks.x.command=true"],
                          with_hydra=True))


def test_config_dir_with_a_disallowed_target_is_refused(tmp_path):
    extra = tmp_path / "conf_extra"
    extra.mkdir()
    (extra / "evil.yaml").write_text("hydra:\n  callbacks:\n    evil:\n      _target_: os.system\n"
                                     "      command: touch PWNED\n")
    out = launch_cli(["--config-dir", str(extra), f"hydra.run.dir={tmp_path / 'run'}"])
    assert out.returncode == 2 and f"{extra / 'evil.yaml'}: hydra.callbacks.evil: _target_ 'os.system'" in out.stderr
    assert not (tmp_path / "run").exists()


def test_hydra_extension_points(tmp_path):
    """A user's preset from --config-dir or hydra.searchpath (`model=mine`), an experiment
    (`+experiment=short`) and a --config-dir holding old run records all go through; a typo in
    either still gets its did-you-mean, naming where it looked."""
    mine = tmp_path / "mine"
    (mine / "model").mkdir(parents=True)
    (mine / "model" / "tiny.yaml").write_text("flavor: tiny\ndim: 128\nn_layers: 2\nn_heads: 4\nn_kv_heads: 2\n"
                                              "vocab_size: 2048\nmultiple_of: 128\n")
    (mine / "old_run" / ".hydra").mkdir(parents=True)  # Hydra's record of a run names its own launcher
    (mine / "old_run" / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  launcher:\n    _target_: hydra._internal.core_plugins.basic_launcher.BasicLauncher\n")
    run = tmp_path / "run"
    out = launch_cli(["--config-dir", str(mine), "model=tiny", "+experiment=short", "training.steps=2",
                      f"hydra.run.dir={run}"])
    assert out.returncode == 0, out.stderr[-2000:]
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["flavor"] == "tiny" and config["metrics"]["log_freq"] == 1
    out = launch_cli([f"hydra.searchpath=[file://{mine}]", "model=tiny", "training.steps=3",
                      f"hydra.run.dir={tmp_path / 'r2'}"])
    assert out.returncode == 0, out.stderr[-2000:]
    out = launch_cli(["--config-dir", str(mine), "model=tiyn", "+experiment=shrot"])
    assert out.returncode == 2
    assert f"model=tiyn: no such preset in model/ of conf, {mine}; did you mean tiny?" in out.stderr
    assert "+experiment=shrot: no such preset; did you mean short?" in out.stderr


@pytest.mark.quick
def test_shipped_configs_only_use_allowed_targets():
    from titan_exp.guard import CONF, config_file_errors

    assert config_file_errors([CONF]) == []


DATA = [
    ("empty.txt", "text", b"", "is empty"),
    ("blank.txt", "text", b"\n\n  \n", "is empty"),
    ("image.txt", "text", bytes(range(256)) * 8, "is not UTF-8 text (byte 128)"),
    ("nul.txt", "text", b"abc\x00def", "holds NUL bytes"),
    ("broken.jsonl", "json", b'{"text": "a"}\n{"text": \n', "line 2 is not JSON"),
    ("list.jsonl", "json", b'["text"]\n', "line 1 has no string field 'text'"),
    ("other_field.jsonl", "json", b'{"body": "a"}\n', "line 1 has no string field 'text'; set data.text_field"),
]


@pytest.mark.parametrize("name,kind,content,message", DATA, ids=[d[0] for d in DATA])
def test_unusable_data_files_are_refused_at_launch(tmp_path, name, kind, content, message):
    from conftest import compose

    from titan_exp.launch import EXIT_INVALID, launch

    path = tmp_path / name
    path.write_bytes(content)
    run_dir = tmp_path / "run"
    assert launch(compose([*SMALL, f"data.dataset={kind}", f"data.path={path}"]), str(run_dir)) == EXIT_INVALID
    assert not run_dir.exists()
    from titan_exp.data.sources import data_file_errors

    (error,) = data_file_errors(job_config([f"data.dataset={kind}", f"data.path={path}"]).data)
    assert message in error and str(path) in error


def test_a_good_text_file_trains(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("The quick brown fox jumps over the lazy dog.\n" * 2000)
    out = launch_cli([*SMALL, "cluster=debug", "data.dataset=text", f"data.path={path}",
                      f"hydra.run.dir={tmp_path / 'run'}"])
    assert out.returncode == 0, out.stderr[-2000:]


def test_secrets_stay_out_of_the_run_dir(tmp_path):
    """Secrets in the environment reach neither the config dumps nor the logs nor wandb's files;
    a secret put into the config (cluster.env) is refused."""
    import os

    secrets = {"WANDB_API_KEY": "wandb-secret-3f9a1c", "HF_TOKEN": "hf_secret_77b2e0",
               "AWS_SECRET_ACCESS_KEY": "aws/secret+91"}
    out = subprocess.run([sys.executable, "launch.py", *SMALL, "parallelism=fsdp", "cluster.nproc_per_node=2",
                          "training.local_batch_size=4", "metrics.enable_wandb=true", "metrics.enable_tensorboard=true",
                          # an API key would otherwise mean online, and there is no network
                          "metrics.wandb_mode=offline",
                          "checkpoint=default", f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, **secrets})
    assert out.returncode == 0, out.stderr[-2000:]
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert len(files) > 20
    for path in files:
        data = path.read_bytes()
        for value in secrets.values():
            assert value.encode() not in data, f"{value} leaked into {path}"
    for value in secrets.values():
        assert value not in out.stdout + out.stderr
    from titan_exp.validation import validate

    errors = validate(job_config(["cluster=slurm", "+cluster.env.WANDB_API_KEY=x", "+cluster.env.HF_HOME=/scratch"]))
    assert errors == ["cluster.env = ['WANDB_API_KEY']: looks like a secret, and the config is written to the run dir "
                      "and the job script; export it in the shell that runs launch.py instead (sbatch passes that "
                      "environment on)"]


@pytest.mark.parametrize("name,value,secret", [
    ("HF_TOKEN", "x", True), ("WANDB_API_KEY", "x", True), ("DB_PASSWORD", "x", True),
    ("TOKENIZERS_PARALLELISM", "false", False), ("NCCL_IB_HCA", "mlx5", False), ("NCCL_SOCKET_IFNAME", "eth0", False),
    ("HF_HOME", "/scratch/hf", False), ("KEYBOARD", "us", False),
    ("MY_SETTING", "hf_abcdefghijklmnop", True), ("MY_SETTING", "a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7", True),
])
@pytest.mark.quick
def test_secret_names_by_word_and_values_by_shape(name, value, secret):
    """cluster.env is written to the run dir: a secret's name (a whole word such as TOKEN or KEY) or a
    value that looks like a key is refused; settings like TOKENIZERS_PARALLELISM and NCCL_* pass."""
    from titan_exp.validation import validate

    errors = validate(job_config(["cluster=slurm", f"+cluster.env.{name}={value}"]))
    assert any("looks like a secret" in e for e in errors) == secret, errors


@pytest.mark.parametrize("where", ["/proc/titan_exp_run", "/etc/hostname/run"])
def test_unwritable_run_dir_is_refused(where):
    out = launch_cli([*SMALL, f"hydra.run.dir={where}"])
    assert out.returncode == 2
    assert (f"hydra.run.dir = '{where}': cannot write there (" in out.stderr
            and "choose a writable directory" in out.stderr)


def test_cache_is_private(tmp_path, monkeypatch):
    """torch's inductor cache (pickles) lives in the cache dir: other users cannot write there."""
    from titan_exp.cache import cache_dir

    monkeypatch.setenv("TITAN_EXP_CACHE", str(tmp_path / "cache"))
    assert cache_dir().stat().st_mode & 0o077 == 0
    (tmp_path / "shared").mkdir(mode=0o777)
    (tmp_path / "shared").chmod(0o777)
    monkeypatch.setenv("TITAN_EXP_CACHE", str(tmp_path / "shared"))
    assert cache_dir().stat().st_mode & 0o022 == 0

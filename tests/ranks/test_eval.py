"""Downstream evaluation (eval.*) with the real lm-eval: a run of real gloo ranks evaluates a tiny
local multiple-choice task (tests/data/eval_tasks) every eval.freq steps and at the end, in a process
of its own, and its number is the one lm-eval gives when run by hand on the exported directory.
The config's rules are checked without starting anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, job_config, run_job

from titan_exp.record import RunDir, objective_value
from titan_exp.validation import validate

TASKS = REPO / "tests" / "data" / "eval_tasks"
EVAL = ["eval.enable=true", "eval.tasks=[tiny_mc]", f"eval.include_path={TASKS}"]


def by_hand(model_dir: Path, limit: int, batch_size: int, monkeypatch) -> dict[str, float]:
    """lm-eval's own simple_evaluate of the directory, as a user would call it (in the task
    directory, whose YAML names its data file relatively)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASKS)
    raw = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir}", tasks=["tiny_mc"],
                                  task_manager=TaskManager(include_path=str(TASKS)), limit=limit,
                                  batch_size=batch_size, device="cpu")
    return raw["results"]["tiny_mc"]


def same_tensors(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    theirs, ours = load_file(a), load_file(b)
    return theirs.keys() == ours.keys() and all(theirs[k].equal(ours[k]) for k in theirs)


def test_a_run_evaluates_at_freq_and_at_the_end_as_lm_eval_does_by_hand(tmp_path, monkeypatch):
    """FSDP over 2 ranks, 4 steps, an evaluation at step 2 and at the last step: both reach
    metrics.jsonl, the last is summary.json's `eval`, a sweep objective and a report column, its
    model is the run's final model (checkpoint.last_save_in_hf's export), its numbers are
    lm-eval's by hand on <run dir>/eval/step-4, and its log has no warning (transformers imports
    torchao, which warns on a CPU: precision.torchao_imports)."""
    pytest.importorskip("lm_eval")
    run_dir = tmp_path / "sweep" / "0"  # a sweep's member, for the report
    code, summary = run_job(["training.steps=4", "training.seq_len=64", "training.global_batch_size=8",
                             "training.local_batch_size=4", "metrics.log_freq=1", "parallelism=fsdp",
                             "cluster.nproc_per_node=2", *EVAL, "eval.freq=2", "eval.limit=4", "eval.batch_size=4",
                             "sweep.objective=eval.tiny_mc.acc_norm", "checkpoint.enable=true", "checkpoint.interval=4",
                             "checkpoint.last_save_in_hf=true"], run_dir)
    assert code == 0 and summary["status"] == "ok", summary
    records = [r for r in RunDir(run_dir).read_metrics() if "eval" in r]
    assert [r["step"] for r in records] == [2, 4]
    assert summary["eval"] == records[-1]["eval"]
    assert "eval_errors" not in summary and "eval_skipped_steps" not in summary
    assert set(summary["eval"]["tiny_mc"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    final = run_dir / "eval" / "step-4"
    saved = json.loads((final / "results.json").read_text())
    assert saved["lm_eval"]["n-samples"]["tiny_mc"] == {"original": 6, "effective": 4}  # eval.limit reached lm-eval
    # Each evaluation scored its own step's model, and the DCP copies are gone once exported.
    weights = [(run_dir / "eval" / f"step-{s}" / "model.safetensors").read_bytes() for s in (2, 4)]
    assert weights[0] != weights[1]
    assert same_tensors(final / "model.safetensors", run_dir / "export" / "hf" / "model.safetensors")
    assert not list((run_dir / "eval" / "checkpoints").iterdir())
    assert "warn" not in (final / "eval.log").read_text().lower()
    # It holds the run's tokenizer, as transformers loads it.
    from transformers import AutoTokenizer

    from titan_exp.data.corpus import Tokenizer

    text = "def f(x):\n    return x"
    assert (AutoTokenizer.from_pretrained(final, local_files_only=True).encode(text, add_special_tokens=False)
            == Tokenizer(run_dir / "tokenizer.json").encode(text))

    theirs = by_hand(final, limit=4, batch_size=4, monkeypatch=monkeypatch)
    assert summary["eval"]["tiny_mc"]["acc"] == theirs["acc,none"]
    assert summary["eval"]["tiny_mc"]["acc_norm"] == theirs["acc_norm,none"]
    assert summary["eval"]["tiny_mc"]["acc_norm_stderr"] == theirs["acc_norm_stderr,none"]

    # What the sweeper gets back, and the report's columns.
    assert objective_value(RunDir(run_dir).read_summary(), "eval.tiny_mc.acc_norm") == theirs["acc_norm,none"]
    from titan_exp.report import write_report

    (run_dir / ".hydra").mkdir(exist_ok=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- eval.freq=2\n")  # as Hydra writes a member's
    write_report(tmp_path / "sweep", plots=False)
    header, row = (tmp_path / "sweep" / "report.csv").read_text().splitlines()[:2]
    column = header.split(",").index("eval/tiny_mc/acc_norm")
    assert float(row.split(",")[column]) == theirs["acc_norm,none"]
    assert f"tiny_mc/acc_norm {theirs['acc_norm,none']:.4f}" in (tmp_path / "sweep" / "report.md").read_text()


@pytest.mark.quick
@pytest.mark.parametrize("overrides, message", [
    (["eval.enable=true"], "eval.tasks = []: name at least one lm-eval task"),
    (["eval.tasks=[tiny_mc]"], "eval.tasks = ['tiny_mc']: set while eval.enable is false"),
    ([*EVAL, "eval.include_path=/no/such/dir"], "eval.include_path = '/no/such/dir': not a directory"),
    ([*EVAL, "eval.limit=0"], "eval.limit = 0: must be >= 1"),
    ([*EVAL, "eval.device=tpu"], "eval.device = 'tpu': choose cpu, cuda or cuda:N"),
    ([*EVAL, "eval.device=cuda:1"], "eval.device = 'cuda:1': this machine has no GPU"),
    ([*EVAL, "eval.freq=0"], "eval.freq = 0: must be >= 1"),
    ([*EVAL, "model=moe_debug"], "eval.enable = True: lm-eval loads the model from its Hugging Face export, which "
                                     "cannot be written for a model with routed experts without QK-norm"),
    ([*EVAL, "model=deepseek_v3_debug", "model.n_experts=0"], "eval.enable = True: lm-eval loads the model from"),
    ([*EVAL, "sweep.objective=eval.hellaswag.acc"], "sweep.objective = 'eval.hellaswag.acc': not eval.<task>.<metric> "
                                                    "with a task of eval.tasks (tiny_mc)"),
    (["sweep.objective=eval.tiny_mc.acc"], "sweep.objective = 'eval.tiny_mc.acc': an evaluation's number needs "
                                           "eval.enable=true"),
], ids=["no-tasks", "tasks-without-enable", "include-path", "limit", "device", "device-cuda", "freq", "moe", "mla",
        "objective-task", "objective-without-eval"])
def test_bad_eval_fields_are_named(overrides, message):
    errors = validate(job_config(overrides), cuda=False)
    assert any(e.startswith(message) for e in errors), errors


@pytest.mark.quick
def test_good_eval_fields_pass():
    assert validate(job_config([*EVAL, "eval.limit=3", "eval.device=cpu", "sweep.objective=eval.tiny_mc.acc"]),
                    cuda=False) == []


def test_a_task_that_is_not_found_is_refused_at_launch_with_close_names(tmp_path):
    """The launcher's evaluation step looks the task up in eval.include_path, then in lm-eval's own
    index, before anything is written or started."""
    pytest.importorskip("lm_eval")
    from titan_exp.launch.preflight import preflight

    _, errors = preflight(job_config([*EVAL, "eval.tasks=[tiny_mq]"]), RunDir(tmp_path))
    assert errors == [f"eval.tasks = 'tiny_mq': no such lm-eval task in {TASKS} nor among lm-eval's own; "
                      "did you mean tiny_mc?"]
    assert not list(tmp_path.iterdir())


def test_the_evaluator_reads_a_relative_include_path_from_the_callers_directory(tmp_path, monkeypatch):
    """`python -m titan_exp.eval MODEL --include-path tests/data/eval_tasks` in the repository: the
    path is the caller's, though the evaluation then runs in it (for the YAML's relative data_files)."""
    pytest.importorskip("lm_eval")
    from titan_exp.config import ModelConfig
    from titan_exp.data.corpus import default_corpus, trained_tokenizer
    from titan_exp.eval.evaluator import main
    from titan_exp.models import hf
    from titan_exp.models.llama import Transformer

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048, max_seq_len=128)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    hf.save({k: v.detach() for k, v in model.state_dict().items()}, cfg, tmp_path / "model", "float32",
            hf.hf_tokenizer(trained_tokenizer(default_corpus(), 2048), cfg))
    monkeypatch.chdir(REPO)
    assert main([str(tmp_path / "model"), "--tasks", "tiny_mc", "--include-path", "tests/data/eval_tasks",
                 "--limit", "2", "--batch-size", "2"]) == 0
    saved = json.loads((tmp_path / "model" / "results.json").read_text())
    assert set(saved["eval"]["tiny_mc"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert saved["lm_eval"]["n-samples"]["tiny_mc"] == {"original": 6, "effective": 2}


@pytest.mark.quick
def test_lm_eval_results_become_task_metric_tables():
    from titan_exp.eval.tasks import metrics_of

    raw = {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1,
                     "exact_match,none": 0.5, "exact_match_stderr,none": "N/A", "sample_len": 4}}
    assert metrics_of(raw) == {"gsm8k": {"exact_match_strict-match": 0.25, "exact_match_stderr_strict-match": 0.1,
                                         "exact_match": 0.5}}


@pytest.mark.slow
def test_a_failed_evaluation_is_recorded_and_training_goes_on(tmp_path):
    """A task whose data file is missing: the evaluator fails, the run still ends ok with its
    losses, and summary.json says which evaluation failed and how its output ended."""
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "broken.yaml").write_text((TASKS / "tiny_mc.yaml").read_text().replace("task: tiny_mc", "task: broken")
                                       .replace("tiny_mc.jsonl", "missing.jsonl"))
    code, summary = run_job(["training.steps=2", "training.seq_len=64", "training.global_batch_size=8",
                             "eval.enable=true", "eval.tasks=[broken]", f"eval.include_path={tasks}", "eval.limit=2"],
                            tmp_path / "run")
    assert code == 0 and summary["status"] == "ok" and len(summary["losses"]) == 2
    assert "eval" not in summary and list(summary["eval_errors"]) == ["2"]
    assert ("the evaluator exited with 1" in summary["eval_errors"]["2"]
            and "missing.jsonl" in summary["eval_errors"]["2"])
    assert (tmp_path / "run" / "eval" / "step-2.log").is_file()


def test_evaluations_reach_every_sink(tmp_path, monkeypatch):
    """MetricSinks.log_eval, with the real TensorBoard and wandb (offline): metrics.jsonl gets the
    table at its step, TensorBoard eval/<task>/<metric> at that step, and wandb takes it after
    later steps (by eval/step) without failing, which would turn its logging off."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from titan_exp.metrics import MetricSinks

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    job = job_config([*EVAL, "metrics.enable_tensorboard=true", "metrics.enable_wandb=true",
                      "metrics.wandb_mode=offline"])
    sinks = MetricSinks(job, tmp_path, rank=0)
    for step in (1, 2, 3):
        sinks.log(step, {"loss": 1.0 / step, "grad_norm": 1.0, "lr": 1e-3, "tps_per_device": 1.0, "mfu": 1.0,
                         "peak_memory_gib": 0.1})
    sinks.log_eval(2, {"tiny_mc": {"acc": 0.5, "acc_norm": 0.75}})  # step 2's, finished at step 3
    assert sinks.wandb_run is not None
    sinks.close()
    assert RunDir(tmp_path).read_metrics()[-1] == {"step": 2, "eval": {"tiny_mc": {"acc": 0.5, "acc_norm": 0.75}}}
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/tiny_mc/acc_norm")] == [(2, 0.75)]


@pytest.mark.slow
def test_an_optuna_sweep_optimises_an_eval_metric(tmp_path):
    """hydra/sweeper=optuna with sweep.objective=eval.tiny_mc.acc_norm: each member returns its last
    evaluation's number, so the study's best value is the best of the members' summaries."""
    import yaml
    from conftest import launch_cli

    pytest.importorskip("lm_eval")
    sweep = tmp_path / "optuna"
    result = launch_cli(["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.direction=maximize",
                         "hydra.sweeper.sampler.seed=0", "optimizer.lr=interval(1e-4,3e-2)", "training.steps=2",
                         "training.seq_len=64", "training.global_batch_size=8", *EVAL, "eval.limit=6",
                         "sweep.objective=eval.tiny_mc.acc_norm", f"hydra.sweep.dir={sweep}"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    members = [json.loads((d / "summary.json").read_text()) for d in sweep.iterdir() if (d / "summary.json").exists()]
    values = [m["eval"]["tiny_mc"]["acc_norm"] for m in members]
    assert len(values) == 2
    assert yaml.safe_load((sweep / "optimization_results.yaml").read_text())["best_value"] == pytest.approx(max(values))
    assert "eval/tiny_mc/acc_norm" in (sweep / "report.csv").read_text().splitlines()[0]


@pytest.mark.slow
def test_a_pipeline_run_evaluates_its_final_model(tmp_path):
    """Under PP (each rank holds half the blocks) the evaluated model is whole: the final export's."""
    pytest.importorskip("lm_eval")
    run_dir = tmp_path / "run"
    code, summary = run_job(["training.steps=2", "training.seq_len=64", "training.global_batch_size=8",
                             "training.local_batch_size=2", "parallelism=pp", *EVAL, "eval.limit=2",
                             "checkpoint.enable=true", "checkpoint.last_save_in_hf=true"], run_dir)
    assert code == 0 and set(summary["eval"]) == {"tiny_mc"}, summary
    assert same_tensors(run_dir / "eval" / "step-2" / "model.safetensors",
                        run_dir / "export" / "hf" / "model.safetensors")

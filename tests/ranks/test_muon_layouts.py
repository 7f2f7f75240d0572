"""optimizer=muon on real gloo ranks: every layout's update is one process's (losses, gradient
norms and the parameters after the last step), its momentum resumes bit-exactly and reshards,
and an AdamW checkpoint is refused by a Muon run (and back) before any rank starts.

Why the parameters are compared too: orthogonalising each rank's half of every matrix instead of
the whole (what torch.optim.Muon does with a DTensor's shard) moved the losses of PARITY by only
4e-4 to 3e-3, against the layouts' 2e-5 (tests/ranks/test_parallel.py), but the matrices by up to
1.5e-3, where FSDP 2, TP 2 and PP 2 left them within 4.5e-8 of one process's (the rest, AdamW's,
within 4e-6: Adam divides rare tokens' embedding gradients by their own small norm)."""

from __future__ import annotations

import csv

import pytest
import torch
from conftest import SMALL, launch_cli, run_job
from safetensors.torch import load_file

from titan_exp import checkpoint
from titan_exp.checkpoint import step_dir
from titan_exp.train import muon

slow = pytest.mark.slow

MUON = ["optimizer=muon"]
# 5 steps at the peak lr after one of warmup's two (no decay: every step moves the weights), the
# weights exported at the end.
PARITY = [*SMALL, *MUON, "lr_scheduler.decay_ratio=0", "checkpoint=default", "checkpoint.export_format=safetensors"]
MOE = [*PARITY, "model=moe_debug", "training.steps=4"]
W2 = ["cluster.nproc_per_node=2", "training.local_batch_size=4"]
W4 = ["cluster.nproc_per_node=4", "training.local_batch_size=2"]
LAYOUTS = {  # name: (dense or moe, overrides, marks)
    "fsdp2": ("dense", ["parallelism=fsdp", *W2], [pytest.mark.quick]),
    "tp2": ("dense", ["parallelism=tp"], []),
    "pp2": ("dense", ["parallelism=pp"], []),
    "ddp2": ("dense", ["parallelism=ddp", "training.local_batch_size=4"], [slow]),
    "hsdp2x2": ("dense", ["parallelism=hsdp", "training.local_batch_size=2"], [slow]),
    "fsdp2_tp2": ("dense", ["parallelism=2d", "training.local_batch_size=4"], [slow]),
    "ep2": ("moe", ["parallelism=ep", *W2], []),
    "moe_tp2": ("moe", ["parallelism=tp", *W2], [slow]),  # each expert's width split over TP
    "dp_shard4_ep2": ("moe", ["parallelism=ep", "parallelism.data_parallel_shard_degree=4", *W4], [slow]),
    "tp2_ep2": ("moe", ["parallelism=2d", "parallelism.expert_parallel_degree=2", *W4], [slow]),
}
LOSS_ABS = 2e-5  # as tests/ranks/test_parallel.py: fp32 sums in another order
MATRIX_ABS, REST_ABS = 1e-6, 2e-5  # the weights after PARITY, Muon's and AdamW's (measured: above)


def ok(code, summary):
    assert code == 0 and summary["status"] == "ok", summary and summary.get("error")
    return summary


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process's run of each model, and its weights, made when a test first asks for it."""
    made = {}

    def reference(kind: str):
        if kind not in made:
            run_dir = tmp_path_factory.mktemp(f"muon_{kind}")
            made[kind] = ok(*run_job(PARITY if kind == "dense" else MOE, run_dir)), weights(run_dir)
        return made[kind]

    return reference


def weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "export" / "model.safetensors")


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, (_, _, m) in LAYOUTS.items()])
def test_layout_updates_as_one_process(name, references, tmp_path):
    kind, overrides, _ = LAYOUTS[name]
    reference, reference_weights = references(kind)
    summary = ok(*run_job([*(PARITY if kind == "dense" else MOE), *overrides], tmp_path))
    assert summary["losses"] == pytest.approx(reference["losses"], abs=LOSS_ABS)
    assert summary["grad_norms"] == pytest.approx(reference["grad_norms"], rel=2e-4)
    mine = weights(tmp_path)
    assert mine.keys() == reference_weights.keys()
    for key, value in mine.items():
        atol = MATRIX_ABS if muon.is_matrix(key, value.shape) else REST_ABS
        torch.testing.assert_close(value, reference_weights[key], atol=atol, rtol=0, msg=key)


FSDP2 = ["parallelism=fsdp", *W2]
RESUME = [*SMALL, *MUON, "training.steps=4", "checkpoint=default", "checkpoint.interval=2",
          "lr_scheduler.decay_ratio=0"]


@pytest.fixture(scope="module")
def fsdp2_muon(tmp_path_factory):
    """FSDP 2 under Muon, 4 steps, saving at 2 and 4."""
    run_dir = tmp_path_factory.mktemp("fsdp2_muon")
    return run_dir, ok(*run_job([*RESUME, *FSDP2], run_dir))


def test_resume_is_bit_identical(fsdp2_muon):
    """The checkpoint holds Muon's momentum for the matrices (sharded as the parameter) and AdamW's
    moments for the rest; resumed from step 2, steps 3 and 4 repeat to the bit (step 4's loss
    follows step 3's update, which the loaded momentum steers)."""
    run_dir, first = fsdp2_muon
    saved = checkpoint.read_metadata(step_dir(run_dir / "checkpoints", 2)).state_dict_metadata
    state = "optimizer.state.layers.0.attention.wq.weight"
    assert f"{state}.momentum_buffer" in saved and f"{state}.exp_avg" not in saved
    assert saved[f"{state}.momentum_buffer"].size == torch.Size((256, 256))
    assert "optimizer.state.tok_embeddings.weight.exp_avg_sq" in saved
    again = ok(*run_job([*RESUME, *FSDP2, "checkpoint.load_step=2"], run_dir))
    assert again["start_step"] == 3
    assert again["losses"] == first["losses"][2:] and again["grad_norms"] == first["grad_norms"][2:]


@pytest.mark.parametrize("name, layout", [("single", []), pytest.param("tp2", ["parallelism=tp"], marks=slow)])
def test_fsdp2_checkpoint_continues_in_another_layout(name, layout, fsdp2_muon, tmp_path):
    """DCP reshards the momentum as it does AdamW's moments."""
    run_dir, first = fsdp2_muon
    summary = ok(*run_job([*RESUME, *layout, f"checkpoint.initial_load_path={run_dir}/checkpoints/step-2",
                           "checkpoint.initial_load_model_only=false"], tmp_path))
    assert summary["start_step"] == 3
    assert summary["losses"] == pytest.approx(first["losses"][2:], abs=1e-5)


def test_pipeline_stage_without_matrices_resumes(tmp_path):
    """The model's ends as stages of their own: the embedding's stage has no matrices, so its
    optimizer has AdamW's group alone where the blocks' have two; the lr schedule's state, one
    for every stage, still loads into each, and the run resumes to the bit."""
    overrides = [*RESUME, "parallelism=pp", "parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                 "parallelism.pipeline_parallel_layers_per_stage=1",
                 "parallelism.pipeline_parallel_first_stage_less_layers=1",
                 "parallelism.pipeline_parallel_last_stage_less_layers=1"]
    first = ok(*run_job(overrides, tmp_path))
    again = ok(*run_job([*overrides, "checkpoint.load_step=2"], tmp_path))
    assert again["losses"] == first["losses"][2:]


REFUSED = "titan_exp: refused, nothing was started: "
RULE = "optimizer state loads only into the optimizer that saved it"


def refusal(args: list[str]) -> str:
    """The one line `python launch.py ARGS` refuses them with (exit 2)."""
    out = launch_cli(args)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(REFUSED), out.stderr
    return lines[0].removeprefix(REFUSED)


def test_an_adamw_checkpoint_is_refused_by_a_muon_run_and_its_weights_load(tmp_path):
    saved = [*SMALL, "training.steps=2", "checkpoint=default"]
    ok(*run_job(saved, tmp_path / "adamw"))
    step = step_dir(tmp_path / "adamw" / "checkpoints", 2)
    into = [*saved, *MUON, f"checkpoint.initial_load_path={step}"]
    line = refusal([*into, "checkpoint.initial_load_model_only=false", f"hydra.run.dir={tmp_path / 'muon'}"])
    assert line == (f"checkpoint.initial_load_path: checkpoint {step} holds optimizer state exp_avg, exp_avg_sq, step "
                    f"for layers.0.attention.wq.weight, where this run's optimizer keeps momentum_buffer: {RULE} "
                    "(optimizer=adamw and optimizer=muon keep different state). Resume with the optimizer it was saved "
                    f"with, or start a new run dir from its weights alone: checkpoint.initial_load_path={step} "
                    "checkpoint.initial_load_model_only=true")
    assert not (tmp_path / "muon" / "logs").exists()
    assert ok(*run_job(into, tmp_path / "weights"))["start_step"] == 1  # the way out


def test_a_muon_checkpoint_is_refused_when_its_run_resumes_under_adamw(fsdp2_muon):
    run_dir, _ = fsdp2_muon
    overrides = [o for o in RESUME if o not in MUON]
    line = refusal([*overrides, *FSDP2, f"hydra.run.dir={run_dir}"])
    assert line.startswith(f"checkpoint.folder: checkpoint {step_dir(run_dir / 'checkpoints', 4)} holds optimizer "
                           "state momentum_buffer for layers.0.attention.wq.weight, where this run's optimizer keeps "
                           f"exp_avg, exp_avg_sq, step: {RULE}")


def test_a_rank_names_the_rule_for_an_optimizer_the_launcher_does_not_know(fsdp2_muon, tmp_path):
    """SGD's state is not known before the ranks start; loading Muon's into it, the rank says why."""
    run_dir, _ = fsdp2_muon
    code, summary = run_job([*SMALL, "training.steps=4", "checkpoint=default", "optimizer._target_=torch.optim.SGD",
                             "+optimizer.kwargs.momentum=0.9", "checkpoint.initial_load_model_only=false",
                             f"checkpoint.initial_load_path={run_dir}/checkpoints/step-2"], tmp_path)
    assert code == 1 and RULE in summary["error"] and "holds optimizer state exp_avg, exp_avg_sq, step for " \
                                                       "tok_embeddings.weight" in summary["error"]


def test_the_optimizers_sweep_reports_loss_per_optimizer(tmp_path):
    """`+sweep=optimizers` cut to 3 steps and one lr: an AdamW and a Muon member, each a row with
    its optimizer in the overrides column and its losses."""
    out = launch_cli(["-m", "+sweep=optimizers", "training.steps=3", "validation.freq=3", "optimizer.lr=1e-3",
                      f"hydra.sweep.dir={tmp_path}"], timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["overrides"]: r for r in csv.DictReader((tmp_path / "report.csv").open())}
    assert set(rows) == {"optimizer=adamw", "optimizer=muon"}
    assert all(r["status"] == "ok" and float(r["final_loss"]) > 0 and float(r["final_val_loss"]) > 0
               for r in rows.values())
    assert rows["optimizer=adamw"]["final_loss"] != rows["optimizer=muon"]["final_loss"]
    assert "optimizer=muon" in (tmp_path / "report.md").read_text()

"""Balanced pipeline stages (titan_exp.perf.search.stages): the planner picks how many blocks each
stage holds, the output and loss counted as the work they are, and gives the pair as overrides.
Its measurement on CPU is benchmarks/bench_stages.py."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from conftest import job_config

from titan_exp.config import AutotuneAxis
from titan_exp.parallel.pipeline import RankLoad, stage_split
from titan_exp.perf import autotune
from titan_exp.perf import plan as plan_cli
from titan_exp.perf.model import step
from titan_exp.perf.model.comm import StepShape, inline_comm
from titan_exp.perf.model.engine import TITAN_EXP
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates.devices import SPECS, spec_profile
from titan_exp.perf.rates.kernels import spec_kernels
from titan_exp.perf.rates.profile import BlockCost, Line, MachineProfile, machine_key, model_shape
from titan_exp.perf.search import layouts, planner, stages
from titan_exp.validation import resolve, validate

PP4 = ["model=llama3_8b", "training.seq_len=8192", "parallelism.pipeline_parallel_degree=4",
       "parallelism.data_parallel_shard_degree=2", "training.local_batch_size=8", "cluster=slurm",
       "cluster.nproc_per_node=8", "cluster.gpus_per_node=8"]
FIELDS = ("parallelism.pipeline_parallel_first_stage_less_layers",
          "parallelism.pipeline_parallel_last_stage_less_layers")


def h100(world: int):
    return spec_profile(SPECS["h100"], world, min(world, 8))


def blocks(job) -> list[int]:
    return [len(r) for r in stage_split(job.parallelism, job.model.n_layers)]


@pytest.mark.quick
def test_a_heavy_output_gets_fewer_blocks_and_the_pick_is_the_fastest_valid_pair():
    """Llama 3 8B at pp 4: its output projection and loss at a 128k vocabulary weigh over two
    blocks, so the even 8/8/8/8 split's last stage is the slowest; the chooser gives the last stage
    fewer blocks, and its pick is the fastest of every pair the validator accepts, as predict_step
    prices each."""
    job = resolve(job_config(PP4))
    profile = h100(8)
    chosen = stages.choose(job, profile, cuda=True)
    assert chosen is not None and sum(chosen.blocks) == 32
    assert chosen.blocks[-1] < max(chosen.blocks) and chosen.blocks != (8, 8, 8, 8)
    even = predict_step(job, profile, cuda=True).step_s
    assert chosen.step_s < 0.95 * even
    brute = {}
    for first, last in itertools.product(range(12), repeat=2):
        candidate = stages.with_pair(job, first, last)
        if not validate(candidate, cuda=True):
            brute[(first, last)] = predict_step(candidate, profile, cuda=True).step_s
    best = min(brute.values())
    assert chosen.step_s == pytest.approx(best, rel=1e-9)
    assert brute[(chosen.first_less, chosen.last_less)] == pytest.approx(best, rel=1e-9)
    assert blocks(stages.balanced(job, profile, cuda=True)) == list(chosen.blocks)


@pytest.mark.quick
def test_negligible_ends_keep_the_even_split():
    """The same model with a 2k vocabulary: its output is a sliver of a block, so 8/8/8/8 stays,
    and at the pair that counts no block for either end."""
    job = resolve(job_config([*PP4, "model.vocab_size=2048"]))
    chosen = stages.choose(job, h100(8), cuda=True)
    assert (chosen.first_less, chosen.last_less, chosen.blocks) == (0, 0, (8, 8, 8, 8))


@pytest.mark.quick
def test_only_a_split_that_fits_is_chosen():
    """With a memory limit the fastest split does not meet, the fastest that does is chosen."""
    job = resolve(job_config(PP4))
    profile = h100(8)
    priced = stages.priced_splits(job, profile, cuda=True)[: stages.MEMORY_TRIES]
    memory = [predict_memory(stages.with_pair(job, s.first_less, s.last_less), cuda=True)["total"] for s in priced]
    limit = memory[0] - 0.01
    fitting = [s for s, gib in zip(priced, memory) if gib <= limit]
    assert fitting, memory  # some split needs less than the fastest one
    assert stages.choose(job, profile, cuda=True, memory_gib=limit) == fitting[0]


@pytest.mark.quick
def test_the_chosen_overrides_validate_and_give_the_chosen_split():
    job = resolve(job_config(PP4))
    chosen = stages.balanced(job, h100(8), cuda=True)
    overrides = layouts.layout_overrides(chosen)
    pair = [o for o in overrides if o.startswith(FIELDS)]
    assert len(pair) == 2 and pair != [f"{FIELDS[0]}=0", f"{FIELDS[1]}=0"]
    launched = job_config([*PP4, *overrides])
    assert validate(launched, cuda=True) == []
    assert blocks(launched) == blocks(chosen)
    assert not any(o.startswith(FIELDS) for o in layouts.layout_overrides(job_config(PP4[:2])))  # no PP: none


def test_the_plan_gives_every_pipeline_its_pair_and_keeps_the_users():
    """Every PP row of the plan carries the chooser's pair in its overrides and in the command the
    plan prints; where the user set the pair, every row keeps it."""
    base = ["model=llama3_8b", "training.seq_len=8192", "training.local_batch_size=4", "cluster=slurm",
            "cluster.nproc_per_node=4", "cluster.gpus_per_node=4"]
    profile = h100(4)
    plans = planner.plan(job_config(base), 4, device_memory_gib=80.0, cuda=True, profile=profile)
    piped = [pl for pl in plans if pl.degrees["pp"] > 1]
    assert piped
    for pl in piped:
        chosen = stages.choose(stages.with_pair(pl.job, 0, 0), profile, cuda=True, memory_gib=80.0)
        assert [f"{FIELDS[0]}={chosen.first_less}", f"{FIELDS[1]}={chosen.last_less}"] == [
            o for o in pl.overrides if o.startswith(FIELDS)]
        assert pl.step.step_s == pytest.approx(predict_step(pl.job, profile, cuda=True).step_s)
    uneven = next(pl for pl in piped if pl.job.parallelism.pipeline_parallel_last_stage_less_layers > 0)
    printed = "\n".join(plan_cli.launch_lines([uneven], 0, base, job_config(base), "h100"))
    assert f"{FIELDS[1]}={uneven.job.parallelism.pipeline_parallel_last_stage_less_layers}" in printed
    mine = [*base, f"{FIELDS[1]}=3"]
    kept = planner.plan(job_config(mine), 4, device_memory_gib=80.0, cuda=True, profile=profile)
    assert all(f"{FIELDS[0]}=0" in pl.overrides and f"{FIELDS[1]}=3" in pl.overrides
               for pl in kept if pl.degrees["pp"] > 1)


def test_autotune_candidates_carry_the_pair():
    job = job_config(["model=llama3_8b", "training.seq_len=8192", "cluster=slurm", "cluster.nproc_per_node=2",
                      "cluster.gpus_per_node=2", f"autotune.search=[{AutotuneAxis.layout.value}]"])
    grid = autotune.candidates(job, 2, cuda=True, profile=h100(2), memory_gib=80.0)
    piped = [c for c in grid if c.job.parallelism.pipeline_parallel_degree > 1]
    assert piped and all(sum(o.startswith(FIELDS) for o in c.overrides) == 2 for c in piped)
    assert any(c.job.parallelism.pipeline_parallel_last_stage_less_layers > 0 for c in piped)


@pytest.mark.quick
def test_the_critical_path_runs_the_fill_and_drain_through_each_rank_once():
    """The schedule's critical path: microbatches at the slowest rank's period, and the fill and
    drain through the other ranks at their own (b / v of it): equal periods give TorchTitan's
    (microbatches + pp - 1) x period, a light rank adds its own period, not the slowest one's."""
    job = resolve(job_config(PP4))
    s = StepShape.of(job, h100(8), True)
    assert s.n_mb == 8 and s.pp == 4
    assert step.critical_path(s, [1.0] * 4) == pytest.approx(8 + 3)
    assert step.critical_path(s, [2.0, 1.0, 1.0, 0.5]) == pytest.approx(8 * 2 + 2.5)
    zero_bubble = resolve(job_config([*PP4, "parallelism.pipeline_parallel_schedule=ZBVZeroBubble"]))
    zs = StepShape.of(zero_bubble, h100(8), True)
    assert zs.loads[0].stages == 2
    assert step.critical_path(zs, [1.0] * 4) == pytest.approx(zs.n_mb + 0.5 * 3 / 2)


@pytest.mark.quick
def test_a_cpu_head_leaves_the_embedding_gradient_on_the_first_stage():
    """On a CPU the measured head (a one-block model less its block) holds the embedding: its dense
    fp32 gradient's four passes over the table (embedding_s) run on the first stage, the rest of
    the head on the last, and one process runs both, as before the split."""
    job = resolve(job_config(["model=debugmodel", "model.vocab_size=32768", "model.n_layers=4",
                              "training.seq_len=256", "parallelism.pipeline_parallel_degree=2",
                              "training.local_batch_size=4", "parallelism.pipeline_parallel_microbatch_size=1"]))
    kernels = dataclasses.replace(spec_kernels(SPECS["h100"]), architecture="cpu", memory_tb_s=0.01)
    head = Line(0.0, 0.2)
    cost = {1: BlockCost(Line(0.0, 0.005), Line(0.0, 0.015), head)}
    profile = MachineProfile(key=machine_key("cpu", "gloo", 2, 1), concurrency=2.0, blocks={model_shape(job): cost},
                             gemm={"float32": Line(0.0, 1e-11)}, kernels=kernels)
    s = StepShape.of(job, profile, False)
    work = step.block_work(s, TITAN_EXP, [])
    m = job.model
    assert work.embedding == pytest.approx(4 * m.vocab_size * m.dim * 4 / 0.01e12)
    assert 0 < work.embedding < work.head == pytest.approx(0.2)
    per_mb = step.pipeline_schedule(s, work, inline_comm(s, work, False, False), 1).per_mb
    assert per_mb == pytest.approx([2 * work.block + work.embedding, 2 * work.block + work.head - work.embedding])
    one = dataclasses.replace(s, loads=[RankLoad(1, 4, True, True)])
    assert step.pipeline_schedule(one, work, inline_comm(one, work, False, False), 1).per_mb == pytest.approx(
        [sum(per_mb)])

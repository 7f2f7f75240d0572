"""The GPU model's communication (titan_exp/perf/model/comm.py, perf/overlap.py, issue 36): what
the schedule hides of FSDP, async TP, the pipeline's sends and EP, NCCL's latencies, groups that
span nodes. Arithmetic only."""

from __future__ import annotations

import pytest
from gpu_model_jobs import H100, llama8b, olmoe_job

from titan_exp.config import compose_job
from titan_exp.perf.model import overlap
from titan_exp.perf.model.comm import StepShape, inline_comm
from titan_exp.perf.model.engine import TITAN_EXP, Engine
from titan_exp.perf.model.placement import across_nodes, node_ranks
from titan_exp.perf.model.step import block_work, pipeline_schedule, predict_step
from titan_exp.perf.rates.devices import spec_profile
from titan_exp.validation import resolve

pytestmark = pytest.mark.quick


def test_fsdp_and_async_tp_hide_what_the_schedule_lets_them():
    assert overlap.fsdp_exposed(1.0, 0.5, 2, fwd_s=0.4, bwd_s=1.0, blocks=3, ends_s=0.1) == pytest.approx(
        0.1 + 1.0 + 2 * 0.6 + 3 * 0.5)
    assert overlap.fsdp_exposed(1.0, 0.5, 1, fwd_s=2.0, bwd_s=2.0, blocks=3, ends_s=0.0) == pytest.approx(1.0)
    # groups q/k/v, o, w1/w3, w2; all-gathers of 1.0 (forward 0.5: float8), reduce-scatters of 0.8
    groups = (0.7, 0.3, 2.0, 1.0)
    forward, backward = overlap.async_tp_exposed(0.5, 1.0, 0.8, groups, partials_s=0.05)
    assert forward == pytest.approx((0.8 - 0.3) + 2 * 0.05)  # rs outlasts o's GEMM; the partials' sums
    assert backward == pytest.approx((1.0 - 0.3) + 0.0 + 2 * 0.8)  # ag with o's, w2's GEMMs; summed rs unfused
    te = overlap.async_tp_exposed(0.5, 1.0, 0.8, groups, partials_s=0.05, overlap="userbuffers")
    assert te == pytest.approx((0.8 - 0.3, (1.0 - 0.7) + (0.8 - 0.3)))  # every collective beside a GEMM
    with pytest.raises(ValueError, match="overlap 'nccl'"):
        overlap.async_tp_exposed(0.5, 1.0, 0.8, groups, 0.05, overlap="nccl")
    tp = ["parallelism.data_parallel_shard_degree=4", "parallelism.tensor_parallel_degree=2",
          "training.local_batch_size=8"]
    plain = predict_step(llama8b(*tp), spec_profile(H100, 8, 8), cuda=True)
    fused = predict_step(llama8b(*tp, "parallelism.enable_async_tensor_parallel=true", "compile.enable=true"),
                         spec_profile(H100, 8, 8), cuda=True)
    assert 0 <= fused.parts["tp"] < 0.8 * plain.parts["tp"]
    engine = predict_step(llama8b(*tp, "parallelism.enable_async_tensor_parallel=true", "compile.enable=true"),
                          spec_profile(H100, 8, 8), cuda=True, engine=Engine(tp_overlap="userbuffers"))
    assert engine.parts["tp"] < fused.parts["tp"]  # torch's pass leaves the backward's summed gradients unfused


def test_pipeline_sends_wait_in_the_fill_and_drain_and_where_they_outlast_a_chunk():
    # 4 stages, 16 sends a round: hidden behind chunks of 2.0 s, only the fill's and drain's 2 x 3 wait
    assert overlap.p2p_exposed(0.5, 4, 16, chunk_fwd_s=2.0) == pytest.approx(2 * 3 * 0.5)
    assert overlap.p2p_exposed(0.5, 4, 16, chunk_fwd_s=0.2) == pytest.approx(2 * 3 * 0.5 + 16 * 0.3)
    pp = ["parallelism.data_parallel_shard_degree=2", "parallelism.pipeline_parallel_degree=4",
          "parallelism.pipeline_parallel_microbatch_size=1", "training.local_batch_size=8"]
    profile = spec_profile(H100, 8, 8)
    step = predict_step(llama8b(*pp), profile, cuda=True)
    send = profile.collective("send_recv", 2)(1 * 8192 * 4096 * 2)  # a microbatch's bf16 activations, NVLink
    assert step.parts["p2p"] == pytest.approx(2 * 3 * send)  # 8 microbatches' 16 sends hide behind 8 layers each
    assert step.parts["p2p"] < 16 * send  # what waiting on every send would cost


def test_collectives_inside_a_stages_blocks_lengthen_the_pipelines_fill_and_drain_too():
    """TP's collectives run inside every microbatch of a stage, so a microbatch reaches the next
    stage as late as they make it: the fill and drain run through each other rank's microbatch
    with them, not its compute alone (on a GPU priced from its parts)."""
    job = llama8b("parallelism.data_parallel_shard_degree=1", "parallelism.tensor_parallel_degree=2",
                  "parallelism.pipeline_parallel_degree=4", "parallelism.pipeline_parallel_microbatch_size=1",
                  "training.local_batch_size=8", "training.global_batch_size=8")
    profile = spec_profile(H100, 8, 8)
    parts = predict_step(job, profile, cuda=True).parts
    s = StepShape.of(job, profile, True)
    work = block_work(s, TITAN_EXP, [])
    schedule = pipeline_schedule(s, work, inline_comm(s, work, TITAN_EXP.tp_overlap, TITAN_EXP.ep_overlap), 1)
    assert parts["tp"] > 0.02 * parts["compute"]
    assert all(period > compute for period, compute in zip(schedule.period, schedule.per_mb))
    ends_last = max(range(4), key=lambda r: schedule.period[r])
    assert parts["bubble"] == pytest.approx(sum(schedule.period) - schedule.period[ends_last])


def test_a_pipeline_steps_at_its_slowest_ranks_pace_with_each_ranks_own_communication():
    """The critical path is the slowest rank's compute; each rank adds its own communication, and
    the step is the rank that ends last. OLMoE's 16 MoE blocks over PP 4 and EP 16 across two
    nodes, the last stage a block short: a middle rank has the most blocks and all-to-alls. Give
    the last stage more passes through the output head (a published model's multi-token
    prediction runs it more than once: output_heads): while it is lighter than a middle rank, a
    pass lengthens the fill and drain once; from the fourth, the last rank sets the pace and a
    pass costs every microbatch (8). The middle rank, waiting as long and exchanging a block's more
    tokens, still ends last."""
    job = resolve(compose_job(["model=olmoe_1b_7b", "precision=bf16", "training.seq_len=4096",
                               "training.local_batch_size=8", "training.global_batch_size=32",
                               "parallelism.data_parallel_shard_degree=4", "parallelism.pipeline_parallel_degree=4",
                               "parallelism.pipeline_parallel_microbatch_size=1",
                               "parallelism.expert_parallel_degree=4",
                               "parallelism.pipeline_parallel_last_stage_less_layers=1", "cluster.executor=slurm",
                               "cluster.nnodes=2", "cluster.nproc_per_node=8"]))
    profile = spec_profile(H100, 16, 8)
    steps = [predict_step(job, profile, cuda=True, engine=Engine(output_heads=h)) for h in (1, 2, 3, 4)]
    head = steps[1].step_s - steps[0].step_s  # a pass through the head, once in the fill and drain
    assert head > 0 and steps[3].step_s - steps[2].step_s == pytest.approx(8 * head)  # every microbatch's
    for later in steps[1:]:
        assert later.parts["ep"] == pytest.approx(steps[0].parts["ep"]) and later.parts["compute"] == pytest.approx(
            steps[0].parts["compute"])  # a middle rank's 4 blocks, their all-to-alls among them, end the step
        assert later.step_s - steps[0].step_s == pytest.approx(later.parts["bubble"] - steps[0].parts["bubble"])


def test_a_spec_sheets_collectives_take_nccls_latencies_and_its_fastest_protocol():
    """perf.rates.nccl: NCCL's tuner's latencies, base + steps x a step's, Simple's for large messages;
    small ones take LL (a quarter of the bandwidth), an all-reduce across nodes a tree. An 8-GPU
    all-reduce of 4 bytes costs LL's 15 us, where 2 x 7 steps of 10 us once priced it at 140 us."""
    inside, across = spec_profile(H100, 8, 8), spec_profile(H100, 16, 8)
    ar = inside.collective("all_reduce", 8)
    assert ar.latency_s == pytest.approx(8.4e-6 + 14 * 3.4e-6)  # Simple's ring: what a large message pays
    assert ar(4) == pytest.approx(6.6e-6 + 14 * 0.6e-6, rel=1e-3)  # LL's ring
    assert ar(1e9) == pytest.approx(ar.latency_s + 1e9 * ar.per_unit_s)  # Simple's, at the links' bandwidth
    tree = across.collective("all_reduce", 16, True, 8)  # 2 nodes of 8: LL's tree, 2 (7 x 0.6 + 1 x 5) us
    assert tree(4) == pytest.approx(6.8e-6 + 2 * (7 * 0.6e-6 + 5e-6), rel=1e-3)
    gather = inside.collective("all_gather", 8)
    assert gather(1 << 20) < gather.latency_s + (1 << 20) * gather.per_unit_s  # 1 MiB: LL128's, not Simple's
    a2a = across.collective("all_to_all", 16, True, 8)  # a step a peer: 7 inside the node, 8 on the other
    assert a2a.latency_s == pytest.approx(8.4e-6 + 7 * 3.4e-6 + 8 * 14e-6)
    assert a2a(8 * 128) == pytest.approx(6.6e-6 + 7 * 0.6e-6 + 8 * 2.7e-6, rel=1e-2)  # EP's counts: LL's steps
    assert inside.collective("send_recv", 2).latency_s == pytest.approx(8.4e-6 + 3.4e-6)


def test_a_group_spanning_nodes_sends_through_each_of_its_gpus_nics():
    """NCCL's rings leave a node through the NIC of each GPU the group has there: FSDP over 2 full
    nodes moves its bytes 8 x faster than through one NIC (but no faster than NVLink); HSDP's
    replicas, one rank per node, through one."""
    two_nodes = ["cluster.nnodes=2", "cluster.nproc_per_node=8"]
    fsdp16 = llama8b(*two_nodes, "parallelism.data_parallel_shard_degree=16", "training.global_batch_size=32")
    hsdp = llama8b(*two_nodes, "parallelism.data_parallel_shard_degree=8",
                   "parallelism.data_parallel_replicate_degree=2", "training.global_batch_size=32")
    tp2 = llama8b(*two_nodes, "parallelism.data_parallel_shard_degree=8", "parallelism.tensor_parallel_degree=2",
                  "training.global_batch_size=16")
    assert (node_ranks(fsdp16, ("dp_shard", "cp")), node_ranks(hsdp, ("dp_replicate",)),
            node_ranks(hsdp, ("dp_shard", "cp")), node_ranks(tp2, ("dp_shard", "cp")),
            node_ranks(tp2, ("tp",))) == (8, 1, 8, 4, 2)
    profile = spec_profile(H100, 16, 8)
    one_nic = profile.collective("all_gather", 16, True)
    eight = profile.collective("all_gather", 16, True, 8)
    nvlink = profile.collective("all_gather", 16).per_unit_s
    assert eight.per_unit_s == pytest.approx(max(one_nic.per_unit_s / 8, nvlink))
    assert eight.per_unit_s < one_nic.per_unit_s / 7
    # NCCL's ring latency (perf.rates.nccl): 1 of 15 steps between the 2 nodes, against all 15 one to a node
    assert (eight.latency_s, one_nic.latency_s) == pytest.approx((8.4e-6 + 14 * 3.4e-6 + 14e-6, 8.4e-6 + 15 * 14e-6))
    # An all-to-all of 16 ranks over 2 nodes sends half of each rank's bytes off its node, through
    # its own NIC, as 2 ranks one to a node do (priced once as 16 nodes' 15/16: 1.9 x too slow).
    a2a = profile.collective("all_to_all", 16, True, 8)
    assert a2a.per_unit_s == pytest.approx(profile.collective("all_to_all", 2, True).per_unit_s)
    assert a2a.per_unit_s < profile.collective("all_to_all", 16, True).per_unit_s / 1.8
    inside = predict_step(llama8b(), spec_profile(H100, 8, 8), cuda=True)
    across = predict_step(fsdp16, profile, cuda=True)
    assert (across.parts["fsdp"] < 0.05 * across.step_s
            and across.tokens_per_s_per_device > 0.95 * inside.tokens_per_s_per_device)


def test_hsdp_all_reduces_each_blocks_gradient_beside_the_backward():
    """FSDP2 all-reduces a block's gradient shard over the replicas right after its reduce-scatter,
    beside the backward of the blocks before it: of the 8B's HSDP over two nodes only the
    embedding's and the output's all-reduces wait (until 2026-11-28 every unit's did)."""
    hsdp = llama8b("cluster.nnodes=2", "cluster.nproc_per_node=8", "parallelism.data_parallel_shard_degree=8",
                   "parallelism.data_parallel_replicate_degree=2", "training.global_batch_size=32")
    profile = spec_profile(H100, 16, 8)
    ar = profile.collective("all_reduce", 2, True, 1)  # one replica per node: each through its own NIC
    m = hsdp.model
    ends = ar(m.embedding_params / 8 * 4) + ar(m.output_params / 8 * 4)
    blocks = m.n_layers * ar(m.block_params / 8 * 4)
    assert predict_step(hsdp, profile, cuda=True).parts["hsdp"] == pytest.approx(ends) and blocks > 5 * ends


def test_expert_parallel_stays_in_a_node_however_far_data_parallel_reaches():
    """EP's group is dp_shard's innermost ranks (parallel/dims.py): EP 8 over two nodes of 8 keeps
    its all-to-alls on NVLink, as on one node; EP 16 sends them over the network. (They were once
    priced over the network whenever dp_shard spanned nodes: Megatron-Bridge's GPT-OSS 120B rows,
    EP 8 on 64 B200s, predicted 64 % too slow.)"""
    def olmoe(gpus: int, ep: int):
        return resolve(compose_job(["model=olmoe_1b_7b", "precision=bf16", "training.seq_len=4096",
                                    "training.local_batch_size=2", f"training.global_batch_size={2 * gpus}",
                                    f"parallelism.data_parallel_shard_degree={gpus}",
                                    f"parallelism.expert_parallel_degree={ep}", "cluster.executor=slurm",
                                    f"cluster.nnodes={gpus // 8}", "cluster.nproc_per_node=8"]))
    one_node = predict_step(olmoe(8, 8), spec_profile(H100, 8, 8), cuda=True).parts["ep"]
    two_nodes = spec_profile(H100, 16, 8)
    assert predict_step(olmoe(16, 8), two_nodes, cuda=True).parts["ep"] == pytest.approx(one_node)
    assert predict_step(olmoe(16, 16), two_nodes, cuda=True).parts["ep"] > 3 * one_node
    # the plan's "across nodes" column names EP's group where it leaves its node
    assert across_nodes(olmoe(16, 8)) == {"dp_shard"} and across_nodes(olmoe(16, 16)) == {"dp_shard", "ep"}


def test_an_engine_that_pairs_microbatches_hides_eps_all_to_alls_behind_the_other_ones_compute():
    """perf.model.overlap.ep_exposed (Megatron-Core's overlap_moe_expert_parallel_comm): a forward's
    all-to-alls beside the paired backward's compute, a backward's beside the forward's; the first
    forward and the last backward wait in full. This toolkit's EP, unpaired, waits in full."""
    # 4 microbatches: 0.3 s of forward all-to-alls behind 2.0 s of backward hide; 0.3 s of
    # backward ones behind a 0.1 s forward leave 0.2; the unpaired ends wait 0.3 + 0.3
    assert overlap.ep_exposed(0.3, 0.3, 0.1, 2.0, 4) == pytest.approx((3 * 0.2 + 0.6) / 4)
    assert overlap.ep_exposed(0.3, 0.3, 1.0, 2.0, 1) == pytest.approx(0.6)  # one microbatch: nothing to pair
    with pytest.raises(ValueError, match="microbatches = 0"):
        overlap.ep_exposed(0.3, 0.3, 1.0, 2.0, 0)
    job = olmoe_job(8, "training.global_batch_size=64")  # 8 microbatches a rank
    profile = spec_profile(H100, 8, 8)
    alone, paired = (predict_step(job, profile, cuda=True, engine=Engine(ep_overlap=o)) for o in (False, True))
    # OLMoE's blocks outlast their all-to-alls on NVLink: only the unpaired ends' wait, 1/8 of them
    assert paired.parts["ep"] == pytest.approx(alone.parts["ep"] / 8)
    assert paired.step_s == pytest.approx(alone.step_s - 7 / 8 * alone.parts["ep"], rel=1e-6)
    # a block not priced from a GPU's parts (a CPU's, gloo's) pairs nothing
    assert (predict_step(job, profile, cuda=False, engine=Engine(ep_overlap=True)).parts["ep"]
            == predict_step(job, profile, cuda=False).parts["ep"])

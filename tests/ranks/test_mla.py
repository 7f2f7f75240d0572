"""Multi-head latent attention (DeepSeek-V3's MLA, titan_exp.models.mla).

In one process: the layer against a plainly written reference (forward and gradients), DeepSeek-V3's
published parameter counts, and the validation rules. Then real gloo runs of the tiny DeepSeek-V3
(MLA and MoE): tensor (the latents whole on every rank, the shared RoPE key's gradient summed over
the ranks' heads), context, pipeline and expert parallel runs give one process's losses and
gradient norms (fp32); tests/test_parallel.py checks every parameter's gradient under TP.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import SMALL, job_config, run_job

slow = pytest.mark.slow

MLA = [*SMALL, "model=deepseek_v3_debug", "training.steps=4"]
W2 = ["cluster.nproc_per_node=2", "training.local_batch_size=4"]
W4 = ["cluster.nproc_per_node=4", "training.local_batch_size=2"]
Q_DIRECT = ["model.q_lora_rank=0"]  # queries straight from the hidden state (DeepSeek-V2-Lite's)
LAYOUTS = {  # name -> (model overrides, layout overrides); every one must equal its model's single process
    "tp2": ([], ["parallelism=tp", *W2]),
    "cp2_tp2": ([], ["parallelism=cp", "parallelism.tensor_parallel_degree=2", *W4]),
    "pp2_tp2_ep2": ([], ["parallelism=pp", "parallelism.tensor_parallel_degree=2",
                         "parallelism.expert_parallel_degree=2", *W4]),
    "fsdp2_tp2_queries_from_the_hidden_state": (Q_DIRECT, ["parallelism=2d", *W4]),
}
FAST = ("tp2",)  # MLA under CP x TP is slow, as test_parallel's cp2_tp2 is


def _layer(q_lora_rank: int):
    from titan_exp.config.model import ModelConfig
    from titan_exp.models.mla import LatentAttention

    cfg = ModelConfig(dim=32, n_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=8, qk_nope_head_dim=6,
                      qk_rope_head_dim=4, v_head_dim=5)
    torch.manual_seed(0)
    layer = LatentAttention(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _reference(layer, x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """MLA written out: every head's query and key from the latents, RoPE on the last 4 entries
    as complex numbers, causal softmax, values from the latent."""
    w = {name: p for name, p in layer.named_parameters()}

    def rms(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + torch.finfo(t.dtype).eps) * weight

    def rotate(t, pos):  # t (..., 4): pairs (t0, t1), (t2, t3) as complex numbers
        freqs = theta ** (-torch.arange(0, 4, 2, dtype=torch.float64) / 4)
        turn = torch.polar(torch.ones(2, dtype=torch.float64), pos * freqs).to(torch.complex64)
        return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], 2, 2).contiguous()) * turn).flatten(-2)

    seq = x.shape[1]
    q_in = (rms(x @ w["wq_a.weight"].T, w["q_norm.weight"]) @ w["wq_b.weight"].T if "wq_a.weight" in w
            else x @ w["wq.weight"].T)
    q = q_in.view(1, seq, 4, 10)
    down = x @ w["wkv_a.weight"].T
    up = (rms(down[..., :8], w["kv_norm.weight"]) @ w["wkv_b.weight"].T).view(1, seq, 4, 11)
    out = torch.zeros(1, seq, 4, 5)
    for h in range(4):
        scores = torch.full((seq, seq), float("-inf"))
        for i in range(seq):
            qi = torch.cat([q[0, i, h, :6], rotate(q[0, i, h, 6:], i)])
            for j in range(i + 1):
                kj = torch.cat([up[0, j, h, :6], rotate(down[0, j, 8:], j)])
                scores[i, j] = qi @ kj / math.sqrt(10)
        out[0, :, h] = scores.softmax(-1) @ up[0, :, h, 6:]
    return out.reshape(1, seq, 20) @ w["wo.weight"].T


@pytest.mark.quick
@pytest.mark.parametrize("q_lora_rank", [0, 12])
def test_latent_attention_equals_mla_written_out(q_lora_rank):
    """Queries from the hidden state or from their latent; the key's RoPE part shared by the
    heads; values narrower than queries and keys: forward and every gradient as the reference."""
    from titan_exp.models.layers import rope_tables

    layer = _layer(q_lora_rank)
    x = torch.randn(1, 7, 32, requires_grad=True)
    cos, sin = rope_tables(4, 16, 10000.0)
    out = layer(x, cos, sin)
    ref = _reference(layer, x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *layer.parameters()])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.quick
def test_deepseek_v3_has_its_published_parameter_counts_and_flops():
    """conf/model/deepseek_v3_671b.yaml: 671B parameters, 37B active (the model card's, MTP's 14B
    aside); attention's FLOPs per token count the query/key width plus the value width."""
    from titan_exp.models.llama import flops_per_token

    m = job_config(["model=deepseek_v3_671b"]).model
    assert m.num_params == pytest.approx(671e9, rel=0.005) and m.active_params == pytest.approx(37e9, rel=0.02)
    assert (m.head_size, m.v_head_size, m.rope_dim, m.kv_heads) == (192, 128, 64, 128)
    scores = flops_per_token(m, 4096) - flops_per_token(m, 0)
    assert scores == 6 * 61 * 128 * (192 + 128) * 4096
    # under TP the latents' projections stay whole, as the router does; the rest is split
    whole = m.latent_params + m.router_params_per_block
    assert m.latent_params == 7168 * (1536 + 512 + 64) + 1536 + 512
    assert m.block_matmul_params(8) - whole == pytest.approx((m.block_matmul_params(1) - whole) / 8)


@pytest.mark.quick
@pytest.mark.parametrize("overrides, message", [
    (["model.qk_rope_head_dim=64"], "model.qk_rope_head_dim = 64: is used only by multi-head latent attention"),
    (["model.q_lora_rank=64"], "model.q_lora_rank = 64: is used only by multi-head latent attention"),
    (["model=deepseek_v3_debug", "model.v_head_dim=null"], "model.v_head_dim = None: multi-head latent attention"),
    (["model=deepseek_v3_debug", "model.qk_rope_head_dim=7"], "model.qk_rope_head_dim = 7: must be even"),
    (["model=deepseek_v3_debug", "model.head_dim=32"], "model.head_dim = 32: multi-head latent attention sizes"),
    (["model=deepseek_v3_debug", "model.n_kv_heads=4"], "model.n_kv_heads = 4: multi-head latent attention gives"),
    (["model=deepseek_v3_debug", "checkpoint=default", "checkpoint.last_save_in_hf=true"],
     "checkpoint.last_save_in_hf = True: Hugging Face export writes Llama, Qwen3 and Qwen3-MoE models; a model with "
     "multi-head latent attention (model.kv_lora_rank > 0), routed experts without QK-norm"),
    (["model=deepseek_v3_debug", "checkpoint=default", "checkpoint.initial_load_in_hf=true",
      "checkpoint.initial_load_path=/tmp"], "checkpoint.initial_load_in_hf = True: Hugging Face loading reads Llama, "
                                               "Qwen3"),
    (["model=deepseek_v3_debug", "precision=float8", "model.kv_lora_rank=40"],
     "model.kv_lora_rank = 40 is not divisible by 16"),
])
def test_mla_fields_are_checked_before_any_rank_starts(overrides, message):
    from titan_exp.validation import validate

    errors = validate(job_config(overrides), cuda=True)
    assert any(message in e for e in errors), errors


# -- gloo ranks ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process's run of each model the layouts train (cached by its overrides)."""
    runs: dict[tuple[str, ...], dict] = {}

    def run(model: list[str]) -> dict:
        if tuple(model) not in runs:
            code, summary = run_job([*MLA, *model], tmp_path_factory.mktemp("mla_single"))
            assert code == 0 and summary["status"] == "ok", summary and summary.get("error")
            runs[tuple(model)] = summary
        return runs[tuple(model)]

    return run


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in FAST else slow) for n in LAYOUTS])
def test_mla_layouts_equal_one_process(name, single, tmp_path):
    model, layout = LAYOUTS[name]
    code, summary = run_job([*MLA, *model, *layout], tmp_path)
    assert code == 0 and summary["status"] == "ok", summary and summary.get("error")
    reference = single(model)
    assert summary["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert summary["grad_norms"] == pytest.approx(reference["grad_norms"], rel=3e-4)


@pytest.mark.quick
def test_a_gpu_prices_mla_from_its_parts():
    """On a GPU's kernel rates (a spec sheet's here) the step model prices MLA's own parts: its
    down-projections whole on every TP rank and the rest split by heads; attention's FLOPs over the
    query/key and the value widths; CP's K and V at their widths. The memory model counts its saves."""
    from titan_exp.perf.model import block as gpu
    from titan_exp.perf.model.memory import predict_memory
    from titan_exp.perf.model.shapes import attention_on_rank
    from titan_exp.perf.model.step import predict_step
    from titan_exp.perf.rates import kernels as rates
    from titan_exp.perf.rates.devices import SPECS, spec_profile

    job = job_config(["model=deepseek_v3_debug", "training.seq_len=1024", "training.global_batch_size=8"])
    m, h100 = job.model, SPECS["h100"]
    assert attention_on_rank(m, 2) == {"attention.wq_a": (256, 128), "attention.wq_b": (128, 8 * 64 / 2),
                                       "attention.wkv_a": (256, 64 + 32), "attention.wkv_b": (64, 8 * (32 + 32) / 2),
                                       "attention.wo": (8 * 32 / 2, 256)}
    kern = rates.spec_kernels(h100, "flash")
    wide = job_config(["model=deepseek_v3_debug", "training.seq_len=1024", "model.v_head_dim=96"])
    narrow, wider = (gpu.block_times(j, 1, kern).kinds["fwd"]["attention"] for j in (job, wide))
    assert wider / narrow == pytest.approx((64 + 96) / (64 + 32))  # q k^T over 64 wide heads, then the values
    profile = spec_profile(h100, 4, 4)
    cp = job_config(["model=deepseek_v3_debug", "training.seq_len=1024", "parallelism.context_parallel_degree=2",
                     "cluster.nproc_per_node=2"])
    cp_wide = job_config(["model=deepseek_v3_debug", "training.seq_len=1024", "model.v_head_dim=96",
                          "parallelism.context_parallel_degree=2", "cluster.nproc_per_node=2"])
    assert predict_step(cp_wide, profile, cuda=True).parts["cp"] > predict_step(cp, profile, cuda=True).parts["cp"]
    assert predict_step(job, profile, cuda=True).tokens_per_s_per_device > 0
    more_heads = job_config(["model=deepseek_v3_debug", "training.seq_len=1024", "model.n_heads=16"])
    assert predict_memory(more_heads, cuda=True)["activations"] > predict_memory(job, cuda=True)["activations"]


@slow  # calibration x MLA: the default tier calibrates in test_perf and prices MLA's parts above
def test_this_machine_calibrates_an_mla_block_and_plans_on_it(tmp_path, capsys):
    """A real 2-rank calibration measures the MLA model's own block (measure_compute.sharded_block:
    one TP rank's heads, its latents' projections whole) under a shape of its own, not a GQA
    model's of the same widths; the plan on this machine then ranks its layouts on it."""
    import json
    import subprocess
    import sys

    from titan_exp.perf.plan import main as plan
    from titan_exp.perf.rates.profile import model_shape

    tiny = ["model=deepseek_v3_debug", "model.n_layers=2", "training.seq_len=64"]
    subprocess.run([sys.executable, "-m", "titan_exp.perf.calibrate", *tiny, "--world", "2", "--tiny",
                    "--profile-dir", str(tmp_path)], check=True, capture_output=True, text=True, timeout=600)
    (path,) = tmp_path.glob("*-w2-*.json")
    blocks = json.loads(path.read_text())["blocks"]
    shape = model_shape(job_config(tiny))
    assert "-mla64q128n32r32v32-" in shape and set(blocks) == {shape}
    assert {"1", "2"} <= set(blocks[shape])  # tp 1 and tp 2
    gqa = job_config([*tiny, "model.kv_lora_rank=0", "model.q_lora_rank=0", "model.qk_nope_head_dim=null",
                      "model.qk_rope_head_dim=null", "model.v_head_dim=null"])
    assert model_shape(gqa) != shape
    assert plan([*tiny, "--world", "2", "--profile-dir", str(tmp_path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "valid layouts on 2 devices" in out and "(the 3 fastest shown)" in out and "not calibrated" not in out


def test_a_dry_run_of_mla_measures_what_the_planner_predicts():
    """The memory model's MLA (its saves, latent_attention_saved) beside a real step's on two gloo
    ranks under TP: the states to the byte's share, the live tensors' peak within the bounds the
    Llama dry runs keep (tests/test_dry_run.py)."""
    from conftest import launch_cli

    out = launch_cli(["model=deepseek_v3_debug", "cluster.dry_run=true", "parallelism=tp", "cluster.nproc_per_node=2"])
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    rows = {line.split("|")[1].strip(): [float(v) for v in line.split("|")[2:4]]
            for line in text.splitlines()
            if line.startswith("| ") and line.count("|") == 4 and line.split("|")[3].strip()
            and line.split("|")[2].strip() not in ("measured",)}
    states = rows["parameters + gradients + optimizer"]
    assert states[1] == pytest.approx(states[0], rel=0.05)
    live = rows["peak of live tensors during the step (planner: less runtime and allocator slack)"]
    assert 0.6 < live[1] / live[0] < 1.6

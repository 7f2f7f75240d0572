"""Qwen3 dense and Qwen3-MoE against the real `transformers`: tiny random Qwen3ForCausalLM and
Qwen3MoeForCausalLM made here load into our model with the same logits, train from there on
every layout with transformers' step-1 loss, and export back to directories transformers loads
with bit-equal weights."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALL, run_job

from titan_exp.config import ModelConfig
from titan_exp.config.hf import config_errors, model_fields
from titan_exp.models import hf, moe
from titan_exp.models.llama import Transformer

transformers = pytest.importorskip("transformers")

# Heads 32 wide at dim 64 with 4 heads (Qwen3's head_dim is not dim / heads), 2 kv heads: TP 2 splits both.
SHAPES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              intermediate_size=160, vocab_size=2048, max_position_embeddings=128, rope_theta=1e6, rms_norm_eps=1e-6)
# Qwen3-MoE's: 8 experts 48 wide, top 2 renormalized, on every block.
EXPERTS = dict(moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)


def tiny_qwen3(folder, *, experts: bool = False, tie: bool = False, **changes):
    """A random Qwen3 (or Qwen3-MoE) saved as transformers saves it; its norms and router random too,
    so a swapped q/k norm or a misrouted expert shows."""
    shapes = {**SHAPES, "tie_word_embeddings": tie, **changes}
    if experts:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**shapes, **EXPERTS))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shapes))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model.eval()


def ours_from(folder) -> tuple[Transformer, ModelConfig]:
    cfg = ModelConfig(**model_fields(json.loads((folder / "config.json").read_text())))
    model = Transformer(cfg)
    hf.load_into([model], folder, cfg)
    return model.eval(), cfg


@pytest.mark.parametrize("experts, tie", [(False, True), (False, False), (True, False)],
                         ids=["dense_tied", "dense_untied", "moe"])
@pytest.mark.quick
def test_qwen3_loads_with_transformers_logits(tmp_path, experts, tie):
    theirs = tiny_qwen3(tmp_path, experts=experts, tie=tie)
    ours, cfg = ours_from(tmp_path)
    assert cfg.qk_norm and cfg.head_size == 32 and cfg.rope_theta == 1e6 and cfg.is_moe == experts
    if experts:  # Qwen3-MoE's router: softmax, top 2 renormalized, no shared expert, no bias
        assert (cfg.score_func, cfg.route_norm, cfg.top_k, cfg.n_shared_experts, cfg.load_balance_coeff) == (
            "softmax", True, 2, 0, None)
    tokens = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(ours(tokens), theirs(tokens).logits, atol=1e-4, rtol=0)
        # The control: without its QK-norm (weights 1) the logits differ.
        ours.layers["0"].attention.q_norm.weight.fill_(1.0)
        assert (ours(tokens) - theirs(tokens).logits).abs().max() > 1e-3


@pytest.mark.quick
def test_the_switch_balance_loss_is_transformers_aux_loss(tmp_path):
    """One sequence and one MoE layer: our balance loss (logged without its coefficient) is the
    aux_loss transformers returns for Qwen3-MoE."""
    theirs = tiny_qwen3(tmp_path, experts=True, num_hidden_layers=1)
    ours, cfg = ours_from(tmp_path)
    assert cfg.aux_loss == "switch" and cfg.aux_loss_coeff == 0.001
    tokens = torch.randint(0, 2048, (1, 64), generator=torch.Generator().manual_seed(2))
    ours.train()(tokens)  # with gradients on: the loss is computed for the backward
    (layer,) = moe.moe_layers([ours])
    expected = theirs(tokens, output_router_logits=True).aux_loss
    assert layer.aux_loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert expected.item() != pytest.approx(cfg.top_k, rel=1e-3)  # not the balanced value: routing matters


@pytest.mark.parametrize("changes, message", [
    ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window true (sliding_window 64)"),
    ({"attention_bias": True}, "attention_bias"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step 2 (experts every 2 blocks)"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers [1] (dense blocks other than the first ones)"),
], ids=["sliding_window", "bias", "sparse_step", "dense_last_block"])
def test_what_titan_exp_cannot_represent_is_refused_by_field(tmp_path, changes, message):
    experts = "decoder_sparse_step" in changes or "mlp_only_layers" in changes
    tiny_qwen3(tmp_path, experts=experts, **changes)
    (error,) = config_errors(ModelConfig(hf_config=str(tmp_path)))
    kind = "qwen3_moe" if experts else "qwen3"
    assert error.startswith(f"model.hf_config = '{tmp_path}': this {kind} model has {message}"), error


def test_an_export_of_biased_routing_is_refused():
    from conftest import job_config

    from titan_exp.validation import validate

    job = job_config(["model=moe_debug", "model.qk_norm=true", "model.score_func=softmax", "model.n_shared_experts=0",
                      "checkpoint=default", "checkpoint.last_save_in_hf=true"])
    assert any(e.startswith("checkpoint.last_save_in_hf = True: Qwen3-MoE routes without DeepSeek-V3's "
                            "load-balancing bias") for e in validate(job, cuda=False))


# name: (overrides, the model: dense tied or MoE). global batch 8 everywhere.
LAYOUTS = {
    "single": ([], "dense"),  # the reference itself, against transformers
    "fsdp2": (["parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4"], "dense"),
    "tp2": (["parallelism=tp"], "dense"),
    "pp2_tied": (["parallelism=pp"], "dense"),
    "cp2": (["parallelism=cp"], "dense"),
    "fsdp2_full_ac": (["parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4",
                       "activation_checkpoint.mode=full"], "dense"),
    "hsdp2x2_compiled": (["parallelism=hsdp", "training.local_batch_size=2", "compile.enable=true",
                          "compile.backend=aot_eager"], "dense"),
    "moe_single": ([], "moe"),
    "moe_ep2": (["parallelism=ep", "training.local_batch_size=4"], "moe"),
    "moe_tp2": (["parallelism=tp"], "moe"),
    "moe_pp2": (["parallelism=pp"], "moe"),
}
SLOW = {"hsdp2x2_compiled", "fsdp2_full_ac"}
QUICK = {"tp2", "moe_ep2"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The two Hugging Face directories every layout starts from: a tied dense Qwen3 and a Qwen3-MoE."""
    root = tmp_path_factory.mktemp("qwen3")
    return {"dense": (root / "dense", tiny_qwen3(root / "dense", tie=True)),
            "moe": (root / "moe", tiny_qwen3(root / "moe", experts=True))}


def first_batch(run_dir):
    """The first global batch the run trained on, as its loader cut it."""
    from titan_exp.config import load_job_config
    from titan_exp.data.corpus import Tokenizer
    from titan_exp.data.loader import PackedLoader
    from titan_exp.data.sources import open_dataset

    job = load_job_config(run_dir / "config.yaml")
    loader = PackedLoader(open_dataset(job.data), Tokenizer(run_dir / "tokenizer.json"), text_field="text",
                          seq_len=job.training.seq_len, global_batch_size=8, local_batch_size=8, dp_rank=0, dp_degree=1)
    (inputs, labels), = loader.next_batch()
    return inputs, labels


def hf_loss(model, inputs, labels) -> float:
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(inputs).logits.flatten(0, 1), labels.flatten()).item()


def from_hf(src) -> list[str]:
    return [f"model.hf_config={src}", "checkpoint.enable=true", f"checkpoint.initial_load_path={src}",
            "checkpoint.initial_load_in_hf=true", "checkpoint.interval=100"]


@pytest.fixture(scope="module")
def one_process(sources, tmp_path_factory):
    """Each model's run in one process, from its Hugging Face directory (run once, when first asked for)."""
    runs = {}

    def run(kind: str) -> dict:
        if kind not in runs:
            code, summary = run_job([*SMALL, "training.steps=2", *from_hf(sources[kind][0])],
                                    tmp_path_factory.mktemp(kind))
            assert code == 0 and summary["status"] == "ok", summary.get("error")
            runs[kind] = summary
        return runs[kind]
    return run


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.slow] * (n in SLOW) + [pytest.mark.quick] * (n in QUICK)) for n in LAYOUTS])
def test_every_layout_starts_at_transformers_loss(name, sources, one_process, tmp_path):
    """Loaded from the Hugging Face directory, the run's first loss is transformers' on the same
    batch (within 1e-4; the loss is the language model's: the balance loss is logged apart), and
    its second, after an update, is one process's (fp32 tolerance, as tests/ranks/test_parallel.py)."""
    overrides, kind = LAYOUTS[name]
    src, theirs = sources[kind]
    code, summary = run_job([*SMALL, "training.steps=2", *from_hf(src), *overrides], tmp_path)
    assert code == 0 and summary["status"] == "ok", summary.get("error")
    expected = hf_loss(theirs, *first_batch(tmp_path))
    assert summary["losses"][0] == pytest.approx(expected, abs=1e-4)
    reference = one_process(kind)
    assert summary["losses"][1] == pytest.approx(reference["losses"][1], abs=2e-5)
    assert summary["grad_norms"] == pytest.approx(reference["grad_norms"], rel=2e-4)
    assert summary["losses"][1] != pytest.approx(summary["losses"][0], abs=1e-3)  # it trained
    if kind == "moe":
        assert summary["expert_load"]["aux_loss"] > 0  # logged apart, without its coefficient
        assert summary["expert_load"]["aux_loss"] == pytest.approx(reference["expert_load"]["aux_loss"], rel=1e-5)


@pytest.mark.parametrize("kind, layout", [
    pytest.param("dense", ["parallelism=pp"], marks=pytest.mark.quick),
    ("moe", ["parallelism=ep", "training.local_batch_size=4"]),
], ids=["dense_tied_pp2", "moe_ep2"])
def test_the_export_is_the_checkpoint_transformers_started_from(kind, layout, sources, tmp_path):
    """Steps at a learning rate too small to move an fp32 weight, then the Hugging Face export:
    transformers loads it (its model_type and architecture), with every weight bit-equal to the
    directory the run started from and the run's tokenizer beside them."""
    src, theirs = sources[kind]
    code, summary = run_job([*SMALL, "training.steps=2", *from_hf(src), *layout, "optimizer.lr=1e-30",
                             "checkpoint.last_save_in_hf=true"], tmp_path)
    assert code == 0 and summary["status"] == "ok", summary.get("error")
    from titan_exp.config import load_job_config

    assert load_job_config(tmp_path / "config.yaml").model.flavor == src.name  # named after its directory
    out = tmp_path / "export" / "hf"
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (theirs.config.model_type,
                                                               [type(theirs).__name__])
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    mine, want = back.state_dict(), theirs.state_dict()
    assert mine.keys() == want.keys()
    assert all(torch.equal(mine[k], want[k]) for k in want), [k for k in want if not torch.equal(mine[k], want[k])]
    assert transformers.AutoTokenizer.from_pretrained(out).vocab_size == 2048


@pytest.mark.slow
def test_float8_starts_near_transformers_loss(sources, tmp_path):
    """float8 linears under FSDP 2 (the QK-norm's and experts' shapes allow it): the first loss
    tracks transformers' fp32 loss as bf16 does (within 2e-2), and is not it (float8 really ran)."""
    src, theirs = sources["dense"]
    code, summary = run_job([*SMALL, "training.steps=2", *from_hf(src), "precision=float8", *LAYOUTS["fsdp2"][0]],
                            tmp_path)
    assert code == 0 and summary["status"] == "ok", summary.get("error")
    expected = hf_loss(theirs, *first_batch(tmp_path))
    assert summary["losses"][0] == pytest.approx(expected, abs=2e-2)
    assert summary["losses"][0] != pytest.approx(expected, abs=1e-5)

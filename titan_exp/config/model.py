"""The model group: a Llama 3 shaped transformer's sizes (dense, MoE, multi-head latent
attention) and what derives from them (the head width, kv heads, the SwiGLU width, parameter
counts). titan_exp.config.hf reads a Hugging Face config.json into one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from titan_exp.config.fields import AuxLoss, ModelFamily, ScoreFunc, doc, target, target_kwargs


@dataclass
class ModelConfig:
    """Llama 3 shapes, and what Qwen3, its MoE, DeepSeek-V3 and Mixtral change. Presets in
    conf/model/ carry the published shapes of each flavor."""

    _target_: str = target("titan_exp.models.llama.Transformer", "(this node); must be shaped like it")
    kwargs: Dict[str, Any] = target_kwargs()
    name: ModelFamily = doc(ModelFamily.llama3, "model family")
    flavor: str = doc("debugmodel", "preset name, recorded in the run summary")
    dim: int = doc(256, "hidden size", min=1)
    n_layers: int = doc(6, "number of transformer blocks", min=1)
    n_heads: int = doc(16, "attention (query) heads", min=1)
    n_kv_heads: Optional[int] = doc(None, "key/value heads for GQA; null = n_heads")
    head_dim: Optional[int] = doc(None, "width of one attention head; null = dim / n_heads (Qwen3: 128 at any dim)")
    qk_norm: bool = doc(False, "RMSNorm each query and key head before RoPE (Qwen3)")
    # Multi-head latent attention (DeepSeek-V2/V3; titan_exp.models.mla), on when kv_lora_rank > 0:
    # keys and values come up from a latent of that width, queries from one of q_lora_rank (or
    # straight from the hidden state), and RoPE rotates qk_rope_head_dim of each query/key head.
    kv_lora_rank: int = doc(0, "MLA: width of the latent keys and values come up from; 0 = grouped-query attention",
                            min=0)
    q_lora_rank: int = doc(0, "MLA: width of the latent queries come up from; 0 = from the hidden state", min=0)
    qk_nope_head_dim: Optional[int] = doc(None, "MLA: the part of a query/key head RoPE leaves alone "
                                                "(DeepSeek-V3: 128)")
    qk_rope_head_dim: Optional[int] = doc(None, "MLA: the part of a query/key head RoPE rotates, one key part shared "
                                                "by all heads (DeepSeek-V3: 64)")
    v_head_dim: Optional[int] = doc(None, "MLA: width of one value head (DeepSeek-V3: 128)")
    vocab_size: int = doc(2048, "embedding rows; must be >= the tokenizer's vocabulary", min=1)
    multiple_of: int = doc(256, "SwiGLU hidden size is rounded up to a multiple of this", min=1)
    ffn_dim_multiplier: Optional[float] = doc(None, "scales the SwiGLU hidden size (Llama 3: 1.3 for 8B/70B)")
    norm_eps: float = doc(1e-5, "RMSNorm epsilon")
    rope_theta: float = doc(500000.0, "RoPE base frequency")
    max_seq_len: int = doc(2048, "longest sequence the model accepts (RoPE table size)", min=1)
    tie_word_embeddings: bool = doc(False, "share the embedding and output matrices (Llama 3.2 1B/3B)")
    intermediate_size: Optional[int] = doc(None, "SwiGLU hidden size; null = Llama's rule from dim, multiple_of "
                                                 "and ffn_dim_multiplier")
    hf_config: Optional[str] = doc(None, "a Hugging Face Llama, Qwen3 or Qwen3-MoE config.json, or its directory: "
                                         "its shapes replace the model's fields (titan_exp.config.hf)")
    # Mixture of experts (titan_exp.models.moe): the SwiGLU of every block after the first
    # n_dense_layers becomes n_experts routed experts (top_k per token) plus n_shared_experts.
    n_experts: int = doc(0, "routed experts per MoE layer; 0 = a dense model", min=0)
    top_k: int = doc(2, "experts each token is routed to", min=1)
    n_shared_experts: int = doc(0, "experts every token goes through besides its routed ones", min=0)
    moe_hidden_dim: Optional[int] = doc(None, "SwiGLU width of one expert; null = the dense width (ffn hidden size)")
    n_dense_layers: int = doc(0, "leading blocks that keep a dense SwiGLU (DeepSeek-V3: 3)", min=0)
    score_func: ScoreFunc = doc(ScoreFunc.softmax, "router scores: softmax over experts, "
                                                   "or an independent sigmoid each")
    route_norm: bool = doc(False, "renormalize each token's top-k scores to sum to 1")
    route_scale: float = doc(1.0, "scales the routed experts' combined output")
    load_balance_coeff: Optional[float] = doc(1e-3, "step of DeepSeek-V3's auxiliary-loss-free bias update; null = off")
    aux_loss_coeff: float = doc(0.0, "weight of the load-balancing loss (model.aux_loss); 0 = off")
    aux_loss: AuxLoss = doc(AuxLoss.sequence, "load-balancing loss: sequence = DeepSeek-V3's sequence-wise one, "
                                              "summed over MoE layers; switch = Switch Transformer's (Qwen3, "
                                              "Mixtral), per sequence, mean over MoE layers")

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (model.kv_lora_rank > 0)."""
        return self.kv_lora_rank > 0

    @property
    def head_size(self) -> int:
        """One query/key head's width: head_dim, or dim / n_heads when it is not given; under MLA
        its two parts, qk_nope_head_dim + qk_rope_head_dim."""
        if self.mla:
            return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def v_head_size(self) -> int:
        """One value head's width: head_size, or under MLA v_head_dim."""
        return (self.v_head_dim or 0) if self.mla else self.head_size

    @property
    def rope_dim(self) -> int:
        """The width of a query/key head RoPE rotates: all of it, or under MLA qk_rope_head_dim."""
        return (self.qk_rope_head_dim or 0) if self.mla else self.head_size

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads (MLA brings every head its own keys and values)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Llama's SwiGLU width: 2/3 of 4*dim, scaled, rounded up to `multiple_of` (or as given)."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return max(0, self.n_layers - self.n_dense_layers) if self.is_moe else 0

    @property
    def expert_hidden_dim(self) -> int:
        return self.moe_hidden_dim if self.moe_hidden_dim is not None else self.ffn_hidden_dim

    @property
    def expert_params(self) -> int:
        """One routed expert (a SwiGLU of width expert_hidden_dim)."""
        return 3 * self.dim * self.expert_hidden_dim

    def _ffn_params(self, active: bool) -> int:
        """The SwiGLU parameters of all blocks (of those a token uses, when `active`)."""
        dense = (self.n_layers - self.n_moe_layers) * 3 * self.dim * self.ffn_hidden_dim
        routed = self.top_k if active else self.n_experts
        per_moe = (routed + self.n_shared_experts) * self.expert_params + self.dim * self.n_experts  # + router
        return dense + self.n_moe_layers * per_moe

    @property
    def _attention_and_norms(self) -> int:
        """One block's q/k/v/o projections and its two norms (under MLA its down- and
        up-projections and the latents' norms, titan_exp.models.mla)."""
        if self.mla:
            h, qk, v, latent = self.n_heads, self.head_size, self.v_head_size, self.kv_lora_rank
            q = self.dim * h * qk if not self.q_lora_rank else self.q_lora_rank * (self.dim + 1 + h * qk)
            kv = self.dim * (latent + self.rope_dim) + latent + latent * h * (self.qk_nope_head_dim + v)
            return q + kv + h * v * self.dim + 2 * self.dim
        qk_norm = 2 * self.head_size if self.qk_norm else 0
        return self.dim * self.head_size * (2 * self.n_heads + 2 * self.kv_heads) + 2 * self.dim + qk_norm

    @property
    def block_params(self) -> int:
        """Parameters of one transformer block: q/k/v/o projections, SwiGLU, two norms (for an
        MoE model, the mean over blocks: dense and MoE blocks differ)."""
        return self._attention_and_norms + self._ffn_params(active=False) // self.n_layers

    @property
    def active_block_params(self) -> int:
        """block_params counting only the experts a token is routed to (FLOPs, MFU)."""
        return self._attention_and_norms + self._ffn_params(active=True) // self.n_layers

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def output_params(self) -> int:
        """The final norm and the output projection (nothing new when tied to the embedding)."""
        return self.dim + (0 if self.tie_word_embeddings else self.vocab_size * self.dim)

    def output_params_on(self, first: bool) -> int:
        """The final norm and output projection a pipeline rank holding the last stage holds: a tied
        output is a copy of the embedding of its own on a rank without the first stage
        (titan_exp.parallel.pipeline.sum_tied_grads keeps the two equal)."""
        return self.output_params + (self.embedding_params if self.tie_word_embeddings and not first else 0)

    @property
    def router_params_per_block(self) -> float:
        """The mean block's router (dim x n_experts in each MoE layer): whole on every TP rank."""
        return self.n_moe_layers * self.dim * self.n_experts / self.n_layers

    @property
    def routed_params_per_block(self) -> float:
        """The routed experts and router of the mean block: the MoE parameters FSDP shards apart
        from the rest under expert parallel (titan_exp.parallel.fsdp)."""
        return self.n_moe_layers * self.n_experts * self.expert_params / self.n_layers + self.router_params_per_block

    def routed_params_on_tp_rank(self, tp: int, ep: int) -> float:
        """The mean block's routed experts and router as one TP rank holds them before FSDP shards
        them: under expert parallel 1/ep of them (whole experts, titan_exp.parallel.expert);
        without it 1/tp of every expert's width, and the router whole (titan_exp.parallel.tensor)."""
        if ep > 1:
            return self.routed_params_per_block / ep
        return (self.routed_params_per_block - self.router_params_per_block) / tp + self.router_params_per_block

    def block_matmul_params(self, tp: int = 1, experts_whole: bool = False) -> float:
        """Weights one token multiplies by in the mean block on one TP rank (forward FLOPs per
        token are twice this, before attention's scores): the router and MLA's latent
        projections whole, the rest split by tp,
        the routed experts it goes to too (every TP layout splits their work: expert parallel by
        tokens, ParallelismConfig.dispatch_split, or without it by width, expert_width_split),
        unless `experts_whole`, as calibration's block holds them (perf.calibration.compute.sharded_block)."""
        experts = self.n_moe_layers * self.top_k * self.expert_params / self.n_layers
        whole = self.router_params_per_block + self.latent_params
        return (self.active_block_params - experts - whole) / tp + whole + experts / (1 if experts_whole else tp)

    @property
    def latent_params(self) -> int:
        """MLA's down-projections to its latents and their norms, whole on every TP rank
        (titan_exp.parallel.tensor); 0 without MLA."""
        if not self.mla:
            return 0
        return self.dim * (self.kv_lora_rank + self.rope_dim) + self.kv_lora_rank + self.q_lora_rank * (self.dim + 1)

    def measured_block_share(self, tp: int) -> float:
        """A TP rank's block FLOPs over those of the block calibration measures for it, whose
        routed experts are whole (perf.calibration.compute.sharded_block): under 1 for an MoE model at
        tp > 1, else 1. The step model and calibration's TP cost both take the block at it."""
        return self.block_matmul_params(tp) / self.block_matmul_params(tp, experts_whole=True)

    def _params(self, active: bool) -> int:
        return (self.embedding_params + self.n_layers * self._attention_and_norms + self._ffn_params(active)
                + self.output_params)

    @property
    def num_params(self) -> int:
        return self._params(active=False)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: num_params less the routed experts it is not sent to."""
        return self._params(active=True)

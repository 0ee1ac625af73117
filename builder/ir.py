"""The engine IR: what the builder knows about the model and the plan for building it.

Frozen dataclasses, produced by the passes in order (load -> trace -> lower -> plan ->
tune -> render -> pack -> emit). Each pass reads a BuildState and returns a new one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagecast.runtime.artifact import DEFAULT_MAX_NUM_SEQS


@dataclass(frozen=True)
class BuildOptions:
    """enginebuild's command line, checked where it is made."""

    model: str
    output: Path | None = None
    gpu: str = "auto"  # "auto", "cpu" or a GPU name such as "h200"
    block_size: int = 16
    dtype: str = "auto"  # "auto", "float32", "float16", "bfloat16"
    max_model_len: int | None = None
    tp: int = 1
    quant: str | None = None
    fp8_lm_head: bool = False  # --fp8-lm-head: the LM head FP8 as well (builder/fp8.with_lm_head)
    # --fp8-scheme: how --quant fp8 quantises a float checkpoint (builder/fp8.with_scheme): "channel"
    # (per-output-channel weights, per-token activations) or "block" (128x128 weight blocks, 1x128
    # activation groups); None: channel, and whatever an FP8 checkpoint holds
    fp8_scheme: str | None = None
    load_format: str = "auto"  # "auto" (read weights) or "dummy" (random weights from a config-only dir)
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    tune_budget_s: float = 300.0
    # Kernels the tuner takes first, in this order (then the rest as usual): a budget that runs
    # out cuts off what comes last, so a build meant for one workload tunes its kernels fully.
    tune_first: tuple[str, ...] = ()
    # --tuning-from: another build's tuning table (its tuning.json, or the artifact directory) whose
    # kernel configs this build keeps instead of choosing anew (kernels/tuning.tune's ``pinned``).
    tuning_from: Path | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8" / "fp8_e4m3" (builder/kv_cache.py)
    force: bool = False
    quiet: bool = False
    seed: int = 0
    # --speculative-config: the drafter the artifact serves with by default (runtime/speculative.py's
    # keys), as a dict; the JSON text the command line gives is parsed and checked here.
    speculative_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be one of 8, 16, 32, 64, 128 (got {self.block_size})")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32, float16 or bfloat16 (got {self.dtype!r})")
        if self.tp < 1:
            raise ValueError(f"--tp must be at least 1 (got {self.tp})")
        if self.quant not in (None, "awq", "gptq", "fp8"):
            raise ValueError(f"--quant must be awq, gptq or fp8 (got {self.quant!r})")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy (got {self.load_format!r})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2 (got {self.max_model_len})")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be positive (got {self.max_num_seqs})")
        if isinstance(self.tune_first, str):  # the command line's comma-separated list
            object.__setattr__(self, "tune_first", tuple(k.strip() for k in self.tune_first.split(",") if k.strip()))
        if self.tune_first:
            from pagecast.kernels.tuning import KERNELS, MOE_KERNELS

            unknown = [k for k in self.tune_first if k not in KERNELS + MOE_KERNELS]
            if unknown:
                raise ValueError(
                    f"--tune-first: unknown kernel {unknown[0]!r}; the tuned kernels are {', '.join(KERNELS + MOE_KERNELS)}"
                )
        from pagecast.builder.kv_cache import parse_option

        parse_option(self.kv_cache_dtype)  # ValueError naming the accepted values
        if self.speculative_config is not None:
            from pagecast.runtime.speculative import SpeculativeConfig

            config = SpeculativeConfig.parse(self.speculative_config)  # ValueError saying what is wrong
            if config is not None and config.method == "replay":
                raise ValueError(
                    "speculative_config method replay is for benchmarks: give it to LLM / engine-serve, not to enginebuild"
                )
            # Stored checked and complete (defaults filled in), as the manifest's build options show it.
            object.__setattr__(self, "speculative_config", config.to_dict() if config is not None else None)


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str  # "default", "linear", "llama3", "yarn", "longrope" (kernels.rope)
    params: dict[str, Any]  # rope_theta and the variant's own keys, as kernels.rope expects them
    rotary_dim: int
    # The checkpoint rotates pairs of adjacent dims (GLM, Helium, ERNIE 4.5: GPT-J style) where the
    # kernels rotate dim i with dim i + rotary_dim / 2. The build reorders each head's q and k rows
    # (weights, biases, norms) to the kernels' order, which leaves every q.k product unchanged.
    interleaved: bool = False


@dataclass(frozen=True)
class NormSpec:
    """One RMSNorm: x * rsqrt(mean(x^2) + eps) * w, the weight read from ``hf_name``.

    ``weight_offset`` is added to the stored weight at pack time: Gemma's norms multiply by
    (1 + w), which is then the same kernel. Exact in fp32; in a half type the (1 + w) is rounded
    once, where transformers keeps it in fp32 until after the multiply."""

    hf_name: str
    eps: float
    weight_offset: float = 0.0


@dataclass(frozen=True)
class QueryTemperature:
    """A query scale that grows with position, 1 + multiplier * log(1 + floor((p + offset) / divisor))
    at position p, as two families write it (kernels/rope.query_temperature_table computes each):

    - "llama4": Llama 4's attention temperature on its no-RoPE layers (offset 1, divisor floor_scale,
      multiplier attn_scale), the product taken in fp32;
    - "llama_4_scaling": Ministral 3's on every layer after RoPE (offset 0, divisor the original
      context, multiplier rope_parameters.llama_4_scaling_beta), the scale rounded to the query's
      dtype before the product."""

    kind: str
    divisor: float
    multiplier: float


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # RMSNorm on q and k before rotary (qk_norm_kind says over what)
    qk_norm_eps: float | None
    scale: float
    rope: RopeSpec | None  # None: a no-RoPE layer (SmolLM3's every fourth)
    # "head": over head_dim, per head (Qwen3, Gemma 3); "projection": over the whole q / k
    # projection output (OLMo 2), which needs every head on one rank.
    qk_norm_kind: str | None = None
    qk_norm_offset: float = 0.0  # Gemma 3's q/k norms multiply by (1 + w), as NormSpec.weight_offset
    qk_norm_after_rope: bool = False  # HunYuan: the per-head q/k norms apply to the rotated heads
    qk_norm_names: tuple[str, str] = ("q_norm", "k_norm")  # their modules under self_attn
    sliding_window: int | None = None  # a query at p sees keys p - window < k <= p (Gemma 2/3)
    logit_softcap: float | None = None  # scores soft-capped: cap * tanh(s / cap) (Gemma 2)
    # The checkpoint holds q/k/v as one module under self_attn (Phi-3's "qkv_proj"): the plan reads
    # row ranges of its weight.
    fused_qkv_name: str | None = None
    clip_qkv: float | None = None  # q, k and v clamped to [-c, c] after the q/k norms (OLMoE)
    sinks: bool = False  # a learned per-head logit in each softmax's denominator (gpt-oss's attention sinks)
    # Llama 4: the q/k norms have no weight (an L2 norm: x * rsqrt(mean(x^2) + eps)), and some layers
    # have none (its no-RoPE layers); the layers that have them share everything else (qk_norm_key).
    qk_norm_weight: bool = True
    # Chunked attention (Llama 4's RoPE layers): a query at p sees keys p // chunk * chunk..p only.
    attention_chunk: int | None = None
    # A position-dependent query scale (Llama 4's no-RoPE layers, Ministral 3's every layer).
    query_temperature: QueryTemperature | None = None

    def shape_key(self) -> tuple[Any, ...]:
        """What every layer must share: one model.py and one weight layout serve all layers (a
        layer may lack the q/k norms the others have: ``qk_norm_key``)."""
        return (self.num_heads, self.num_kv_heads, self.head_dim, self.qkv_bias, self.o_bias,
                self.fused_qkv_name is not None, self.clip_qkv, self.sinks)  # fmt: skip

    def qk_norm_key(self) -> tuple[Any, ...] | None:
        """What every layer with q/k norms must share (None: this layer has none)."""
        if not self.qk_norm:
            return None
        return (self.qk_norm_kind, self.qk_norm_eps, self.qk_norm_offset, self.qk_norm_after_rope, self.qk_norm_weight,
                self.qk_norm_names)  # fmt: skip


@dataclass(frozen=True)
class MlpSpec:
    """A dense gated MLP: down(act(gate(x)) * up(x)). ``kind`` tells a dense block from the MoE
    block other passes may add beside it (LayerSpec.mlp is either)."""

    intermediate_size: int
    activation: str  # "silu", "gelu_tanh", "gelu": gated, act(gate) * up
    bias: bool
    kind: str = "dense"
    fused_gate_up_name: str | None = None  # gate/up as one module under mlp (Phi-3's "gate_up_proj")
    module: str = "mlp"  # the module under the layer that holds it in the checkpoint (Llama 4: "feed_forward")


@dataclass(frozen=True)
class MoeSpec:
    """A sparse mixture-of-experts block in place of the dense MLP: a router picks ``top_k`` of
    ``num_experts`` gated MLPs per token (kernels/moe_routing.py says how ``scoring``,
    ``renormalize`` and ``weights_in_x_dtype`` route), run by ops.moe. Checkpoint names are
    relative to the layer's prefix; experts are stored one module per expert
    (``{experts_name}.{e}.{gate|up|down}.weight``) or, where ``stacked``, as gpt-oss's three
    tensors ([E, H, 2I] gate/up interleaved by column, [E, I, H] down, their biases) or Granite-MoE's
    two (``stacked_names``)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    scoring: str  # "softmax_topk", "topk_softmax", "sigmoid_group", ... (moe_routing.SCORINGS)
    renormalize: bool
    weights_in_x_dtype: bool
    activation: str = "silu"  # "silu" or "swiglu_oai" (moe_routing.ACTIVATIONS)
    alpha: float = 1.702  # swiglu_oai only
    limit: float = 7.0  # swiglu_oai only
    router_bias: bool = False
    # sigmoid_group (GLM-4.5): expert groups, groups kept, the weights' factor, and the router's
    # per-expert score bias for the choice (e_score_correction_bias)
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0
    router_fp32: bool = False  # the router's GEMV in fp32 (its weight stored so)
    weights_on_input: bool = False  # Llama 4: the routing weight scales the expert's input (top-1)
    norm_min: float = 0.0  # softmax_bias (ERNIE 4.5): the renormalisation's least denominator
    score_bias: bool = False
    score_bias_name: str = "mlp.gate.e_score_correction_bias"  # GLM-4.5's; MiniMax-M2 keeps it on the block
    expert_bias: bool = False
    shared_expert_size: int = 0  # Qwen2-MoE: the shared expert's intermediate size; 0 = none
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x @ gate.T)
    router_name: str = "mlp.gate"
    experts_name: str = "mlp.experts"
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert_name: str = "mlp.shared_expert"  # GLM-4.5: "mlp.shared_experts"
    stacked: bool = False
    # Where ``stacked`` names two tensors under the block already in moe_routing's layout ([E, 2I, H]
    # gate rows then up rows, [E, H, I]: Granite-MoE's input_linear, output_linear), their names;
    # () for gpt-oss's three.
    stacked_names: tuple[str, ...] = ()
    kind: str = "moe"


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: attention then MLP, each a residual branch.

    Each branch may have a norm on its input (pre-norm: Llama) and one on its output before the
    residual add (post-norm: OLMo 2; both: Gemma 2/3); the branch output is scaled by
    ``residual_multiplier`` before the add (Granite)."""

    index: int
    hf_prefix: str  # e.g. "model.layers.0": where its weights live in the checkpoint
    attention: AttentionSpec
    mlp: MlpSpec | MoeSpec  # a dense MLP or a MoE block (mlp.kind)
    attn_in_norm: NormSpec | None = None
    attn_out_norm: NormSpec | None = None
    mlp_in_norm: NormSpec | None = None
    mlp_out_norm: NormSpec | None = None
    residual_multiplier: float = 1.0

    def placement(self) -> tuple[bool, bool, bool, bool, float, float, float, float]:
        """Which norms the layer has and their eps (the template needs all layers alike)."""
        norms = (self.attn_in_norm, self.attn_out_norm, self.mlp_in_norm, self.mlp_out_norm)
        return (*(n is not None for n in norms), *(n.eps if n else 0.0 for n in norms))  # type: ignore[return-value]

    @property
    def input_norm_eps(self) -> float:
        return self.attn_in_norm.eps if self.attn_in_norm else 0.0

    @property
    def post_attention_norm_eps(self) -> float:
        """The pre-MLP norm's eps (transformers' Llama calls that norm post_attention_layernorm)."""
        return self.mlp_in_norm.eps if self.mlp_in_norm else 0.0


@dataclass(frozen=True)
class ModelIR:
    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    final_norm: NormSpec
    tie_word_embeddings: bool
    embed_name: str  # checkpoint tensor names of the parts outside the layers
    lm_head_name: str | None  # None when tied to the embedding
    max_position_embeddings: int
    # The embedding's output is multiplied by this (Gemma: sqrt(hidden), Granite: its multiplier).
    embedding_multiplier: float = 1.0
    # Gemma rounds its sqrt(hidden) to the model's dtype before the multiply; Granite does not.
    embedding_multiplier_in_dtype: bool = False
    logits_divisor: float = 1.0  # Granite divides the logits by logits_scaling
    final_logit_softcap: float | None = None  # Gemma 2: logits soft-capped (cap * tanh(x / cap))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def final_norm_eps(self) -> float:
        return self.final_norm.eps

    @property
    def final_norm_name(self) -> str:
        return self.final_norm.hf_name

    @property
    def attention(self) -> AttentionSpec:
        """Layer 0's attention: every layer shares its shapes (lower checks AttentionSpec.shape_key);
        windows, soft-caps, scales and RoPE may differ per layer."""
        return self.layers[0].attention

    @property
    def qk_norms(self) -> AttentionSpec:
        """The attention of the first layer with q/k norms (layer 0's where none has them): its
        qk_norm_* fields are every such layer's (lower checks AttentionSpec.qk_norm_key)."""
        return next((layer.attention for layer in self.layers if layer.attention.qk_norm), self.layers[0].attention)

    @property
    def qk_norm_layers(self) -> list[bool]:
        """Per layer: whether it has q/k norms (Llama 4: its RoPE layers only)."""
        return [layer.attention.qk_norm for layer in self.layers]

    @property
    def mlp(self) -> MlpSpec:
        """The dense MLP every dense layer shares (lower checks they agree). A model whose every
        layer is a MoE block has none: its MoE spec's expert width stands in, without gate/up
        biases, so that the plan and the manifest read one intermediate size."""
        dense = self.dense_mlp
        if dense is not None:
            return dense
        moe = self.moe
        assert moe is not None
        return MlpSpec(intermediate_size=moe.intermediate_size, activation=moe.activation, bias=False, kind="none")

    @property
    def dense_mlp(self) -> MlpSpec | None:
        return next((layer.mlp for layer in self.layers if isinstance(layer.mlp, MlpSpec)), None)

    @property
    def moe(self) -> MoeSpec | None:
        """The MoE block every MoE layer shares, None for a dense model."""
        return next((layer.mlp for layer in self.layers if isinstance(layer.mlp, MoeSpec)), None)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the artifact's weights: which checkpoint tensors it is made of and how."""

    name: str  # name in weights/rank{r}.safetensors, read by the rendered model.py
    sources: tuple[str, ...]  # checkpoint tensor names, concatenated along dim 0 when several
    shape: tuple[int, ...]
    rank: int = 0  # tensor-parallel rank this copy belongs to
    shard: tuple[int, int, int] | None = None  # (dim, index, count) of a TP split; None = whole
    # Per source: (dim, index, count) of the piece this rank takes (builder.shard); () = all whole.
    source_cuts: tuple[tuple[int, int, int] | None, ...] = ()
    dtype: str | None = None  # stored dtype when not the plan's (int4 parts: "int32", "int8", scales)
    offset: float = 0.0  # added to the values as they are read: Gemma's (1 + w) norms (NormSpec)
    # MoE experts: the sources form groups of ``stack`` consecutive ones (one group per expert), each
    # group cut and concatenated along dim 0 as above, the groups stacked along a new dim 0; 0 = no stacking.
    stack: int = 0


@dataclass(frozen=True)
class Plan:
    dtype: str
    device: str  # "cpu" or "cuda"
    gpu_name: str
    compute_capability: tuple[int, int] | None
    block_size: int
    tp: int
    quant: str | None
    max_model_len: int
    max_num_seqs: int
    tensors: tuple[TensorPlan, ...]
    memory: dict[str, Any]  # memory_plan.json
    quantization: Any = None  # builder.quant.QuantConfig of an AWQ/GPTQ build, None for half-type weights
    kv_cache: Any = None  # builder.kv_cache.KVCachePlan: the cache's dtype and per-layer fp8 scales


@dataclass(frozen=True)
class BuildState:
    """What flows through the pipeline; each pass fills its part."""

    options: BuildOptions
    checkpoint: Any = None  # builder.load.Checkpoint
    trace: Any = None  # builder.trace.TraceSummary
    model: ModelIR | None = None
    plan: Plan | None = None
    tuning: dict[str, Any] | None = None
    report: dict[str, Any] = field(default_factory=dict)  # notes each pass adds for report.md
    staging_dir: Path | None = None  # temporary artifact directory, renamed into place by emit
    model_py: str | None = None
    output_dir: Path | None = None
    # The manifest's ``speculative`` entry (builder/speculative.py): the drafter's config, its
    # ``model`` relative to the artifact; None when the build was given none.
    speculative: dict[str, Any] | None = None

    def describe(self) -> dict[str, Any]:
        """A JSON-able view of the IR, for --dump-ir."""
        out: dict[str, Any] = {}
        if self.model is not None:
            out["model"] = asdict(self.model)
        if self.plan is not None:
            plan = asdict(self.plan)
            plan["tensors"] = [f"{t['name']} <- {'+'.join(t['sources'])} {t['shape']}" for t in plan["tensors"]]
            out["plan"] = plan
        if self.tuning is not None:
            out["tuning"] = self.tuning
        return out

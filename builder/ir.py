"""The engine IR: what the builder knows about the model and the plan for building it.

Frozen dataclasses, produced by the passes in order (load -> trace -> lower -> plan ->
tune -> render -> pack -> emit). Each pass reads a BuildState and returns a new one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


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
    load_format: str = "auto"  # "auto" (read weights) or "dummy" (random weights from a config-only dir)
    max_num_seqs: int = 256
    tune_budget_s: float = 300.0
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8" / "fp8_e4m3" (builder/kv_cache.py)
    force: bool = False
    quiet: bool = False
    seed: int = 0

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
        from pagecast.builder.kv_cache import parse_option

        parse_option(self.kv_cache_dtype)  # ValueError naming the accepted values


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str  # "default", "linear", "llama3"
    params: dict[str, Any]  # rope_theta and the variant's own keys, as kernels.rope expects them
    rotary_dim: int


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rotary
    qk_norm_eps: float | None
    scale: float
    rope: RopeSpec


@dataclass(frozen=True)
class MlpSpec:
    intermediate_size: int
    activation: str  # "silu": gated, act(gate) * up
    bias: bool


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: pre-norm attention, then pre-norm gated MLP, both residual."""

    index: int
    hf_prefix: str  # e.g. "model.layers.0": where its weights live in the checkpoint
    input_norm_eps: float
    attention: AttentionSpec
    post_attention_norm_eps: float
    mlp: MlpSpec


@dataclass(frozen=True)
class ModelIR:
    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    final_norm_eps: float
    tie_word_embeddings: bool
    embed_name: str  # checkpoint tensor names of the parts outside the layers
    final_norm_name: str
    lm_head_name: str | None  # None when tied to the embedding
    max_position_embeddings: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def attention(self) -> AttentionSpec:
        """Every layer has the same attention (lower checks it); the template relies on that."""
        return self.layers[0].attention

    @property
    def mlp(self) -> MlpSpec:
        return self.layers[0].mlp


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

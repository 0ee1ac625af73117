"""Mixture-of-experts routing and expert layout: which experts each token visits, with what weight,
and the one expert-weight layout the fused-MoE kernels and the reference read.

Routing: the router's logits are F.linear's (x @ router.T, + bias, in x's dtype); the rest runs
in one fused Triton launch on CUDA (kernels/moe_route_kernel.py, routers up to 1,024 experts and
top-k up to 32) and in torch ops elsewhere (``route_torch``, transformers' ops: the CPU engine and
the kernel's reference). Both compute the same thing; they differ only in how exact ties in the
scores are broken (the kernel: the lowest expert index; torch.topk: unspecified on either device,
see moe_route_kernel's docstring) and by a few fp32 ulps in sums added in another order:

    scoring "softmax_topk"  (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)
        logits = x @ router.T in x's dtype; probs = softmax(logits) in fp32; top-k of probs;
        renormalised to sum 1 where ``renormalize`` (Mixtral always; the Qwens and OLMoE by
        ``norm_topk_prob``); the weights stay fp32 (Mixtral) or are rounded to x's dtype (the
        Qwens and OLMoE: ``weights_in_x_dtype``). HunYuan's from fp32 logits (``fp32_logits``: x
        and its fp32 router weight), its weights fp32.
    scoring "sigmoid_group"  (GLM-4.5 / 4.6 and MiniMax-M2: DeepSeek-V3's routing without its attention)
        logits = x @ router.T, in fp32 where ``fp32_logits`` (GLM: x and the router's weight cast
        up), else in x's dtype, then cast up (MiniMax-M2); scores = sigmoid(logits);
        the choice adds a per-expert bias to the scores (``e_score_correction_bias``, passed as
        the router bias, which here never touches the logits) and keeps, of ``n_group`` equal
        groups of experts, the ``topk_group`` whose two best biased scores sum highest, then the
        top-k biased scores among them; the weights are the unbiased scores of those experts,
        renormalised to sum 1 where ``renormalize`` (``norm_topk_prob``; + 1e-20), times
        ``scale`` (``routed_scaling_factor``), fp32. Not in the fused kernel: torch ops on
        every device (a few small launches a layer; CUDA graphs hold them).
    scoring "softmax_bias"  (ERNIE 4.5 MoE)
        logits = x @ router.T in fp32 (x and the weight cast up); probs = softmax(logits); the
        choice is the top-k of probs + a per-expert bias (``e_score_correction_bias``, passed as
        the router bias); the weights are those experts' probs over their sum (clamped below at
        ``norm_min``), rounded to x's dtype. Torch ops on every device, as sigmoid_group.
    scoring "topk_sigmoid"  (Llama 4)
        logits = x @ router.T in x's dtype; the top-k logits; weights = sigmoid of those (in fp32,
        rounded to x's dtype). Llama 4 (top-1) applies the weight to the expert's input, not its
        output (``weights_on_input``: ops.moe scales the routed rows and weighs the outputs by 1).
        Torch ops on every device, as sigmoid_group.
    scoring "topk_softmax"  (gpt-oss, Granite-MoE)
        logits = x @ router.T + router_bias in x's dtype; top-k of the logits; softmax over the k
        in x's dtype (Granite-MoE casts the logits to fp32 first and rounds the softmax to x's
        dtype: the same values, since a softmax of x's dtype computes in fp32 and rounds).

Expert weights, one layout for every family (nn.Linear's, per expert):

    w_gate_up  [E, 2 * I, H]   rows [0, I) the gate projection, rows [I, 2I) the up projection
    w_down     [E, H, I]
    b_gate_up  [E, 2 * I] or None,  b_down [E, H] or None   (gpt-oss only)

Mixtral, the Qwens and OLMoE store exactly this in transformers 5 (``experts.gate_up_proj``,
``experts.down_proj``); gpt-oss stores [E, H, 2I] with gate and up interleaved by column and
``gpt_oss_experts`` rewrites it at build time. Tensor parallelism cuts every expert's
intermediate dimension (``shard_experts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SCORINGS = ("softmax_topk", "topk_softmax", "sigmoid_group", "softmax_bias", "topk_sigmoid")
# Families whose router is DeepSeek-V3's (sigmoid_group with fp32 logits), attention aside
DEEPSEEK_ROUTED = ("Glm4MoeForCausalLM", "Dots1ForCausalLM", "ExaoneMoeForCausalLM", "SolarOpenForCausalLM")
KERNEL_SCORINGS = ("softmax_topk", "topk_softmax")  # what kernels/moe_route_kernel.py routes
ACTIVATIONS = ("silu", "swiglu_oai")


@dataclass(frozen=True)
class MoeRouting:
    """How a router's logits become (weights, expert ids): see the module docstring."""

    top_k: int
    scoring: str = "softmax_topk"
    renormalize: bool = False  # divide the top-k probabilities by their sum (softmax_topk only)
    weights_in_x_dtype: bool = False  # round the weights to x's dtype (the Qwens, OLMoE) or keep fp32
    # sigmoid_group only: expert groups, the groups kept and the weights' factor; and whether the
    # router's GEMV runs in fp32 (x cast up) rather than in x's dtype (GLM-4.5's and ERNIE 4.5's
    # routings, and HunYuan's softmax_topk, whose weights then stay fp32)
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0
    fp32_logits: bool = False
    norm_min: float = 0.0  # softmax_bias: the renormalisation's least denominator
    # Llama 4: each expert's input is x times its weight (the expert's output is not weighed); top-1
    # only, where that is one scaled copy of x a token
    weights_on_input: bool = False

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {self.top_k}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.scoring != "sigmoid_group" and (self.n_group, self.topk_group, self.scale) != (1, 1, 1.0):
            raise ValueError(f"n_group, topk_group and scale are sigmoid_group's, not {self.scoring}'s")
        if self.scoring == "topk_softmax" and self.fp32_logits:
            raise ValueError("fp32_logits is not topk_softmax's")
        if self.weights_on_input and self.top_k != 1:
            raise ValueError(f"weights on the experts' input need top_k 1 (one scaled input a token), got {self.top_k}")


@dataclass(frozen=True)
class MoeActivation:
    """The experts' gated activation on [gate | up]: ``silu`` is silu(gate) * up; ``swiglu_oai`` is
    gpt-oss's (gate clamped above at ``limit``, up clamped to +-``limit``,
    gate * sigmoid(alpha * gate) * (up + 1))."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.kind!r}")
        if self.limit <= 0:
            raise ValueError(f"limit must be positive, got {self.limit}")


SILU = MoeActivation("silu")
SWIGLU_OAI = MoeActivation("swiglu_oai")


@dataclass(frozen=True)
class SharedExpert:
    """Qwen2-MoE's shared expert: a dense SiLU MLP every token takes, scaled by
    sigmoid(x @ gate.T) where there is a gate. Weights as nn.Linear's (on one rank its shard:
    ``shard_shared_expert``)."""

    w_gate_up: Any  # [2 * S, H] (gate rows then up rows), a tensor or an int4 linear weight
    w_down: Any  # [H, S]
    gate: torch.Tensor | None = None  # [1, H] (shared_expert_gate), replicated on every rank


def moe_spec(architecture: str, config: dict[str, Any]) -> tuple[MoeRouting, MoeActivation]:
    """The routing and activation of a MoE family's sparse blocks, from its HF config."""
    k = _uniform(config.get("num_experts_per_tok") or config.get("moe_k") or config.get("moe_topk") or 0, "top-k")
    if architecture == "MixtralForCausalLM":
        return MoeRouting(k, renormalize=True), SILU
    if architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
        return MoeRouting(
            k, renormalize=bool(config.get("norm_topk_prob", False)), weights_in_x_dtype=True
        ), SILU
    if architecture in DEEPSEEK_ROUTED:
        return MoeRouting(
            k, scoring="sigmoid_group", renormalize=bool(config.get("norm_topk_prob", True)),
            n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
            scale=float(config.get("routed_scaling_factor", 1.0)), fp32_logits=True,
        ), SILU  # fmt: skip
    if architecture == "HunYuanMoEV1ForCausalLM":  # fp32 router (its wg is fp32), fp32 weights
        return MoeRouting(k, renormalize=True, fp32_logits=True), SILU
    if architecture == "Ernie4_5_MoeForCausalLM":
        return MoeRouting(
            k, scoring="softmax_bias", renormalize=True, weights_in_x_dtype=True, fp32_logits=True,
            norm_min=float(config.get("moe_norm_min", 1e-12)),
        ), SILU  # fmt: skip
    if architecture == "MiniMaxM2ForCausalLM":  # no groups, no scale, always renormalised; logits in x's dtype
        return MoeRouting(k, scoring="sigmoid_group", renormalize=True), SILU
    if architecture == "GraniteMoeForCausalLM":  # softmax over the top-k logits in fp32, rounded to x's dtype
        return MoeRouting(k, scoring="topk_softmax"), SILU
    if architecture == "Llama4ForCausalLM":  # sigmoid of the top logit, on the expert's input
        return MoeRouting(k, scoring="topk_sigmoid", weights_in_x_dtype=True, weights_on_input=True), SILU
    if architecture == "GptOssForCausalLM":
        return MoeRouting(k, scoring="topk_softmax"), MoeActivation(
            "swiglu_oai", limit=float(config.get("swiglu_limit", 7.0))
        )
    raise ValueError(f"no MoE routing for {architecture}")


def _uniform(value: Any, what: str) -> int:
    """A per-layer setting as one number: HunYuan's configs may list one per layer."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"a {what} per layer ({value}) is not supported: every MoE layer must have the same")
        value = value[0]
    return int(value)


def num_experts(config: dict[str, Any]) -> int:
    """Experts per MoE layer: ``num_experts`` or ``num_local_experts`` (checkpoints and
    transformers' configs use either name for the same count)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        if config.get(key):
            return _uniform(config[key], "number of experts")
    return 0


def shared_expert_size(architecture: str, config: dict[str, Any]) -> int:
    """The shared expert's intermediate size (0: none): Qwen2-MoE's own field; the DeepSeek-routed
    families' ``n_shared_experts`` (EXAONE-MoE: ``num_shared_experts``) experts' worth, run as one MLP."""
    if architecture in ("HunYuanMoEV1ForCausalLM", "Llama4ForCausalLM"):  # a shared MLP as wide as each expert
        return int(config["intermediate_size"])
    if architecture in DEEPSEEK_ROUTED or architecture == "Ernie4_5_MoeForCausalLM":
        shared = config.get("n_shared_experts") or config.get("num_shared_experts") or config.get("moe_num_shared_experts") or 0
        return int(config.get("moe_intermediate_size") or 0) * int(shared)
    return int(config.get("shared_expert_intermediate_size") or 0)


def is_moe_layer(architecture: str, config: dict[str, Any], layer: int) -> bool:
    """Whether decoder layer ``layer`` has a sparse-MoE block (else a dense MLP of the config's
    intermediate_size): every layer of Mixtral, OLMoE and gpt-oss; in the Qwens those not in
    ``mlp_only_layers`` whose index + 1 is a multiple of ``decoder_sparse_step``."""
    if architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        step = int(config.get("decoder_sparse_step", 1))
        dense = layer in (config.get("mlp_only_layers") or []) or num_experts(config) <= 0
        return not dense and (layer + 1) % step == 0
    if architecture == "Ernie4_5_MoeForCausalLM":  # every interval-th layer in [start, end]
        start, end = int(config.get("moe_layer_start_index", 0)), int(config.get("moe_layer_end_index", -1))
        end = end if end >= 0 else int(config["num_hidden_layers"]) - 1
        return (layer + 1) % int(config.get("moe_layer_interval", 1)) == 0 and start <= layer <= end
    if architecture in DEEPSEEK_ROUTED:  # dense MLPs in the first first_k_dense_replace layers
        if config.get("mlp_layer_types"):  # EXAONE-MoE names each layer's
            return config["mlp_layer_types"][layer] == "sparse"
        return layer >= int(config.get("first_k_dense_replace") or 0)
    if architecture == "Llama4ForCausalLM":  # moe_layers (from interleave_moe_layer_step)
        step = int(config.get("interleave_moe_layer_step") or 1)
        layers = config.get("moe_layers")
        return layer in layers if layers is not None else (layer + 1) % step == 0
    moe_spec(architecture, config)  # refuses other architectures
    return True


def route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
    routing: MoeRouting,
    use_kernel: bool | None = None,
    widen: bool = False,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], router_weight [E, H], router_bias [E] or None -> (topk_weights [T, k] (fp32, or
    x's dtype where the routing says so), topk_ids [T, k] int64), in transformers' order (exact
    ties aside: see the module docstring).

    The logits are F.linear's; the rest runs in the fused kernel (kernels/moe_route_kernel.py)
    where ``use_kernel`` (None: where the logits are on CUDA) and the kernel takes the router's
    width and top-k, else in torch (``route_torch``). With ``widen`` weights in x's dtype come as
    fp32 holding the same values: fused_moe reads fp32 weights, and the kernel writes them so in
    its one launch (ops.moe on a GPU; a bf16 or fp16 weight times an activation of that dtype is
    exact in fp32, so even the naive expert loop's products round as before).

    ``config`` (the tuning table's "moe_router" entry for the token bucket; kernel path only): a
    fused config runs the router GEMV and the routing as one launch
    (moe_route_kernel.router_route) where it takes the batch; None or the unfused one keeps
    F.linear and the routing kernel."""
    x_dtype = x.dtype
    if routing.fp32_logits:  # an fp32 router (GLM-4.5's, ERNIE 4.5's, HunYuan's): the logits in fp32
        x, router_weight = x.float(), router_weight.float()
        router_bias = None if router_bias is None else router_bias.float()
        config = None  # the fused router computes its GEMV in x's dtype
    if routing.scoring == "topk_sigmoid":  # torch ops on every device: the logits in x's dtype
        weights, ids = route_torch(torch.nn.functional.linear(x, router_weight, router_bias), routing)
        return (weights.float() if widen else weights), ids
    if routing.scoring in ("sigmoid_group", "softmax_bias"):  # router_bias is the choice's score bias
        logits = torch.nn.functional.linear(x, router_weight.to(x.dtype)).float()
        weights, ids = route_torch(logits, routing, router_bias)
        weights = weights.to(weights_dtype(routing, x_dtype))
        return (weights.float() if widen else weights), ids
    if use_kernel is None:
        use_kernel = x.is_cuda
    if use_kernel:
        from pagecast.kernels import moe_route_kernel

        dtype = weights_dtype(routing, x.dtype)
        if moe_route_kernel.runs_fused(config, x.shape[0], router_weight.shape[0], routing.top_k):
            return moe_route_kernel.router_route(
                x, router_weight, router_bias, routing.top_k, routing.scoring, routing.renormalize, dtype, widen,
                config,
            )  # fmt: skip
        if moe_route_kernel.supported(router_weight.shape[0], routing.top_k):
            logits = torch.nn.functional.linear(x, router_weight, router_bias)  # [T, E] in x's dtype
            return moe_route_kernel.route_logits(
                logits, routing.top_k, routing.scoring, routing.renormalize, dtype, widen
            )
    logits = torch.nn.functional.linear(x, router_weight, router_bias)
    weights, ids = route_torch(logits, routing)
    return (weights.float() if widen else weights), ids


def weights_dtype(routing: MoeRouting, x_dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``route``'s topk_weights for activations of ``x_dtype``."""
    if routing.scoring == "sigmoid_group":
        return torch.float32
    if routing.scoring in ("topk_softmax", "softmax_bias", "topk_sigmoid") or routing.weights_in_x_dtype:
        return x_dtype
    return torch.float32


def route_torch(
    logits: torch.Tensor, routing: MoeRouting, score_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` from the logits [T, E] (x's dtype; fp32 for sigmoid_group and softmax_bias, whose
    ``score_bias`` [E] biases the choice, and whose weights come back fp32) in torch ops, as
    transformers routes: the CPU path and the fused kernel's reference."""
    if routing.scoring == "sigmoid_group":
        return _route_sigmoid_group(logits, routing, score_bias)
    if routing.scoring == "softmax_bias":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        choice = probs if score_bias is None else probs + score_bias.float().reshape(-1)
        ids = torch.topk(choice, routing.top_k, dim=-1)[1]
        top = probs.gather(-1, ids)
        top = top / torch.clamp(top.sum(dim=-1, keepdim=True), min=routing.norm_min)
        return top, ids  # fp32: route rounds them to x's dtype
    if routing.scoring == "topk_softmax":
        top, ids = torch.topk(logits, routing.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids
    if routing.scoring == "topk_sigmoid":
        top, ids = torch.topk(logits, routing.top_k, dim=-1)
        return torch.sigmoid(top.float()).to(logits.dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, routing.top_k, dim=-1)
    if routing.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    if routing.weights_in_x_dtype:
        top = top.to(logits.dtype)
    return top, ids


def _route_sigmoid_group(
    logits: torch.Tensor, routing: MoeRouting, score_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """sigmoid_group (the module docstring), in transformers' order of operations."""
    scores = logits.sigmoid()
    choice = scores if score_bias is None else scores + score_bias.float()
    t, e = choice.shape
    if routing.n_group > 1:
        per_group = choice.view(t, routing.n_group, e // routing.n_group)
        group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
        keep = torch.topk(group_scores, k=routing.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0).bool()
        choice = choice.masked_fill(~mask.repeat_interleave(e // routing.n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, k=routing.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scale, ids


def gpt_oss_experts(
    gate_up_proj: torch.Tensor, gate_up_bias: torch.Tensor, down_proj: torch.Tensor, down_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss's experts (gate_up_proj [E, H, 2I] with gate in the even columns and up in the odd
    ones, gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H]) in the common
    layout: (w_gate_up [E, 2I, H], w_down [E, H, I], b_gate_up [E, 2I], b_down [E, H])."""
    w = gate_up_proj.transpose(1, 2)
    w_gate_up = torch.cat((w[:, 0::2], w[:, 1::2]), dim=1).contiguous()
    b_gate_up = torch.cat((gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]), dim=1).contiguous()
    return w_gate_up, down_proj.transpose(1, 2).contiguous(), b_gate_up, down_bias.contiguous()


def _gate_up_rows(intermediate: int, rank: int, size: int) -> torch.Tensor:
    if intermediate % size:
        raise ValueError(f"the experts' intermediate size {intermediate} is not divisible by tp {size}")
    s = intermediate // size
    return torch.cat(
        (
            torch.arange(rank * s, (rank + 1) * s),
            torch.arange(intermediate + rank * s, intermediate + (rank + 1) * s),
        )
    )


def shard_experts(
    w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None,
    rank: int, size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Rank ``rank`` of ``size``'s share of the experts: every expert, the rank's slice of its
    intermediate dimension (gate rows and up rows [r*I/n, (r+1)*I/n), down columns the same).
    The ranks' outputs are partial sums whose total is the layer's output; b_down is added once,
    so rank 0 holds it and the others hold zeros (it is scaled by each token's routing weight,
    so it cannot be added after the sum like a row-parallel linear's bias)."""
    rows = _gate_up_rows(w_gate_up.shape[1] // 2, rank, size)
    s = w_down.shape[2] // size
    w_gu = w_gate_up.index_select(1, rows.to(w_gate_up.device)).contiguous()
    w_d = w_down[:, :, rank * s : (rank + 1) * s].contiguous()
    b_gu = None if b_gate_up is None else b_gate_up.index_select(1, rows.to(b_gate_up.device)).contiguous()
    b_d = None if b_down is None else (b_down.clone() if rank == 0 else torch.zeros_like(b_down))
    return w_gu, w_d, b_gu, b_d


def shard_shared_expert(shared: SharedExpert, rank: int, size: int) -> SharedExpert:
    """The shared expert (half-type weights) cut as a dense MLP is: gate_up rows, down columns."""
    rows = _gate_up_rows(shared.w_gate_up.shape[0] // 2, rank, size)
    s = shared.w_down.shape[1] // size
    return SharedExpert(
        shared.w_gate_up.index_select(0, rows.to(shared.w_gate_up.device)).contiguous(),
        shared.w_down[:, rank * s : (rank + 1) * s].contiguous(),
        shared.gate,
    )

"""pagecast."""

# The kernel ABI: the version of the calls the builder's rendered model.py makes into
# pagecast.kernels (names, argument order, meaning). enginebuild records it in the manifest and
# the runtime refuses an artifact built for a newer one, or for one older than KERNEL_ABI_OLDEST.
# Bump it in the same change that alters
# such a call (a template in templates/ or a kernel's signature), so old artifacts are refused
# with a rebuild command instead of calling the new kernels with old arguments.
# 2: ops.rotary_and_write_kv takes q_norm, k_norm and qk_norm_eps (per-head q/k RMSNorm fused into
# the rotary kernel). A change that only adds to the calls keeps the older model code working:
# KERNEL_ABI_OLDEST is the oldest ABI whose artifacts this pagecast still runs.
# 3: ops.lm_head takes an FP8 head (quant_linear.Fp8LinearWeight, enginebuild --fp8-lm-head).
# 4: ops.paged_attention takes out=, and ops.moe_stays_on_device is new (the model's graph pieces
# for mixed-step CUDA graphs, runtime/cuda_graphs.py MixedGraphs).
# 5: ops.prefetch_to_l2 and ops.join_prefetch are new (an experimental L2 prefetch of the o
# projection, removed since: no faster end to end). ABI-5 model code still calls them; they do nothing.
# 6: ops.add_norm_moe is new (a MoE layer's residual add and post-attention norm, inside the fused
# router's launch where the table fuses the router).
# 7: ops.norm_linear is new (a layer's norm and the projection it feeds, the FP8 projections' input
# quantised in the norm's launch).
# 8: ops.lm_head takes widen= (False: the logits in the model's dtype, not an fp32 copy; the
# default keeps older model code's fp32 logits).
# 9: ops.rotary_and_write_kv takes qk_norm_after= (the per-head q/k norms applied once rotated: HunYuan).
# 10: ops.paged_attention takes chunk= (a layer's attention chunk: Llama 4's chunked attention).
KERNEL_ABI = 10
KERNEL_ABI_OLDEST = 1

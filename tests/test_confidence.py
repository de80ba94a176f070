"""Sampling stays exact under confidence-scheduled verification only if the confidence of draft i
(what decides whether draft i is verified) is known before draft i is drawn: it may depend on the
drafts before it, never on draft i itself. The chi-square tests have little power against a cut
that peeks (a biased confidence passed them at p = 0.94), so this checks the property directly, for
every drafter family: two chains that differ only in the token drawn at position i must have the
same confidences at positions <= i."""

import pytest
import torch

from conftest import FAMILIES, random_drafter
from drafters.target.vocab import build_draft_vocab
from serving.engine import Sampler
from transformers import DynamicCache


def drafter_state(name, target):
    """A random-init drafter of family `name` with its context extended over a prompt, as the
    engine leaves it before proposing: (drafter, its cache, feature, logits)."""
    stream = torch.randint(0, target.spec.vocab_size, (5000,), generator=torch.Generator().manual_seed(1)).tolist()
    vocab = build_draft_vocab([(stream, [1] * len(stream))], target.spec.vocab_size, 64, {"seed": 1})
    drafter = random_drafter(name, target, vocab).eval()
    ids = torch.randint(0, target.spec.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    target_cache = DynamicCache()
    aux, _ = target.capture(ids, None, drafter.capture_layers(), cache=target_cache)
    cache = drafter.new_cache(target_cache)
    feature, logits = drafter.extend(cache, aux, torch.cat([ids[:, 1:], ids[:, :1]], 1))
    return drafter, cache, feature, logits


class Draws:
    """A sampler's draw (T = 1) that records what it drew, or replays a recording with the draft at
    chain position `swap` replaced by another token. A step drafter draws one position per call
    ([B, V] logits), a parallel drafter every position at once ([B, K, V])."""

    def __init__(self, recorded: list[torch.Tensor] | None = None, swap: int = -1):
        self.recorded, self.swap, self.made = recorded, swap, []
        self.sampler, self.position = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(3)), 0

    def __call__(self, logits):
        drafts, dist = self.sampler.draw(logits)
        if self.recorded is not None:
            drafts = self.recorded[len(self.made)].clone()
            columns = drafts.view(drafts.shape[0], -1)  # [B, positions drawn in this call]
            if self.position <= self.swap < self.position + columns.shape[1]:
                column = columns[:, self.swap - self.position]
                column.copy_((column + 1) % dist.shape[-1])  # another draft token
            self.position += columns.shape[1]
        self.made.append(drafts)
        return drafts, dist


@pytest.mark.parametrize("name", FAMILIES)
def test_a_drafts_confidence_does_not_depend_on_its_own_draw(name, tiny_target):
    steps = 4
    drafter, cache, feature, logits = drafter_state(name, tiny_target)
    length = cache.length
    for swap in range(steps):
        recording = Draws()
        first, _, confidence = drafter.propose_chain(cache, feature, logits, steps, recording)
        cache.crop(length)
        second, _, swapped = drafter.propose_chain(cache, feature, logits, steps, Draws(recording.made, swap))
        cache.crop(length)
        assert first[0, swap] != second[0, swap] and torch.equal(first[0, :swap], second[0, :swap])
        torch.testing.assert_close(confidence[0, : swap + 1], swapped[0, : swap + 1], rtol=0, atol=0)

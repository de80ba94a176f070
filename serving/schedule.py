"""schedule=auto: per target forward, how many head and n-gram drafts to verify, so that speculation
is never (much) slower than plain decoding.

Each iteration picks the head's chain length and the n-gram continuation's length that maximize
expected tokens per second:

    expected tokens = 1 + sum_i P(the drafts 1..i of at least one source are all accepted)
    seconds         = verify_cost[1 + head drafts + n-gram drafts] + the head's drafting time

from online estimates: per source (the head; n-gram drafts by match length) and per position, the
chance a draft is accepted when the ones before it were (Beta(1, 1) prior, counted as tokens are
accepted); the verification forward's seconds per token count (the shape measured at start-up,
scaled by a running average of measured / predicted over the forwards actually run, so that a
context that grows slows every count alike); the head's seconds per drafting call and per draft
step (running averages). A head whose drafts are never accepted stops being run at all, and is
probed again at intervals that double while it stays useless, so a useless head costs ~nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of the newest measurement in the running averages of seconds
LONGEST_PROBE_INTERVAL = 64  # iterations between probes of a head that keeps losing


@dataclass
class Acceptance:
    """Per position: drafts verified with every earlier draft accepted, and how many were accepted."""

    tried: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def rate(self, position: int) -> float:
        if position >= len(self.tried):
            return 0.5
        return (self.accepted[position] + 1) / (self.tried[position] + 2)

    def survival(self, drafts: int) -> list[float]:
        """P(drafts 1..i all accepted), i = 1..drafts."""
        chance, out = 1.0, []
        for position in range(drafts):
            chance *= self.rate(position)
            out.append(chance)
        return out

    def record(self, drafts: int, accepted: int) -> None:
        """`drafts` verified, the first `accepted` of them accepted."""
        while len(self.tried) < drafts:
            self.tried.append(0)
            self.accepted.append(0)
        for position in range(min(accepted + 1, drafts)):
            self.tried[position] += 1
            self.accepted[position] += int(position < accepted)


class AutoSchedule:
    def __init__(self, verify_cost: list[float], steps: int):
        """`verify_cost[n]`: seconds of a verification forward over n tokens (n >= 1), index 0 unused;
        `steps`: the most head drafts per forward. One schedule serves every prompt of a session:
        what it learned about the head and the n-gram drafts carries over."""
        self.measured = list(verify_cost)  # at start-up, over a short context
        self.scale = 1.0  # how much slower forwards run now than at start-up
        self.steps = steps
        self.head = Acceptance()
        self.ngram: dict[int, Acceptance] = {}  # by match length
        self.head_call = 0.0  # seconds of a drafting call (context extension + the first draft)
        self.head_step = 0.0  # seconds of each further draft step
        self.since_head = 0
        self.probe_interval = 1

    def cost(self, tokens: int) -> float:
        while tokens >= len(self.measured):  # beyond the measured range: grow linearly
            self.measured.append(2 * self.measured[-1] - self.measured[-2])
        return self.measured[tokens] * self.scale

    def plan(self, head: bool, ngram_drafts: int, match: int, both: bool = True) -> tuple[int, int]:
        """(head drafts, n-gram drafts) to verify next: `ngram_drafts` are on offer from a match of
        `match` tokens; `head`: whether there is a head at all; `both=False`: drafts of one source
        only (sampling verifies one proposal distribution per node)."""
        ngram = self.ngram.setdefault(match, Acceptance()).survival(ngram_drafts) if ngram_drafts else []
        head_survival = self.head.survival(self.steps) if head else []
        best, choice = 0.0, (0, 0)
        for head_drafts in range(len(head_survival) + 1):
            seconds_head = (self.head_call + (head_drafts - 1) * self.head_step) if head_drafts else 0.0
            for ngram_count in range(len(ngram) + 1 if both or not head_drafts else 1):
                expected = 1.0
                for i in range(max(head_drafts, ngram_count)):
                    miss_head = 1 - head_survival[i] if i < head_drafts else 1.0
                    miss_ngram = 1 - ngram[i] if i < ngram_count else 1.0
                    expected += 1 - miss_head * miss_ngram
                rate = expected / (self.cost(1 + head_drafts + ngram_count) + seconds_head)
                if rate > best:
                    best, choice = rate, (head_drafts, ngram_count)
        if head and choice[0] == 0:
            self.since_head += 1
            if self.since_head >= self.probe_interval:  # probe: one draft, to keep the estimate honest
                choice = (1, choice[1] if both else 0)
        return choice

    def record_head(self, drafts: int, accepted: int, call_seconds: float, step_seconds: float | None) -> None:
        self.head.record(drafts, accepted)
        self.head_call = _average(self.head_call, call_seconds)
        if step_seconds is not None:
            self.head_step = _average(self.head_step, step_seconds)
        if self.since_head >= self.probe_interval:  # this was a probe
            self.probe_interval = 1 if accepted else min(2 * self.probe_interval, LONGEST_PROBE_INTERVAL)
        self.since_head = 0

    def record_ngram(self, match: int, drafts: int, accepted: int) -> None:
        self.ngram.setdefault(match, Acceptance()).record(drafts, accepted)

    def record_forward(self, tokens: int, seconds: float) -> None:
        self.scale = _average(self.scale, seconds / self.cost(tokens) * self.scale)


def _average(old: float, new: float) -> float:
    return new if old == 0 else (1 - SMOOTHING) * old + SMOOTHING * new

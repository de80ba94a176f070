"""schedule=auto: per target forward, how many head and n-gram drafts to verify, so that speculation
is never (much) slower than plain decoding.

Each iteration picks the head's chain length and the n-gram continuation's length that maximize
expected tokens per second:

    expected tokens = 1 + sum_i P(the drafts 1..i of at least one source are all accepted)
    seconds         = verify_cost[1 + head drafts + n-gram drafts] + the head's drafting time
                      + what verifying drafts adds to an iteration besides its forward

from online estimates: per source (the head; n-gram drafts by match length) and per position, the
chance a draft is accepted when the ones before it were (Beta(1, 1) prior, counted as tokens are
accepted); the verification forward's seconds per token count (the shape measured at start-up,
scaled by a running average of measured / predicted over the forwards actually run, so that a
context that grows slows every count alike); the head's seconds per drafting call and per draft
step (running averages). A head whose drafts do not pay stops being run at all, and is probed with
one draft at intervals that double after each probe (however that draft fared) until the estimates
say it pays again, so a head that does not pay costs ~nothing.

A head that runs drafts as far as its confidences say (EAGLE-2's observation: a head's confidence
predicts acceptance): each draft's chance given its confidence is calibrated online, drafting stops
once the next draft cannot pay for its step, and the prefix whose calibrated survival pays for the
extra verified tokens is verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of the newest measurement in the running averages of seconds
LONGEST_PROBE_INTERVAL = 64  # iterations between probes of a head that does not pay
# a forward with drafts must promise this much more than a plain step: the estimates are noisy,
# and a head that barely pays on paper measured 3-5% slower than plain decoding
MARGIN = 0.05
# a drafting call's seconds are learned from calls whose context extension added at most this many
# entries, what a head that drafts at every forward extends by (one forward's committed tokens);
# a longer catch-up (the prompt, or the tokens since the head last ran) is paid once, and counting
# it as the cost of every call made a head that ran rarely look too slow to ever run more often
STEADY_EXTENSION = 16


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


class Calibration:
    """P(a head draft is accepted | the ones before it were, its confidence): per tenth of the
    confidence range, counted as drafts are verified, the prior pulled toward the confidence itself."""

    BINS = 10

    def __init__(self):
        self.tried = [0] * self.BINS
        self.accepted = [0] * self.BINS

    def rate(self, confidence: float) -> float:
        b = min(int(confidence * self.BINS), self.BINS - 1)
        return (self.accepted[b] + 2 * confidence) / (self.tried[b] + 2)

    def record(self, confidences: list[float], accepted: int) -> None:
        for position, confidence in enumerate(confidences[: accepted + 1]):
            b = min(int(confidence * self.BINS), self.BINS - 1)
            self.tried[b] += 1
            self.accepted[b] += int(position < accepted)


class AutoSchedule:
    def __init__(self, verify_cost: list[float], steps: int):
        """`verify_cost[n]`: seconds of a verification forward over n tokens (n >= 1), index 0 unused;
        `steps`: the most head drafts per forward. One schedule serves every prompt of a session:
        what it learned about the head and the n-gram drafts carries over."""
        self.measured = list(verify_cost)  # at start-up, over a short context
        self.scale = 1.0  # how much slower forwards run now than at start-up
        self.steps = steps
        self.head = Acceptance()
        self.calibration = Calibration()
        self.rate = 0.0  # the planned forward's expected tokens per second
        self.ngram: dict[int, Acceptance] = {}  # by match length
        self.head_call = 0.0  # seconds of a drafting call (context extension + the first draft)
        self.head_step = 0.0  # seconds of each further draft step
        self.since_head = 0
        self.probe_interval = 1
        self.probing = False  # the planned forward probes the head: its one draft is verified, whatever the cut says
        # seconds of an iteration besides its forward and the head (lookup, tree, verify kernel,
        # committing), with drafts to verify and without
        self.overhead = {True: 0.0, False: 0.0}

    def cost(self, tokens: int) -> float:
        while tokens >= len(self.measured):  # beyond the measured range: grow linearly
            self.measured.append(2 * self.measured[-1] - self.measured[-2])
        return self.measured[tokens] * self.scale

    def plan(self, head: bool, ngram_drafts: int, match: int, both: bool = True) -> tuple[int, int]:
        """(head drafts, n-gram drafts) to verify next: `ngram_drafts` are on offer from a match of
        `match` tokens (negative: in earlier requests' text, counted apart); `head`: whether there is a head at all; `both=False`: drafts of one source
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
                extra = max(self.overhead[True] - self.overhead[False], 0.0) if head_drafts or ngram_count else 0.0
                rate = expected / (self.cost(1 + head_drafts + ngram_count) + seconds_head + extra)
                if head_drafts or ngram_count:
                    rate /= 1 + MARGIN
                if rate > best:
                    best, choice = rate, (head_drafts, ngram_count)
        self.rate = best
        self.probing = False
        if head and choice[0] == 0:
            self.since_head += 1
            if self.since_head >= self.probe_interval:  # probe: one draft, to keep the estimate honest
                self.probing = True
                return 1, choice[1] if both else 0
            return choice
        if head:
            self.probe_interval = 1  # the estimates say the head pays (again)
        # a head that runs drafts as far as its confidences say (`stop`, `cut`): up to `steps`
        return (self.steps if head else 0), choice[1]

    def _pays(self, survival: float, head_drafts: int, ngram_drafts: int, step: bool) -> bool:
        """Whether a head draft that survives with this chance adds more tokens than its seconds
        (verifying one more token; `step`: also drafting it) take at the planned rate."""
        tokens = 1 + head_drafts + ngram_drafts
        seconds = self.cost(tokens + 1) - self.cost(tokens) + (self.head_step if step else 0.0)
        return survival >= self.rate * seconds

    def stop(self, confidences: list[float], ngram_drafts: int) -> bool:
        """While drafting (after each draft): True when the next draft cannot pay for its step."""
        survival = 1.0
        for confidence in confidences:
            survival *= self.calibration.rate(confidence)
        return not self._pays(survival, len(confidences), ngram_drafts, step=True)

    def cut(self, confidences: list[float], ngram_drafts: int) -> int:
        """How many of the head's drafts to verify: the prefix whose calibrated survival pays for
        its verification. Each draft's confidence depends only on the drafts before it, so the
        cut never looks at a draft's own value (sampling stays exact). A probe's draft is always
        verified: a probe cut away would teach nothing and count as a rejection."""
        if self.probing:
            return min(len(confidences), 1)
        survival, keep = 1.0, 0
        for confidence in confidences:
            survival *= self.calibration.rate(confidence)
            if not self._pays(survival, keep, ngram_drafts, step=False):
                break
            keep += 1
        return keep

    def record_head(self, confidences: list[float], accepted: int, call_seconds: float,
                    step_seconds: float | None, extended: int = 1) -> None:
        """The head ran: its verified drafts' confidences, how many were accepted, its seconds (the
        call's context extension added `extended` entries). A run whose every draft was cut counts
        as a first draft rejected: a head too unsure to verify stops being run, like one that is wrong."""
        self.head.record(max(len(confidences), 1), accepted)
        self.calibration.record(confidences, accepted)
        if extended <= STEADY_EXTENSION:
            self.head_call = _average(self.head_call, call_seconds)
        if step_seconds is not None:
            self.head_step = _average(self.head_step, step_seconds)
        if self.probing:  # an accepted probe is a count for the estimates, not a verdict
            self.probe_interval = min(2 * self.probe_interval, LONGEST_PROBE_INTERVAL)
        self.since_head = 0

    def record_ngram(self, match: int, drafts: int, accepted: int) -> None:
        self.ngram.setdefault(match, Acceptance()).record(drafts, accepted)

    def record_overhead(self, drafts: bool, seconds: float) -> None:
        self.overhead[drafts] = _average(self.overhead[drafts], seconds)

    def record_forward(self, tokens: int, seconds: float) -> None:
        self.scale = _average(self.scale, seconds / self.cost(tokens) * self.scale)


def _average(old: float, new: float) -> float:
    return new if old == 0 else (1 - SMOOTHING) * old + SMOOTHING * new

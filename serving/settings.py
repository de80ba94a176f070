"""conf/serve.yaml's and conf/bench.yaml's schemas: checked before the artifact loads
(drafters/settings.py says how)."""

from __future__ import annotations

from dataclasses import dataclass

from drafters.settings import PRECISIONS, anything, at_least, between, nonempty, one_of


@dataclass
class Ngram:
    shortest: int = at_least(1)
    longest: int = at_least(1)
    branches: int = at_least(1)
    length: int = at_least(1)
    head: str = one_of("chain", "tree")
    earlier: bool = anything()


@dataclass
class Decoding:
    """What serving.run and serving.bench share: the artifact and how to decode with it."""

    artifact: str = nonempty()
    max_new_tokens: int = at_least(1)
    dtype: str = one_of(*PRECISIONS)
    draft: str = one_of("chain", "tree", "ngram", "hybrid")
    steps: int = at_least(1)
    min_confidence: float = between(0, 1)
    cost_schedule: bool = anything()
    schedule: str = one_of("fixed", "auto")
    depth: int = at_least(1)
    topk: int = at_least(1)
    total_tokens: int = at_least(1)
    ngram: Ngram = anything()
    temperature: float = at_least(0)
    top_p: float = between(0, 1, open_low=True)
    seed: int = between(0, 2**32 - 1)  # numpy's seed range, as in training


@dataclass
class Serve(Decoding):
    prompt: str = anything()
    compare_plain: bool = anything()


@dataclass
class Bench(Decoding):
    prompts: object = anything()  # a set's name or file, or a list of them (serving/prompts.py checks each)
    n: int = at_least(1)
    tie_tolerance: float = at_least(0)
    prompt_lookup_tokens: int = at_least(0)
    hf_plain: bool = anything()
    out: str = nonempty()

"""Aux layer ids: the one place that translates between conventions.

Ours (and EAGLE's, vLLM's, speculators'): id k = the hidden state *entering* decoder layer k
(HF `hidden_states[k]`; 0 = the embedding output). SpecForge and SGLang's `eagle_config` name the
layer that *produced* it: "output of layer k", which enters layer k+1 (SGLang adds 1 back
before capturing). So the same tensor is k in ours and k-1 in theirs.
"""

from __future__ import annotations

# how far each convention's id sits below the index of the layer the state enters
SHIFT = {"input": 0, "output": 1}


def translate_layer_ids(ids, source: str, dest: str) -> list[int]:
    """`ids` in the `source` convention ("input" | "output") written in the `dest` convention."""
    return [int(k) + SHIFT[source] - SHIFT[dest] for k in ids]

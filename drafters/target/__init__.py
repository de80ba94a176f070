"""The frozen target: loading it (HF dirs, hub ids, GGUF files), capturing its hidden states, the
precision it computes in, and the draft vocabulary drawn from its tokens."""

"""Export training checkpoints to serving artifacts (native, speculators/vLLM, SGLang)."""

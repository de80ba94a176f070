"""Hidden-state cache size: bytes per token and disk for N conversations, ours (bf16, fp8) against
speculators' [T, 4, H] bf16 layout, for any hidden size.

Renders ShareGPT conversations with the SmolLM2 chat template at each context length, measures
the mean tokens per conversation and the share of teacher positions (where training/hidden_cache.py
keeps the final hidden state), and applies the cache layout:
    ours bf16    (layers + f) x H x 2 + 4f bytes      f = teacher positions / tokens; 4f: greedy ids
    ours fp8     (layers + f) x (H + 4) + 4f bytes    + one fp32 scale per vector
    speculators  (layers + 1) x H x 2 bytes           every token
(offsets and safetensors headers add well under 0.1%; `python -m training.dump` prints the real size).

    python scripts/cache_size.py --conversations 2000 --contexts 2048 8192 --hidden 576 4096
"""

from __future__ import annotations

import argparse

from omegaconf import OmegaConf

from drafters.target.model import load_tokenizer
from training.data import load_conversations, render


def measure(tokenizer, conversations, max_length: int) -> tuple[float, float]:
    """(mean tokens per trained conversation, share of tokens that are teacher positions)."""
    tokens = teacher = kept = 0
    for conversation in conversations:
        example = render(tokenizer, conversation, max_length)
        if example is None:
            continue
        kept += 1
        tokens += len(example["input_ids"])
        teacher += sum(example["loss_mask"][1:])
    return tokens / kept, teacher / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2000, help="ShareGPT conversations to measure")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--hidden", type=int, nargs="+", default=[576, 4096], help="target hidden sizes")
    parser.add_argument("--layers", type=int, default=3, help="aux layers the drafter reads (EAGLE-3: 3)")
    parser.add_argument("--scale", type=int, default=100_000, help="conversations to project the disk for")
    args = parser.parse_args()

    tokenizer = load_tokenizer(OmegaConf.load("conf/target/llama.yaml"))
    conversations, _ = load_conversations(None, args.conversations)
    print(f"| hidden | context | tokens/conv | teacher share | ours bf16 B/token | ours fp8 B/token | "
          f"speculators B/token | {args.scale // 1000}k conv: ours bf16 | ours fp8 | speculators |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for max_length in args.contexts:
        per_conversation, share = measure(tokenizer, conversations, max_length)
        for hidden in args.hidden:
            sizes = [(args.layers + share) * hidden * 2 + 4 * share, (args.layers + share) * (hidden + 4) + 4 * share,
                     (args.layers + 1) * hidden * 2]
            disk = [f"{size * per_conversation * args.scale / 1e9:,.0f} GB" for size in sizes]
            print(f"| {hidden} | {max_length} | {per_conversation:,.0f} | {share:.1%} | "
                  + " | ".join(f"{size:,.0f} ({size / sizes[2]:.2f}x)" for size in sizes) + " | " + " | ".join(disk) + " |")


if __name__ == "__main__":
    main()

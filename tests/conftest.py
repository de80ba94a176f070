import os

# Must precede any import of kernels: Triton decorates them at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import glob  # noqa: E402
import importlib  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF_DIR = os.path.join(ROOT, "conf")


def compose_train(overrides: list[str] | None = None):
    """The same config `python -m training.run <overrides>` would see."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="train", overrides=overrides or [])


def run_cli(module: str, args: list[str], capsys) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` in this process, through its real `hydra.main` (the same code
    path, without the ~4 s of an interpreter start and imports)."""
    main = importlib.import_module(module).main
    argv = sys.argv
    sys.argv = [module, *args]
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.argv = argv
    captured = capsys.readouterr()
    return subprocess.CompletedProcess([module, *args], code, captured.out, captured.err)


def one_line_error(result: subprocess.CompletedProcess, *fragments) -> str:
    """Exit 2 and exactly one `error:` line on stderr, holding every fragment; returns the line."""
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def kill_while_writing(command: list[str], seconds: float, writing: str) -> bool:
    """Start `command`; SIGKILL it `seconds` after a path matching the glob `writing` (its temp
    name while it writes) appeared. Returns whether it was killed (not finished first)."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    began = None
    while process.poll() is None:
        if began is None and glob.glob(writing):
            began = time.monotonic()
        if began is not None and time.monotonic() - began >= seconds:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    return process.wait() == -signal.SIGKILL


VARIED_TARGET = ["target=tiny_llama", "+target.random_init.initializer_range=0.3"]
PROMPTS = ["Explain KV caches in one paragraph.", "Write a haiku about the sea.", "What is 17 * 23?"]


def chat_ids(target, text):
    """A user turn in the target's chat template, ready to generate from: [1, T] token ids."""
    rendered = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
    return target.tokenizer(rendered, return_tensors="pt", add_special_tokens=False)["input_ids"]


# The chi-square checks' threshold. A CI run makes ~16 of them, and the timing-driven schedules make
# some runs differ from run to run even when seeded: at 0.01 a correct engine failed one run in
# about seven (p=0.0095, hybrid + schedule=auto, 2026-12-01; 10k and 50k draws with other seeds gave
# p=0.33-0.86). At 0.001 a correct engine fails ~1.6% of CI runs.
CHI2_MIN_PVALUE = 0.001


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square goodness of fit; cells the target gives zero mass must stay empty."""
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token with zero target probability was emitted"
    o, e = observed[keep].double(), expected[keep].double()
    stat, dof = ((o - e) ** 2 / e).sum(), int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="session")
def tiny_target():
    from drafters.target import load_target

    torch.manual_seed(0)
    return load_target(compose_train(["target=tiny_llama"]).target)


@pytest.fixture(scope="session")
def varied_target():
    """A tiny random Llama with large weights: unlike tiny_target, whose greedy answers repeat one
    token, it answers with varied text, so drafts that agree with it mean something."""
    from drafters.target import load_target

    return load_target(compose_train(VARIED_TARGET).target)


@pytest.fixture(scope="session")
def smollm2_target():
    from drafters.target import load_target

    return load_target(compose_train(["target=llama"]).target)


@pytest.fixture(scope="session")
def smollm2_fp32_target():
    """SmolLM2 computing in float32: greedy serving is token-for-token plain decoding (in bf16, a
    forward over several tokens may round a near-tie the other way than one token at a time)."""
    from drafters.target import load_target

    return load_target(compose_train(["target=llama", "target.dtype=float32"]).target)


@pytest.fixture(scope="session")
def tiny_gemma3_target():
    """Random-init Gemma 3 with SmolLM2's tokenizer: sliding-window layers (window 8, shorter than the
    prompts) around one full-attention layer, Gemma's (1 + weight) norms and sqrt(H)-scaled embedding."""
    from omegaconf import OmegaConf

    from drafters.target import load_target

    cfg = OmegaConf.to_container(compose_train(["target=tiny_llama"]).target)
    cfg["name"] = "tiny-gemma3"
    cfg["random_init"].update(model_type="gemma3_text", num_hidden_layers=4, num_key_value_heads=1, sliding_window=8,
                              query_pre_attn_scalar=16,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
    return load_target(OmegaConf.create(cfg))


@torch.no_grad()
def self_distilled_batch(target, prompts: int = 4, length: int = 48, seed: int = 0) -> dict:
    """Random 8-token prompts continued by the target's own greedy decoding, the continuations
    loss-masked: data a drafter learns something verifiable from in a few steps."""
    ids = torch.randint(0, target.spec.vocab_size, (prompts, 8), generator=torch.Generator().manual_seed(seed))
    while ids.shape[1] < length:
        _, final = target.capture(ids, None, [])
        ids = torch.cat([ids, target.argmax(final[:, -1:])], 1)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 8:] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


def batch_vocab(target, batch: dict, size: int = 512):
    """The draft vocabulary of a batch's tokens (a self-distilled batch: the target's greedy tokens)."""
    from drafters.vocab import build_draft_vocab

    ids = batch["input_ids"].flatten().tolist()
    return build_draft_vocab([(ids, [1] * len(ids))], target.spec.vocab_size, size, {"test": "batch"})


def distilled_setup(target):
    """(target, a self-distilled batch, a draft vocabulary over it): what a drafter test trains on."""
    batch = self_distilled_batch(target)
    return target, batch, batch_vocab(target, batch)


def trained_on(drafter, setup, steps: int = 40):
    """`drafter` after `steps` real optimizer steps on `setup` (distilled_setup): (drafter in eval
    mode, the (loss, acc/1) history)."""
    from drafters.base import capture

    target, batch, vocab = setup
    history = train_steps(drafter, batch, capture(target, vocab, batch, drafter.capture_layers()), steps)
    return drafter.eval(), history


def train_steps(drafter, batch: dict, captured, steps: int, lr: float = 1e-2) -> list[tuple[float, float]]:
    """Real optimizer steps on one batch; (loss, acc/1) after each."""
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    history = []
    for _ in range(steps):
        loss, metrics = drafter.loss(batch, captured)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append((loss.item(), float(metrics["acc/1"])))
    return history


def lossless_accept_len(target, drafter, prompts: torch.Tensor, max_new_tokens: int, **draft) -> float:
    """Generate from each prompt with and without the drafter: the outputs must be identical (greedy);
    returns the mean tokens committed per target forward."""
    from serving.engine import generate_plain, generate_spec

    accept_lens = []
    for prompt in prompts:
        plain, _ = generate_plain(target, prompt[None], max_new_tokens, set())
        spec, stats = generate_spec(target, drafter, prompt[None], max_new_tokens, set(), **draft)
        assert spec == plain
        accept_lens.append(stats.accept_len)
    return sum(accept_lens) / len(accept_lens)


def head_for(target, draft_size, seed=0):
    """An untrained EAGLE-3 head: it drafts mostly wrong tokens, the hard case for losslessness."""
    from drafters.base import build_drafter
    from drafters.vocab import build_draft_vocab

    stream = torch.randint(0, target.spec.vocab_size, (20000,), generator=torch.Generator().manual_seed(seed)).tolist()
    vocab = build_draft_vocab([(stream, [1] * len(stream))], target.spec.vocab_size, draft_size, {"seed": seed})
    torch.manual_seed(seed)
    return build_drafter(compose_train().drafter, target, vocab).eval()

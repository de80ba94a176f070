import os

# pytest runs on two workers (pyproject's -n 2): one torch thread each, in this process and in the
# commands tests start, or two workers' spin-waiting threads slow small-model work ~25x on 2 cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
# Must precede any import of kernels: Triton decorates them at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import glob  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from drafters.base import build_drafter, capture  # noqa: E402
from drafters.storage.artifact import SavedDrafter, default_proposal, read, verifier_of, write_native  # noqa: E402
from drafters.target.model import load_target  # noqa: E402
from drafters.target.vocab import build_draft_vocab  # noqa: E402
from export import formats  # noqa: E402
from export.run import export  # noqa: E402
from serving.engine import generate_plain, generate_spec  # noqa: E402

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
    """Chi-square goodness of fit; cells the target gives zero mass must stay empty, cells expecting
    fewer than 5 are pooled into one (the chi-square approximation needs counts)."""
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token with zero target probability was emitted"
    o, e = observed[keep].double(), expected[keep].double()
    small = e < 5
    if small.sum() > 1:
        o, e = torch.cat([o[~small], o[small].sum(0, keepdim=True)]), torch.cat([e[~small], e[small].sum(0, keepdim=True)])
    stat, dof = ((o - e) ** 2 / e).sum(), int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="session")
def tiny_target():
    torch.manual_seed(0)
    return load_target(compose_train(["target=tiny_llama"]).target)


@pytest.fixture(scope="session")
def varied_target():
    """A tiny random Llama with large weights: unlike tiny_target, whose greedy answers repeat one
    token, it answers with varied text, so drafts that agree with it mean something."""
    return load_target(compose_train(VARIED_TARGET).target)


@pytest.fixture(scope="session")
def smollm2_target():
    return load_target(compose_train(["target=llama"]).target)


@pytest.fixture(scope="session")
def smollm2_fp32_target():
    """SmolLM2 computing in float32: greedy serving is token-for-token plain decoding (in bf16, a
    forward over several tokens may round a near-tie the other way than one token at a time)."""
    return load_target(compose_train(["target=llama", "target.dtype=float32"]).target)


@pytest.fixture(scope="session")
def tiny_gemma3_target():
    """Random-init Gemma 3 with SmolLM2's tokenizer: sliding-window layers (window 8, shorter than the
    prompts) around one full-attention layer, Gemma's (1 + weight) norms and sqrt(H)-scaled embedding."""


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
    ids = batch["input_ids"].flatten().tolist()
    return build_draft_vocab([(ids, [1] * len(ids))], target.spec.vocab_size, size, {"test": "batch"})


def distilled_setup(target):
    """(target, a self-distilled batch, a draft vocabulary over it): what a drafter test trains on."""
    batch = self_distilled_batch(target)
    return target, batch, batch_vocab(target, batch)


def trained_on(drafter, setup, steps: int = 40):
    """`drafter` after `steps` real optimizer steps on `setup` (distilled_setup): (drafter in eval
    mode, the (loss, acc/1) history)."""
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
    accept_lens = []
    for prompt in prompts:
        plain, _ = generate_plain(target, prompt[None], max_new_tokens, set())
        spec, stats = generate_spec(target, drafter, prompt[None], max_new_tokens, set(), **draft)
        assert spec == plain
        accept_lens.append(stats.accept_len)
    return sum(accept_lens) / len(accept_lens)


def head_for(target, draft_size, seed=0):
    """An untrained EAGLE-3 head: it drafts mostly wrong tokens, the hard case for losslessness."""
    stream = torch.randint(0, target.spec.vocab_size, (20000,), generator=torch.Generator().manual_seed(seed)).tolist()
    vocab = build_draft_vocab([(stream, [1] * len(stream))], target.spec.vocab_size, draft_size, {"seed": seed})
    torch.manual_seed(seed)
    return build_drafter(compose_train().drafter, target, vocab).eval()


def vocab_over(target, tokens, size=512):
    """A draft vocabulary holding `tokens` (padded with the lowest other ids)."""
    return build_draft_vocab([(tokens, [1] * len(tokens))], target.spec.vocab_size, size, {"tokens": len(tokens)})


def conversation(target, tokens=40):
    """A prompt, the target's greedy answer, and the two as a training batch on the answer."""
    ids = chat_ids(target, PROMPTS[0])
    reply, _ = generate_plain(target, ids, tokens, set())
    sequence = torch.cat([ids, torch.tensor([reply])], 1)
    loss_mask = torch.zeros_like(sequence)
    loss_mask[:, ids.shape[1]:] = 1
    return ids, reply, {"input_ids": sequence, "attention_mask": torch.ones_like(sequence), "loss_mask": loss_mask}


def saved(drafter, target_cfg) -> SavedDrafter:
    """The drafter as an artifact would hold it, for the format writers."""
    hparams, target_cfg = drafter.hparams(), OmegaConf.to_container(target_cfg, resolve=True)
    return SavedDrafter(drafter.name, hparams, verifier_of(drafter.spec.to_dict(), target_cfg), target_cfg,
                        {name: tensor.detach().clone() for name, tensor in drafter.state_dict().items()},
                        default_proposal(drafter.name, hparams))


def assert_drafts_alike(saved_drafter: SavedDrafter, drafter, target, ids):
    """The saved drafter, rebuilt, drafts what `drafter` drafts (features and logits after `ids`)."""
    rebuilt = saved_drafter.build("test").eval()
    aux, _ = target.capture(ids, None, drafter.capture_layers())
    tokens = ids.roll(-1, 1)
    torch.testing.assert_close(rebuilt.extend(rebuilt.new_cache(), aux, tokens),
                               drafter.extend(drafter.new_cache(), aux, tokens))


def native_round_trip(drafter, target_cfg, target, ids, directory) -> SavedDrafter:
    """Write the drafter as a native artifact and check that what reads back drafts the same."""
    saved_drafter = saved(drafter, target_cfg)
    directory.mkdir()
    write_native(saved_drafter, str(directory))
    assert_drafts_alike(read(str(directory)), drafter, target, ids)
    return saved_drafter


def imported(directory, target, cfg) -> SavedDrafter:
    """Another engine's head dir read as export.run reads it (the format found from its config.json)."""
    config = json.loads((directory / "config.json").read_text())
    context = formats.ImportFor(target, OmegaConf.to_container(cfg.target, resolve=True),
                                OmegaConf.to_container(cfg.drafter, resolve=True))
    return formats.reader(config, str(directory)).read(str(directory), config, context)


def edited_head(tmp_path, config, weights, edit):
    """A new head dir beside the others in `tmp_path`: `config` and `weights` as `edit(config, weights)` leaves them."""
    head = tmp_path / f"edited-{len(list(tmp_path.iterdir()))}"
    config, weights = OmegaConf.to_container(OmegaConf.create(config)), dict(weights)
    edit(config, weights)
    head.mkdir()
    (head / "config.json").write_text(json.dumps(config))
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, head / "model.safetensors")
    return head


def assert_read_back(directory, saved_drafter, drafter, target, ids, cfg):
    """What the head dir reads back as is the saved drafter: the same hyper-parameters, weights (bit
    for bit) and drafts."""
    back = imported(directory, target, cfg)
    assert (back.drafter, back.hparams, back.proposal) == (saved_drafter.drafter, saved_drafter.hparams,
                                                          saved_drafter.proposal)
    assert back.weights.keys() == saved_drafter.weights.keys()
    assert [name for name, tensor in saved_drafter.weights.items() if not torch.equal(back.weights[name], tensor)] == []
    assert_drafts_alike(back, drafter, target, ids)


def write_format(saved_drafter, fmt, directory):
    """`saved_drafter` written by format `fmt` into a new `directory`: its config and weights."""
    directory.mkdir()
    formats.writer(fmt, saved_drafter.drafter).write_checked(saved_drafter, str(directory), "test")
    return OmegaConf.load(directory / "config.json"), load_file(directory / "model.safetensors")


def assert_lossless_on_smollm2(smollm2, drafter_name, *options, **tree):
    """An untrained head on the real SmolLM2-135M (`smollm2_fp32_target`: no bf16 near-ties), greedy: a
    5-draft chain and a tree of shape `tree`, or each generate_spec option set in `options`."""
    cfg = compose_train(["target=llama", "target.dtype=float32", f"drafter={drafter_name}"])
    stream = torch.randint(0, smollm2.spec.vocab_size, (20000,), generator=torch.Generator().manual_seed(0)).tolist()
    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, smollm2, vocab_over(smollm2, stream, 4096)).eval()
    eos = {smollm2.tokenizer.eos_token_id}
    ids = chat_ids(smollm2, PROMPTS[0])
    plain, _ = generate_plain(smollm2, ids, 16, eos)
    for option in options or (dict(steps=5), dict(draft="tree", **tree)):
        assert generate_spec(smollm2, drafter, ids, 16, eos, **option)[0] == plain, option


def plain_replies(target):
    """The target's greedy answers to the other prompts: what lossless serving must reproduce."""
    return {text: generate_plain(target, chat_ids(target, text), 24, set())[0] for text in PROMPTS[1:]}


# The sampling tests' toy target: an 8-token vocabulary, and the prompt their exact joints are over.
TOY_VOCAB, TOY_PROMPT = 8, torch.tensor([[1, 5, 3, 7]])


def exact_joint(target, sampler, length: int) -> torch.Tensor:
    """p(t1, ..., t_length | TOY_PROMPT) over TOY_VOCAB**length sequences, from full forwards of every prefix."""
    joint = torch.ones(1)
    for step in range(length):
        prefixes = torch.cartesian_prod(*[torch.arange(TOY_VOCAB)] * step).view(-1, step) if step else torch.empty(1, 0)
        ids = torch.cat([TOY_PROMPT.expand(len(prefixes), -1), prefixes.long()], 1)
        _, final = target.capture(ids, None, [])
        probs = sampler.probs(target.logits(final[:, -1]))  # [TOY_VOCAB**step, TOY_VOCAB]
        joint = (joint[:, None] * probs).flatten()
    return joint


def encode(tokens: list[int]) -> int:
    code = 0
    for token in tokens:
        code = code * TOY_VOCAB + token
    return code


def run_export(**options) -> str:
    """What `python -m export.run key=value ...` does, in process."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="export", overrides=[f"{key}={value}" for key, value in options.items()])
    return export(cfg)


# training.run settings for a short run on the tiny random target
TINY_RUN = ["target=tiny_llama", "data.max_samples=60", "data.max_length=160", "trainer.batch_size=2",
        "trainer.eval_max_samples=8", "trainer.warmup_steps=2"]


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


FAMILIES = ["eagle3", "eagle", "medusa", "mtp", "gemma_mtp", "dflash", "dspark"]  # every drafter


def random_drafter(name: str, target, vocab):
    """A random-init drafter of family `name` on a tiny target (the block drafters read one aux layer:
    the tiny target has too few for their default five)."""
    torch.manual_seed(0)
    overrides = ["target=tiny_llama", f"drafter={name}"] + (["drafter.num_aux=1"] if name in ("dflash", "dspark") else [])
    return build_drafter(compose_train(overrides).drafter, target, vocab)

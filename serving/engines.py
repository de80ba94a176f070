"""`serving.bench engine=llamacpp|vllm`: the head served by a real engine, measured beside our loop.

The head is exported in the engine's format (a subprocess of `export.run`, into a temporary dir
beside `out`), and two servers of the engine start on 127.0.0.1: one plain, one speculative with
`steps` drafts per step. Each prompt goes to both, in alternating order, as token ids (what our
loop decodes, so no tokenizer differs), greedy. Per request: the tokens, the wall time, and the
drafts and accepted drafts from the engine's own counters (llama.cpp's response timings; vLLM's
Prometheus counters, read before and after, which also count acceptance by position).

Tokens per target forward are counted the same way for every engine and for our loop: new tokens
over (new tokens - accepted drafts), one forward per committed run of accepted drafts plus its
bonus token, the prefill's included.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from omegaconf import OmegaConf
from tqdm.auto import tqdm

from drafters.config.errors import UserError
from drafters.storage import artifact
from drafters.storage.engines import check_vllm_vocabulary, convert_to_gguf, llama_server, vllm_python
from drafters.target.model import resolve_path

LOG_PREFIX = re.compile(r"^\(\w+ pid=\d+\) [A-Z]+ \S+ \S+ \[[^]]*\] ")  # vLLM's: (Worker pid=1) ERROR 12-07 16:24:13 [x.py:1]
EXCEPTION = re.compile(r"^[\w.]*(Error|Exception): ")


@dataclass
class Reply:
    tokens: list[int]
    seconds: float  # wall time of the request, prefill included
    drafted: int = 0  # draft tokens verified
    accepted: int = 0
    accepted_by_pos: list[int] = field(default_factory=list)  # empty where the engine counts no positions


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One engine process on 127.0.0.1: started, waited for until healthy, stopped with its children."""

    def __init__(self, name: str, argv: list[str], port: int, log: str, env: dict | None = None):
        self.name, self.argv, self.port, self.log, self.env = name, argv, port, log, env
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **(self.env or {})}, start_new_session=True)

    def wait_healthy(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise UserError(f"{self.name} exited while starting (code {self.process.returncode}): "
                                f"{self.last_log_line()} (log: {self.log})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise UserError(f"{self.name} did not answer within engine_startup_s={seconds:g} s (log: {self.log})")

    def last_log_line(self) -> str:
        """The log's first exception line (the root cause: what follows it is its consequences), else
        its last line that says error, else its last line."""
        with open(self.log, errors="replace") as handle:
            lines = [LOG_PREFIX.sub("", line).strip() for line in handle if line.strip()]
        raised = [line for line in lines if EXCEPTION.search(line)]
        errors = [line for line in lines if "error" in line.lower() and "http" not in line]  # not a docs link
        return raised[0] if raised else errors[-1] if errors else lines[-1] if lines else "no output"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def request(self, path: str, body: dict | None = None, timeout: float = 600) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        call = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                      headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(call, timeout=timeout) as answer:
                return answer.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as failure:
            raise UserError(f"{self.name} failed on {path} ({failure}): {self.last_log_line()} (log: {self.log})") from None


def plain_and_spec(name: str, plain: list[str], spec: list[str], work: str, env: dict | None = None):
    """The engine's two servers, each on a free port of 127.0.0.1, logging into `work`."""
    made = []
    for kind, argv in (("plain", plain), ("spec", spec)):
        port = free_port()
        made.append(Server(f"{name} ({kind})", [*argv, "--host", "127.0.0.1", "--port", str(port)], port,
                           os.path.join(work, f"{name.lower()}-{kind}.log"), env))
    return made[0], made[1]


def export_head(checkpoint: str, fmt: str, out: str, options: dict) -> None:
    """`python -m export.run` in a process of its own (serving never imports export); its error line is ours."""
    argv = [sys.executable, "-m", "export.run", f"checkpoint={checkpoint}", f"format={fmt}", f"out={out}",
            *(f"{key}={value}" for key, value in options.items())]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"exporting {checkpoint} as format={fmt} failed: {last.removeprefix('error: ')}")


# our drafter -> (export format, vLLM's method); its CPU build refuses dspark ("Model Runner V1 does not
# support"), which only its GPU runner serves
VLLM_METHODS = {"eagle3": ("speculators", "eagle3"), "eagle": ("vllm", "eagle"), "medusa": ("vllm", "medusa"),
                "dflash": ("speculators", "dflash")}


def check_head(engine: str, saved: artifact.SavedDrafter) -> None:
    """One line where `engine` cannot serve this head (before any benchmark work)."""
    served = {"llamacpp": ["eagle3"], "vllm": list(VLLM_METHODS)}[engine]
    if saved.drafter not in served:
        raise UserError(f"engine={engine}: serves {', '.join(served)} heads from this project, not {saved.drafter}")
    if engine == "vllm":
        check_vllm_vocabulary("engine=vllm", saved.drafter, saved.hparams["draft_vocab_size"],
                              saved.verifier["vocab_size"])


class LlamaCpp:
    """llama-server: the target as a GGUF (the file it came as, or converted), the head as format=gguf."""

    name = "llamacpp"

    def __init__(self, checkpoint: str, work: str, steps: int, float32: bool, head: str | None = None):
        binary = llama_server()
        saved = artifact.read(checkpoint)  # the head and engine_head were checked up front (check_engine)
        hf = os.path.join(work, "target-hf")
        export_head(checkpoint, "gguf", os.path.join(work, "head"),
                    {"verifier_out": hf, "gguf_type": "f32" if float32 else "q8_0"})
        model = self.target_gguf(saved.target, hf, work, float32)
        threads = os.environ.get("OMP_NUM_THREADS") or str(len(os.sched_getaffinity(0)))  # as torch's own
        context = str(min(4096, saved.spec.max_position_embeddings))
        # float32 as our loop computes it: its default KV cache is f16, and its flash attention rounds
        # through f16 (a random tiny target's near-ties then flip)
        cache = ["--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off"] if float32 else []
        self.plain = [binary, "-m", model, "-t", threads, "-c", context, "-np", "1", "--no-webui", *cache]
        head = head or os.path.join(work, "head", "head.gguf")
        self.spec = [*self.plain, "-md", head, "--spec-type", "draft-eagle3",
                     "--spec-draft-n-max", str(steps), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]

    @staticmethod
    def target_gguf(target: dict, hf: str, work: str, float32: bool) -> str:
        """The GGUF file the target was loaded from, else the HF dir converted (f32 or bf16, as served)."""
        if target.get("gguf_file") and not target.get("random_init"):
            return os.path.join(resolve_path(OmegaConf.create(target)), target["gguf_file"])
        converted = os.path.join(work, "target.gguf")
        convert_to_gguf(hf, converted, "f32" if float32 else "bf16")
        return converted

    def servers(self, work: str) -> tuple[Server, Server]:
        return plain_and_spec("llama-server", self.plain, self.spec, work)

    def complete(self, server: Server, ids: list[int], max_new_tokens: int) -> Reply:
        body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0, "top_k": 1, "seed": 0,
                "return_tokens": True, "cache_prompt": False}
        began = time.perf_counter()
        answer = json.loads(server.request("/completion", body))
        seconds = time.perf_counter() - began
        timings = answer.get("timings", {})
        return Reply(list(answer["tokens"]), seconds, timings.get("draft_n", 0), timings.get("draft_n_accepted", 0))


COUNTER = re.compile(r'^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)_total)'
                     r'(?:\{([^}]*)\})? ([0-9.eE+-]+)$', re.M)


class Vllm:
    """vLLM's OpenAI server from its own venv: the target as an HF dir, the head as format=speculators."""

    name = "vllm"

    def __init__(self, checkpoint: str, work: str, steps: int, float32: bool, head: str | None = None):
        self.python = vllm_python()
        saved = artifact.read(checkpoint)  # the head and engine_head were checked up front (check_engine)
        fmt, method = VLLM_METHODS[saved.drafter]
        hf, exported = os.path.join(work, "target-hf"), os.path.join(work, "head")
        export_head(checkpoint, fmt, exported, {"verifier_out": hf})
        head = os.path.abspath(head or exported)
        self.plain = ["-m", "vllm.entrypoints.openai.api_server", "--model", hf, "--served-model-name", "target",
                      "--dtype", "float32" if float32 else "bfloat16", "--enforce-eager",
                      "--max-model-len", str(min(4096, saved.spec.max_position_embeddings)),
                      "--max-num-seqs", "1", "--seed", "0"]
        config = {"model": head, "num_speculative_tokens": steps, "method": method}
        self.spec = [*self.plain, "--speculative-config", json.dumps(config)]
        venv = os.path.dirname(os.path.dirname(self.python))
        self.env = {"LD_PRELOAD": os.path.join(venv, "lib", "libiomp5.so"), "VLLM_CPU_KVCACHE_SPACE": "2"}
        if os.environ.get("OMP_NUM_THREADS"):  # a thread count set for this process: vLLM keeps to it
            self.env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"

    def servers(self, work: str) -> tuple[Server, Server]:
        return plain_and_spec("vLLM", [self.python, *self.plain], [self.python, *self.spec], work, self.env)

    @staticmethod
    def counters(server: Server) -> dict:
        found = {"draft_tokens": 0.0, "accepted_tokens": 0.0, "by_pos": {}}
        for name, labels, value in COUNTER.findall(server.request("/metrics").decode()):
            kind = name.removeprefix("vllm:spec_decode_num_").removesuffix("_total")
            if kind == "accepted_tokens_per_pos":
                position = int(re.search(r'position="(\d+)"', labels).group(1))
                found["by_pos"][position] = found["by_pos"].get(position, 0.0) + float(value)
            elif kind in found:
                found[kind] += float(value)
        return found

    def complete(self, server: Server, ids: list[int], max_new_tokens: int) -> Reply:
        before = self.counters(server)
        body = {"model": "target", "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0, "seed": 0,
                "return_token_ids": True}
        began = time.perf_counter()
        answer = json.loads(server.request("/v1/completions", body))
        seconds = time.perf_counter() - began
        after = self.counters(server)
        by_pos = [round(after["by_pos"].get(k, 0) - before["by_pos"].get(k, 0)) for k in sorted(after["by_pos"])]
        return Reply(list(answer["choices"][0]["token_ids"]), seconds,
                     round(after["draft_tokens"] - before["draft_tokens"]),
                     round(after["accepted_tokens"] - before["accepted_tokens"]), by_pos)


def tokens_per_forward(new_tokens: int, accepted: int) -> float:
    return new_tokens / max(new_tokens - accepted, 1)


def summary(plain: list[Reply], spec: list[Reply], ours_plain: list[list[int]]) -> dict:
    """An engine's figures over one prompt set."""
    new = sum(len(reply.tokens) for reply in spec)
    accepted = sum(reply.accepted for reply in spec)
    counted = [reply for reply in spec if reply.accepted_by_pos]  # by position: each step drafts them all
    by_pos = [sum(column) for column in zip(*(reply.accepted_by_pos for reply in counted))]
    steps = sum(reply.drafted for reply in counted) / len(by_pos) if by_pos else 0
    same = [reply.tokens == ours for reply, ours in zip(plain, ours_plain)]
    plain_rate = sum(len(reply.tokens) for reply in plain) / sum(reply.seconds for reply in plain)
    spec_rate = new / sum(reply.seconds for reply in spec)
    return {
        "accept_len": tokens_per_forward(new, accepted),
        "accept_rate_by_pos": [count / steps for count in by_pos] if by_pos and steps else None,
        "drafted": sum(reply.drafted for reply in spec),
        "accepted": accepted,
        "accepted_per_prompt": [reply.accepted for reply in spec],
        "tokens_per_s_spec": spec_rate,
        "tokens_per_s_plain": plain_rate,
        "speedup": spec_rate / plain_rate,
        # greedy: speculation is lossless where the speculative output is the engine's plain one
        "identical": sum(p.tokens == s.tokens for p, s in zip(plain, spec)) / len(spec),
        # and the engine's plain decoding against ours (kernels and precisions round apart near ties)
        "plain_matches_ours": sum(same) / len(plain),
        "plain_is_ours": same,
    }


def measure(engine, sets: dict[str, list[list[int]]], max_new_tokens: int, startup_s: float, work: str,
            ours_plain: dict[str, list[list[int]]]) -> dict[str, dict]:
    """Both servers up at once, each prompt sent to both, the order alternating; then both stopped."""
    plain_server, spec_server = engine.servers(work)
    print(f"{engine.name}: starting a plain and a speculative server (logs: {plain_server.log}, {spec_server.log})",
          file=sys.stderr, flush=True)
    try:
        for server in (plain_server, spec_server):
            server.start()
        for server in (plain_server, spec_server):
            server.wait_healthy(startup_s)
        figures = {}
        for name, prompts in sets.items():
            replies = {"plain": [], "spec": []}
            for index, ids in enumerate(tqdm(prompts, desc=f"{engine.name}: {name}", leave=False)):
                order = ("plain", "spec") if index % 2 == 0 else ("spec", "plain")
                for kind in order:
                    server = plain_server if kind == "plain" else spec_server
                    replies[kind].append(engine.complete(server, ids, max_new_tokens))
            figures[name] = summary(replies["plain"], replies["spec"], ours_plain[name])
        return figures
    finally:
        for server in (plain_server, spec_server):
            server.stop()


def engine_figures(name: str, checkpoint: str, out: str, sets: dict[str, list[list[int]]], steps: int,
                   max_new_tokens: int, float32: bool, startup_s: float,
                   ours_plain: dict[str, list[list[int]]], head: str | None = None) -> dict[str, dict]:
    """Export for engine `name` (`head`: serve that export of the head instead), serve, measure, clean
    up (the logs stay beside `out` if it fails)."""
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-{name}-", dir=os.path.dirname(os.path.abspath(out)))
    engine_class = LlamaCpp if name == "llamacpp" else Vllm
    try:
        engine = engine_class(checkpoint, work, steps, float32, head and os.path.abspath(head))
        figures = measure(engine, sets, max_new_tokens, startup_s, work, ours_plain)
    except BaseException:
        for entry in os.listdir(work):  # the exports go; the servers' logs stay for the error line
            if not entry.endswith(".log"):
                path = os.path.join(work, entry)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        if not os.listdir(work):
            os.rmdir(work)
        raise
    shutil.rmtree(work)
    return figures

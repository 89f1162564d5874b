"""The 1.5B shape end to end: `python tools/bench.py shape` (or `python tools/bench_shape.py`).
The built-in r1-shape (R1-Distill-Qwen-1.5B's shape, 2 layers) on CPU through the project's own
commands (torchrun train.py, a resume, export, loads by transformers and vLLM, eval_aime.py), each
rank's peak memory beside memory.py's estimate, and the update's FLOP/s against this CPU's matmul
peak (matmul_peak, which tools/bench.py's SmolLM2 rows use too).

What it does not do: time a step beside TRL (tools/bench.py), or check anything.
"""

import json
import multiprocessing as mp
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]  # the repository: train.py, eval_aime.py
sys.path.insert(0, str(ROOT))  # run as a script: the core is one folder up

import checkpoint
import data
import memory
import model
import rollout
from checks import check, one_line_errors, writable
from demo import bases
from tools.bench import (
    PHASES,
    at_least,
    cli_flags,
    cpu_description,
    group_size,
    proc_field,
)

# torchrun starts this (python -c RANK_PEAK PREFIX COMMAND...) as each rank: it runs the rank's
# command as its only child, passes torchrun's signals on, makes the child die with it
# (PR_SET_PDEATHSIG), and writes the child's peak resident set (RUSAGE_CHILDREN, KiB) to
# PREFIX<RANK>. A few MiB of Python per rank, not the 0.5 GiB of importing tools/bench.py.
RANK_PEAK = """
import ctypes, os, resource, signal, subprocess, sys
die_with_parent = lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
child = subprocess.Popen(sys.argv[2:], preexec_fn=die_with_parent)
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda n, f: child.send_signal(n))
rc = child.wait()
with open(sys.argv[1] + os.environ.get("RANK", "0"), "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(rc if rc >= 0 else 128 - rc)
"""


@dataclass
class ShapeConfig:
    """`python tools/bench.py shape`: the 1.5B shape (built-in r1-shape) end to end on CPU through
    train.py, a resume, export and eval_aime.py. The defaults are an 8K-token run on 2 ranks, with
    prompts of 7K tokens and responses of 1K; for development, use much shorter ones, such as 256
    prompt tokens and 16 response tokens."""

    # each prompt's length: a generated problem padded with random letters (1 token each)
    prompt_tokens: int = 7168
    response_tokens: int = 1024  # every response is exactly this long (EOS masked until then)
    nproc: int = 2  # ranks (torchrun --nproc_per_node), each with its own engine
    steps: int = 1  # GRPO steps of the first run, which ends with a checkpoint
    # GRPO steps of the second run: the same command, resumed from that checkpoint
    resume_steps: int = 1
    prompts_per_step: int = 2  # over all ranks
    group_size: int = 2  # samples per prompt
    # train.py's rollout engine (eval_aime.py always runs vLLM)
    engine: Literal["vllm", "hf"] = "vllm"
    # train.py's compute and engine dtype, and the matmul peak's
    dtype: Literal["float32", "bfloat16"] = "float32"
    threads: int = 1  # torch threads per rank
    eval_problems: int = 2  # eval_aime.py on this many of the problems
    eval_k: int = 2  # eval_aime.py's samples per problem, each --response-tokens long
    layers: int = 2  # r1-shape's 2; another value builds the same shape with that many layers
    # r1-shape's; a smaller one fits a development run on 2 ranks in a few GiB
    vocab_size: int = bases.R1_VOCAB
    # table.md, results.json, each command's log; the training run in <out>/run
    out: str = "runs/bench-shape"
    # internal: load a model in this process as transformers ("hf:PATH") or vLLM ("vllm:PATH") do,
    # and write what it generated to --result (the export's checks, each in a fresh process)
    check: str = ""
    result: str = ""  # internal: where --check writes


def shape_main(cfg: ShapeConfig) -> None:
    """Build the model, write the problems, measure the matmul peak, run the commands one after the
    other (up to the first that fails); the table in <out>/table.md, the figures in results.json."""
    if cfg.check:
        return check_load(cfg)
    validate_shape(cfg)
    out = Path(cfg.out).absolute()
    # a fresh run: never resumed from an earlier bench's checkpoint
    shutil.rmtree(out / "run", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    t0, layers, vocab = time.time(), cfg.layers, cfg.vocab_size
    builtin = (layers, vocab) == (2, bases.R1_VOCAB)  # then train.py gets its name, as a user would
    path = (
        bases.ensure(bases.R1_SHAPE)  # and finds it in the cache's models/
        if builtin
        else bases.ensure_r1_shape_base(model.DEFAULT_CACHE, layers=layers, vocab_size=vocab)
    )
    res = {"config": asdict(cfg), "model": path, "cpu": cpu_description()}
    res["build_s"] = time.time() - t0
    # the tokenizer is not kept: memory
    res["prompt_lens"] = write_problems(model.load_tokenizer(path), out, cfg)
    prompt = statistics.mean(res["prompt_lens"])
    print(
        f"bench shape: {path}, prompts of {prompt:.0f} tokens; measuring the matmul peak ...",
        flush=True,
    )
    res["load_average"] = os.getloadavg()[0]  # others' work on the machine slows every figure below
    seq_mean = prompt + cfg.response_tokens
    res["peak"] = matmul_peak(path, cfg, seq_mean)
    res["estimate"] = memory_estimate(path, cfg)
    need = cfg.nproc * res["estimate"]["process peak (trainer + engine + libraries)"]
    have = available_gib()
    if have is not None and need > have:  # said, not refused: the estimate is what is checked here
        print(
            f"bench shape: memory.py estimates {need:.1f} GiB for {cfg.nproc} rank(s), {have:.1f} "
            "GiB are available: the run may be killed for memory (try --nproc 1, or shorter "
            "sequences)",
            flush=True,
        )

    run, export = out / "run", out / "export"
    py, seq, resp = sys.executable, cfg.prompt_tokens + cfg.response_tokens, cfg.response_tokens
    kw = dict(model=bases.R1_SHAPE if builtin else path, task="math", data=out / "problems.jsonl")
    kw |= dict(engine=cfg.engine, dtype=cfg.dtype, prompts_per_step=cfg.prompts_per_step)
    kw |= dict(group_size=cfg.group_size, max_new_tokens=resp, min_new_tokens=resp)
    kw |= dict(max_seq_len=seq, micro_batch_tokens=seq, activation_checkpointing=True)
    # a random model's rewards are all 0: every sample is measured as if it trained
    kw |= dict(skip_zero_advantage=False, eval_every=0, threads=cfg.threads)
    kw |= dict(checkpoint_every=cfg.steps, save_final=False, plot=False, quiet=True, out_dir=run)
    train_cmd = [py, "train.py", *cli_flags(**kw)]
    load = lambda how, to: [py, "tools/bench.py", "shape", *cli_flags(check=how, result=to)]  # noqa: E731
    hf_json, vllm_json = out / "load-hf.json", out / "load-vllm.json"
    kw = dict(model=export, data=out / "eval_problems.jsonl", k=cfg.eval_k, max_tokens=resp)
    eval_cmd = [py, "eval_aime.py", *cli_flags(**kw, out=out / "eval_samples.jsonl")]
    last = lambda: str(checkpoint.saved(run / "checkpoints")[-1])  # noqa: E731
    # (name, ranks, the command (a function: known once the one before has run), what it writes)
    commands = [
        ("train", cfg.nproc, train_cmd + ["--steps", str(cfg.steps)], None),
        ("resume", cfg.nproc, train_cmd + ["--steps", str(cfg.steps + cfg.resume_steps)], None),
        ("export", 1, lambda: [py, "train.py", "export", last(), str(export)], None),
        ("load: transformers", 1, load(f"hf:{export}", hf_json), hf_json),
        ("load: vLLM", 1, load(f"vllm:{export}", vllm_json), vllm_json),
        ("eval_aime", cfg.nproc, eval_cmd, out / "eval_samples.summary.json"),
    ]
    res["commands"] = []
    for name, nproc, cmd, result in commands:
        print(f"bench shape: {name} ...", flush=True, end=" ")
        r = launch(name, cmd() if callable(cmd) else cmd, nproc, out, cfg.threads)
        failed = "" if r["rc"] == 0 else f", failed (exit {r['rc']}): see {r['log']}"
        print(f"{r['wall_s']:.0f}s{failed}", flush=True)
        if name in ("train", "resume"):
            after = 0 if name == "train" else cfg.steps
            r.update(train_figures(run, Path(r["log"]), after_step=after))
        if result is not None and r["rc"] == 0:
            r["result"] = json.loads(result.read_text())
        res["commands"].append(r)
        if r["rc"] != 0:
            break
    print("bench shape: the matmul peak once more ...", flush=True)
    # a busy moment lowers one measurement
    res["peak"] = matmul_peak(path, cfg, seq_mean, earlier=res["peak"])
    res["steps"] = read_metrics(run / "metrics.jsonl")
    text = shape_table(res, cfg)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(res, indent=1))
    print(text)


def validate_shape(cfg: ShapeConfig) -> None:
    n, p, steps = cfg.nproc, cfg.prompts_per_step, cfg.steps >= 1 and cfg.resume_steps >= 1
    scaffold = f"--prompt-tokens {cfg.prompt_tokens}: at least 128 (the prompt's scaffold)"
    multiple = f"--prompts-per-step {p}: must be a positive multiple of --nproc {n}"
    evals = "--eval-problems and --eval-k: each at least 1"
    check(
        [(cfg.prompt_tokens >= 128, scaffold)]
        + at_least(cfg, response_tokens=1, nproc=1)
        + [(p >= n and p % n == 0, multiple)]
        + group_size(cfg)
        + [(steps, "--steps and --resume-steps: each at least 1")]
        + [(cfg.eval_problems >= 1 and cfg.eval_k >= 1, evals)]
        + at_least(cfg, threads=1, layers=1, vocab_size=1024)
        + [(writable(Path(cfg.out)), f"--out {cfg.out}: cannot be written")]
    )


def write_problems(tok, out: Path, cfg: ShapeConfig) -> list[int]:
    """<out>/problems.jsonl (every step's prompts) and eval_problems.jsonl (the first
    --eval-problems): "What is a + b?" padded with random letters to --prompt-tokens in
    data.math_prompt (exact with r1_tokenizer, one token a character; else cut until it fits).
    Returns the token lengths."""
    rng, rows, lens = random.Random(0), [], []
    length = lambda problem: len(data.math_prompt(tok, problem))  # noqa: E731
    for _ in range(max(cfg.prompts_per_step * (cfg.steps + cfg.resume_steps), cfg.eval_problems)):
        a, b = rng.randrange(1000), rng.randrange(1000)
        head = f"What is {a} + {b}? Random letters follow, to make the prompt long:"
        pad = cfg.prompt_tokens - length(head + " ")
        letters = (rng.choice("abcdefghijklmnopqrstuvwxyz   ") for _ in range(max(pad, 0)))
        problem = head + " " + "".join(letters)
        while length(problem) > cfg.prompt_tokens and len(problem) > len(head):
            problem = problem[: len(problem) - max(1, length(problem) - cfg.prompt_tokens)]
        rows.append({"problem": problem, "answer": str(a + b)})
        lens.append(length(problem))
    scaffold = f"--prompt-tokens {cfg.prompt_tokens}: below the {max(lens)} tokens of the prompt's"
    check([(max(lens) <= cfg.prompt_tokens, scaffold + " scaffold")])
    (out / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = rows[: cfg.eval_problems]
    (out / "eval_problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    return lens


def available_gib() -> float | None:
    """MemAvailable from /proc/meminfo (Linux), or None."""
    kib = proc_field("/proc/meminfo", "MemAvailable:")
    return None if kib is None else int(kib.split()[0]) / 2**20


def launch(name: str, cmd: list[str], nproc: int, out: Path, threads: int) -> dict:
    """Run one command (under torchrun when nproc > 1), output to <out>/<name>.log: its seconds,
    exit status, each rank's peak resident memory (RANK_PEAK), whether it logged a traceback."""
    slug = name.replace(": ", "-").replace(" ", "-")
    log, prefix = out / f"{slug}.log", out / f".peak-{slug}-rank"
    for old in out.glob(f".peak-{slug}-rank*"):
        old.unlink()
    wrapped = [sys.executable, "-c", RANK_PEAK, str(prefix), *cmd]
    if nproc > 1:
        with socket.socket() as s:  # a free port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        wrapped = torchrun + ["--master_port", str(port), "--no-python", *wrapped]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(wrapped, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    files = [Path(f"{prefix}{r}") for r in range(nproc)]
    peaks = [int(p.read_text()) / 2**20 if p.exists() else None for p in files]
    traceback = "Traceback (most recent call last)" in log.read_text(errors="replace")
    res = dict(name=name, nproc=nproc, cmd=cmd, rc=rc.returncode, wall_s=wall, peak_gib=peaks)
    return res | {"log": str(log), "traceback": traceback}


def read_metrics(path: Path) -> list[dict]:
    """The step rows of a run's metrics.jsonl (the step-0 row has no times)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "time_step" in r]


def train_figures(run: Path, log: Path, after_step: int) -> dict:
    """A train.py run's figures from its files: its steps after `after_step` (a resumed run keeps
    the rows before), its last checkpoint's seconds (from metrics.jsonl's last row, written just
    before it, to its meta.json, written last), and whether it resumed."""
    steps = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] > after_step]
    ckpts = checkpoint.saved(run / "checkpoints")
    ckpt_s = None
    if ckpts and (ckpts[-1] / "meta.json").exists() and (run / "metrics.jsonl").exists():
        ckpt_s = (ckpts[-1] / "meta.json").stat().st_mtime - (run / "metrics.jsonl").stat().st_mtime
    lines = log.read_text(errors="replace").splitlines()
    return {
        "last_step": steps[-1]["step"] if steps else None,
        "checkpoint_s": ckpt_s,
        "checkpoint": str(ckpts[-1]) if ckpts else None,
        "resumed": next((ln for ln in lines if ln.startswith("resumed from")), ""),
        "steps_s": sum(r["time_step"] for r in steps),
    }


def check_load(cfg: ShapeConfig) -> None:
    """--check hf:PATH / vllm:PATH: load the model as transformers or vLLM (the project's engine)
    does, sample 8 tokens after a short prompt, and write what was loaded and generated."""
    kind, path = cfg.check.split(":", 1)
    tok = AutoTokenizer.from_pretrained(path)
    ids = data.math_prompt(tok, "What is 1 + 1?")
    if kind == "hf":
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=True)
            gen = m.generate(torch.tensor([ids]), **kw, pad_token_id=tok.pad_token_id)
        new = gen[0, len(ids) :].tolist()
        loaded = f"{type(m).__name__}, {m.num_parameters() / 1e6:.0f}M parameters"
    else:
        engine = rollout.VLLMEngine(path, max_model_len=len(ids) + 8, seed=0)
        new = engine.generate([ids], n=1, max_tokens=8, min_tokens=8, seed=0)[0].token_ids
        loaded = "vLLM engine"
    tokenizer = f"{type(tok).__name__}, {len(tok)} tokens"
    res = dict(loaded=loaded, tokenizer=tokenizer, tokens=new, text=tok.decode(new))
    Path(cfg.result).write_text(json.dumps(res))


def memory_estimate(path: str, cfg: ShapeConfig) -> dict:
    """memory.py's CPU estimate of one rank for this shape, world size and batch (one sequence a
    micro-batch): rows and totals; "process peak" is what a rank's peak resident set measures (its
    engine rows are vLLM's, also under --engine hf)."""
    seqs = cfg.prompts_per_step * cfg.group_size // cfg.nproc
    shape, seq = memory.Shape.from_config(path), cfg.prompt_tokens + cfg.response_tokens
    rows = memory.estimate(
        shape, seq, ranks=cfg.nproc, seqs_per_rank=seqs, micro_batches=seqs, device="cpu"
    )
    return {"rows": rows, **memory.totals(rows)}


def shape_table(res: dict, cfg: ShapeConfig) -> str:
    c = AutoConfig.from_pretrained(res["model"])
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    prompt = statistics.mean(res["prompt_lens"])
    seq = prompt + cfg.response_tokens
    lines = [
        f"tools/bench.py shape: {Path(res['model']).name} (hidden {c.hidden_size}, MLP "
        f"{c.intermediate_size}, {c.num_attention_heads}/{c.num_key_value_heads} heads, "
        f"vocabulary {c.vocab_size}, {c.num_hidden_layers} layers), {cfg.nproc} ranks x "
        f"{cfg.threads} thread, {cfg.engine} engine, {cfg.dtype}; {cfg.prompts_per_step} prompts "
        f"x {cfg.group_size} samples per step, prompts of {prompt:.0f} tokens + responses of "
        f"{cfg.response_tokens} = {seq:.0f}; activation checkpointing. CPU: {res['cpu']}, "
        f"1-minute load average {res['load_average']:.1f} at the start. Model built in "
        f"{res['build_s']:.0f}s (0 when cached).",
        "",
        "| command | seconds | peak RSS per rank (GiB) | memory.py: process peak (training peak) "
        "GiB | measured / estimated process peak | exit | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    est = res["estimate"]["process peak (trainer + engine + libraries)"]
    est_train = res["estimate"]["training peak"]
    for r in res["commands"]:
        peaks = [p for p in r["peak_gib"] if p is not None]
        training, result, notes = r["name"] in ("train", "resume"), r.get("result", {}), []
        ratio = " / ".join(f"{p / est:.2f}" for p in peaks) if training and peaks else "-"
        if training:
            rest = r["wall_s"] - r["steps_s"] - (r["checkpoint_s"] or 0.0)
            notes.append(
                f"to step {r['last_step']}: steps {f(r['steps_s'])}s, checkpoint "
                f"{f(r['checkpoint_s'])}s, start-up and exit {f(rest)}s"
                + (f"; {r['resumed']}" if r["resumed"] else "")
            )
        if "loaded" in result:
            load = f"{result['loaded']}; {result['tokenizer']}; sampled {result['text']!r}"
            notes.append(load.replace("|", "\\|"))
        if "pass@1" in result:
            notes.append(
                f"pass@1 {result['pass@1']:.3f} over {result['problems']} x {result['k']}, mean "
                f"response {result['mean_response_tokens']:.0f} tokens"
            )
        if r["traceback"]:
            notes.append(f"a Python traceback in {Path(r['log']).name}")
        lines.append(
            f"| {r['name']} | {f(r['wall_s'], 0)} | {' / '.join(f(p, 2) for p in r['peak_gib'])} | "
            f"{f'{est:.2f} ({est_train:.2f})' if training else '-'} | {ratio} | {r['rc']} | "
            f"{'; '.join(notes)} |"
        )
    peak = res["peak"]
    lines += [
        "",
        "| step | generate s | logprobs s | update s | refit s | other s | step s | peak GiB, "
        "largest rank (metrics) | tokens trained | update TFLOP, 6x / 8x | achieved GFLOP/s, 6x / "
        "8x | 8x / matmul peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["steps"]:
        seqs, resp = r["seqs"], r["response_len_mean"]
        fwd = seqs * forward_flops(c, prompt + resp, resp)
        upd = r.get("time_update", 0.0)
        other = r["time_step"] - sum(r.get(f"time_{k}", 0.0) for k in PHASES)
        lines.append(
            f"| {r['step']} | {f(r.get('time_generate'))} | {f(r.get('time_logprobs'), 2)} | "
            f"{f(upd)} | {f(r.get('time_refit'))} | {f(other)} | {f(r['time_step'])} | "
            f"{f(r['peak_mem_gib'], 2)} | {seqs * (prompt + resp):.0f} | "
            f"{3 * fwd / 1e12:.2f} / {4 * fwd / 1e12:.2f} | "
            f"{3 * fwd / upd / 1e9:.1f} / {4 * fwd / upd / 1e9:.1f} | "
            f"{4 * fwd / upd / peak['mix']:.0%} |"
        )
    rates = ", ".join(
        f"{name} [{m}x{k}]x[{k}x{n}] {peak['rates'][name] / 1e9:.1f}"
        for name, m, k, n, _ in peak["shapes"]
    )
    lines += [
        "",
        f"Matmul peak, torch.matmul in {cfg.dtype} at {cfg.threads} thread(s) in each of "
        f"{cfg.nproc} processes at once, summed, the better of before and after the runs "
        f"(GFLOP/s): {rates}; the forward's mix {peak['mix'] / 1e9:.1f}.",
        "",
        "Update FLOPs: a forward pass is 2 x m x k x n for each matmul (the layers over every "
        "token, the LM head over the response positions) plus causal attention; 6x counts forward "
        "+ backward (3 passes, the model FLOPs); 8x adds the recompute of activation "
        "checkpointing (the layers, and the LM-head chunks, recomputed in backward: 4 passes), "
        "the work the CPU actually did. The update's seconds also hold FSDP's gathers and "
        "reductions, the clip and AdamW. Peak RSS per rank: each rank process's peak resident set "
        "over its whole life (start-up, engine, steps, checkpoint), from the kernel; the metrics' "
        "figure is the largest rank's so far, at the end of the step's update. memory.py's "
        "estimate: `python memory.py --device cpu` for this shape, world size and batch "
        "(memory_estimate), whose process peak counts the trainer, the engine (float32 weights, "
        "KV cache) and the libraries. A random model's reward is 0: every advantage is 0, and the "
        "update does all its work all the same (--no-skip-zero-advantage).",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# FLOPs and this CPU's matmul peak (tools/bench.py's SmolLM2 rows use them too)


def layer_matmuls(
    c, seq: float, resp: float, chunk: int = 1024
) -> list[tuple[str, int, int, int, float]]:
    """One sequence's forward matmuls as (name, m, k, n, how many): the layers' over its `seq`
    tokens, the LM head's over its `resp` response tokens in chunks (fastpaths.head_logprobs)."""
    H, I, V, layers = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (H // c.num_attention_heads)
    T, R = int(seq), int(min(resp, chunk))
    return [
        ("q_proj, o_proj", T, H, H, 2 * layers),
        ("k_proj, v_proj", T, H, kv, 2 * layers),
        ("gate_proj, up_proj", T, H, I, 2 * layers),
        ("down_proj", T, I, H, layers),
        ("lm_head (a chunk)", R, H, V, resp / R),
    ]


def attention_flops(c, seq: float) -> float:
    """Causal attention's forward: 2 x 2 x H x seq^2 / 2 per layer (QK^T, AV; lower triangle)."""
    return 2 * c.hidden_size * seq**2 * c.num_hidden_layers


def forward_flops(c, seq: float, resp: float) -> float:
    """One sequence's forward: 2 m k n per matmul, plus attention (norms etc.: a few percent)."""
    mm = sum(2 * m * k * n * count for _, m, k, n, count in layer_matmuls(c, seq, resp))
    return mm + attention_flops(c, seq)


def _time_matmuls(shapes, dtype: str, threads: int, seconds: float, barrier, queue) -> None:
    """In a process of its own: torch.matmul's best FLOP/s at each shape, all processes at once."""
    torch.set_num_threads(threads)
    dt, rates = getattr(torch, dtype), {}
    for name, m, k, n, _ in shapes:
        a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
        torch.matmul(a, b)  # warm-up: oneDNN picks and packs its kernel on the first call
        barrier.wait()
        best, reps, t_end = float("inf"), 0, time.time() + seconds
        while reps < 2 or time.time() < t_end:
            t = time.perf_counter()
            torch.matmul(a, b)
            best, reps = min(best, time.perf_counter() - t), reps + 1
        rates[name] = 2 * m * k * n / best
    queue.put(rates)


def matmul_peak(
    path: str, cfg: ShapeConfig, seq: float, seconds: float = 2.0, earlier: dict | None = None
) -> dict:
    """This CPU's matmul FLOP/s at layer_matmuls' shapes, in --dtype at --threads threads in
    --nproc processes at once (the limit the ranks share). Per shape: the sum over processes, or
    `earlier`'s where faster; "mix": the FLOP-weighted harmonic mean, a forward pass's rate."""
    shapes = layer_matmuls(AutoConfig.from_pretrained(path), seq, cfg.response_tokens)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(cfg.nproc), ctx.Queue()
    args = (shapes, cfg.dtype, cfg.threads, seconds, barrier, queue)
    procs = [ctx.Process(target=_time_matmuls, args=args) for _ in range(cfg.nproc)]
    for p in procs:
        p.start()
    per_proc = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    rates = {name: sum(r[name] for r in per_proc) for name, *_ in shapes}
    if earlier is not None:
        rates = {name: max(rate, earlier["rates"][name]) for name, rate in rates.items()}
    flops = {name: 2 * m * k * n * count for name, m, k, n, count in shapes}
    mix = sum(flops.values()) / sum(flops[k] / rates[k] for k in flops)
    return {"rates": rates, "mix": mix, "shapes": [list(s) for s in shapes]}


if __name__ == "__main__":
    one_line_errors(lambda: shape_main(tyro.cli(ShapeConfig)))

"""Step-time benchmark: where a GRPO step's time goes, per engine and model size, beside TRL's GRPOTrainer.

`python bench.py` runs a few steps of one fixed workload through train.py's own loop (16 prompts x 8 samples x
128 new tokens, EOS masked so that every response is exactly 128 tokens long, one update per step, no evaluation
or checkpoints) for each engine (HF generate, vLLM; and HF in bf16) and each model (the demo's tiny base and a
~25M-parameter Qwen2 built locally from a config), then the same workload through TRL's GRPOTrainer (float32,
bf16, and as GRPOConfig comes), and prints one table:
seconds per step in generate / score / old logprobs / update / refit / everything else, tokens generated and
trained per second, peak memory. Each configuration runs in a subprocess of its own, so that each gets a fresh
engine and its own peak-memory reading; all of them run in this one invocation, on this machine, so the ratios
compare like with like. The machine's speed drifts by 10-20% within a minute, more than the differences measured,
so the configurations of one model run side by side and take turns step by step (Turns): at most one of them
computes at any moment, step k of each runs next to step k of the others, and each ratio to TRL is the median of
the per-step ratios. It also times each engine's own generate called directly on the same prompts, to show
what our wrapper (per-prompt seeds, logprobs, Sample objects) costs.

What it does not do: check anything (it reports numbers; the tests check behaviour), or run on several ranks.
TRL is optional: `pip install trl==1.16.0` (or `make bench`); without it the TRL row is skipped with a note.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

import data
import model as M
import runtime
import train

PHASES = ["generate", "score", "logprobs", "update", "refit"]


class Turns:
    """Step-by-step turn taking among benchmark processes that run side by side.

    The parent (main) hands the machine to one process at a time: it writes a byte to that process's GO pipe and
    waits for a byte back on its DONE pipe (or for the pipe to close: the process has finished). A process waits for
    its first turn before loading anything, and gives the machine back at the start of each step's generation;
    the seconds it then waits are recorded and taken out of that step's times, so a step's figures count only its
    own work, done alone on the machine.
    """

    def __init__(self, spec: str):
        go, done = (int(x) for x in spec.split(","))
        self.go, self.done = os.fdopen(go, "rb", buffering=0), os.fdopen(done, "wb", buffering=0)
        self.waits: list[float] = []
        self.go.read(1)

    def take(self) -> None:
        t0 = time.time()
        self.done.write(b"d")
        self.go.read(1)
        self.waits.append(time.time() - t0)


class TurnTakingEngine:
    """An engine whose generate first gives the machine back to the other benchmark processes (Turns)."""

    def __init__(self, engine, turns: Turns):
        self.engine, self.turns = engine, turns

    def generate(self, *args, **kwargs):
        self.turns.take()
        return self.engine.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@dataclass
class BenchConfig:
    prompts: int = 16  # prompts per step
    group_size: int = 8  # samples per prompt
    new_tokens: int = 128  # every response is exactly this long (EOS masked until then)
    steps: int = 16  # steps per run on the tiny model; the first is warm-up and left out of the medians
    large_steps: int = 4  # steps per run on the ~25M model (a step takes tens of seconds on 2 CPU cores)
    models: list[Literal["tiny", "25m"]] = field(default_factory=lambda: ["tiny", "25m"])
    # hf, vllm: train.py in float32 (its CPU default); hf-bf16: train.py with --dtype bfloat16 (bf16 engine weights,
    # bf16 autocast in training). trl: TRL's GRPOTrainer in float32 with gradient checkpointing off, like train.py
    # (the same compute: hf's match); trl-bf16: the same in bf16 mixed precision (hf-bf16's match); trl-defaults: as
    # GRPOConfig comes (bf16 mixed precision, gradient checkpointing on: a recompute of every layer in backward)
    engines: list[Literal["hf", "vllm", "hf-bf16", "trl", "trl-bf16", "trl-defaults"]] = field(
        default_factory=lambda: ["hf", "vllm", "hf-bf16", "trl", "trl-bf16", "trl-defaults"])
    out: str = "runs/bench"  # where results.json and table.md are written
    # internal: run one configuration in this process and write its JSON result here
    one: str = ""
    result: str = ""
    turns: str = ""  # "GO_FD,DONE_FD": pipes to the parent that hands out turns (see Turns)


def large_model() -> str:
    """A ~25M-parameter Qwen2 (hidden 512, 8 layers, 8 heads of dim 64), randomly initialized, with the tiny
    model's tokenizer; built once into the model cache (weights are random: timing does not depend on them)."""
    from transformers import Qwen2ForCausalLM

    out = M.DEFAULT_CACHE / "bench-25m-v1"
    if not (out / "config.json").exists():
        tok = M.tiny_tokenizer()
        torch.manual_seed(0)
        M.save_new(out, Qwen2ForCausalLM(M.tiny_config(len(tok), hidden=512, intermediate=1408, layers=8)), tok)
    return str(out)


def model_for(name: str) -> str:
    return M.resolve(M.TINY) if name == "tiny" else large_model()


def step_prompts(cfg: BenchConfig, steps: int) -> list[list[str]]:
    """The prompts train.py's loop draws at each step (same stream, same seed)."""
    train_set, _ = data.sum3_split()
    stream = data.PromptStream(len(train_set), seed=0)
    return [[train_set[i].prompt for i in stream.take(cfg.prompts)] for _ in range(steps)]


def run_ours(cfg: BenchConfig, engine_name: str, path: str, steps: int, turns: Turns) -> dict:
    """train.py's loop with the benchmark workload, then the engine's own generate on the same prompts."""
    import rollout

    torch.set_num_threads(os.cpu_count() or 1)
    max_len = 16 + cfg.new_tokens
    kind = engine_name.removesuffix("-bf16")
    dtype = "bfloat16" if engine_name.endswith("-bf16") else "float32"
    if kind == "vllm":
        engine = rollout.VLLMEngine(path, max_model_len=max_len, seed=0, dtype=dtype)
    else:
        engine = rollout.HFEngine(path, dtype=getattr(torch, dtype))
    with tempfile.TemporaryDirectory() as tmp:
        tcfg = train.Config(model=path, engine=kind, dtype=dtype, steps=steps, prompts_per_step=cfg.prompts,
                            group_size=cfg.group_size, max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens,
                            max_seq_len=max_len, eval_every=0, checkpoint_every=0, save_final=False, plot=False,
                            quiet=True, out_dir=tmp)
        rows = train.train(tcfg, engine=TurnTakingEngine(engine, turns))["history"][1:]  # [0]: the step-0 record
    for r, wait in zip(rows, turns.waits, strict=True):  # one generate call per step
        r["time_generate"] -= wait
        r["time_step"] -= wait
    rows = rows[1:]  # the first step warms up
    res = {k: statistics.median(r[f"time_{k}"] for r in rows) for k in PHASES + ["step"]}
    res["steps"] = [r["time_step"] for r in rows]
    res["generates"] = [r["time_generate"] for r in rows]
    res["other"] = statistics.median(r["time_step"] - sum(r[f"time_{k}"] for k in PHASES) for r in rows)
    n_seq = cfg.prompts * cfg.group_size
    res["gen_tokens_per_s"] = n_seq * cfg.new_tokens / res["generate"]
    res["response_len"] = statistics.mean(r["response_len_mean"] for r in rows)  # = new_tokens: the workload held
    tok = M.load_tokenizer(path)
    prompt_len = statistics.mean(len(tok(t)["input_ids"]) for texts in step_prompts(cfg, steps) for t in texts)
    res["train_tokens_per_s"] = n_seq * (prompt_len + cfg.new_tokens) / (res["logprobs"] + res["update"])
    res["peak_gib"] = runtime.peak_memory_gib(torch.device("cpu"))
    res["wrapped_generate"], res["direct_generate"] = wrapper_vs_direct(cfg, kind, engine, tok, steps - 1)
    return res


def wrapper_vs_direct(cfg: BenchConfig, engine_name: str, engine, tok, repeats: int) -> tuple[float, float]:
    """Median seconds of our engine's generate and of the engine's own generate, called alternately on the same
    prompts (the steps' prompts), in turn first and second (ABBA), so that drifts in machine speed and whatever
    the first call of a pair pays hit both alike. "Own generate" is the plainest call that yields the same samples
    with the same engine settings (vLLM: one SamplingParams with logprobs; HF: model.generate on the padded batch,
    with the static KV cache and the attention the HF engine uses on CPU)."""

    def ours(ids, k):
        engine.generate(ids, n=cfg.group_size, max_tokens=cfg.new_tokens, min_tokens=cfg.new_tokens, seed=k)

    def own(ids, texts):
        if engine_name == "vllm":
            from vllm import SamplingParams, TokensPrompt

            sp = SamplingParams(n=cfg.group_size, max_tokens=cfg.new_tokens, min_tokens=cfg.new_tokens,
                                temperature=1.0, logprobs=0)
            engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sp, use_tqdm=False)
        else:
            enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
            with torch.no_grad():
                engine.model.generate(**enc, max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens,
                                      do_sample=True, temperature=1.0, top_p=1.0, top_k=None,
                                      num_return_sequences=cfg.group_size, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id,
                                      cache_implementation="static" if engine.model.device.type == "cpu" else None)

    wrapped, direct = [], []
    for k, texts in enumerate(step_prompts(cfg, max(repeats, 4))):
        ids = [tok(t)["input_ids"] for t in texts]
        for which in ((0, 1) if k % 2 == 0 else (1, 0)):
            t0 = time.time()
            ours(ids, k) if which == 0 else own(ids, texts)
            (wrapped if which == 0 else direct).append(time.time() - t0)
    return statistics.median(wrapped), statistics.median(direct)


def run_trl(cfg: BenchConfig, path: str, steps: int, turns: Turns, **precision) -> dict:
    """The same workload through TRL's GRPOTrainer (HF generate, one update per generation batch, no KL).
    precision: bf16 and gradient_checkpointing for GRPOConfig; left out, GRPOConfig's defaults."""
    try:
        import datasets
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        return {"error": f"TRL not installed ({err}); pip install trl==1.16.0"}
    import reward

    torch.set_num_threads(os.cpu_count() or 1)
    train_set, _ = data.sum3_split()
    ds = datasets.Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in train_set])

    def exact(completions, answer, **_):
        return [reward.exact_reward(c, a) for c, a in zip(completions, answer)]

    times = {"step": [], "generate": [], "score": []}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.time()

        def on_step_end(self, *a, **k):
            times["step"].append(time.time() - self.t0)

    def timed(fn, key):
        def wrapper(*a, **k):
            t0 = time.time()
            out = fn(*a, **k)
            times[key].append(time.time() - t0)
            return out

        return wrapper

    def after_turn(fn):  # inside TRL's step: the wait is taken out of the step below
        def wrapper(*a, **k):
            turns.take()
            return fn(*a, **k)

        return wrapper

    n = cfg.prompts * cfg.group_size
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=n, gradient_accumulation_steps=1,
            num_generations=cfg.group_size, max_completion_length=cfg.new_tokens, temperature=1.0,
            generation_kwargs={"min_new_tokens": cfg.new_tokens}, learning_rate=2e-4, beta=0.0, num_iterations=1,
            use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
            dataloader_num_workers=0, **precision,
        )
        trainer = GRPOTrainer(model=path, reward_funcs=exact, args=args, train_dataset=ds,
                              processing_class=M.load_tokenizer(path), callbacks=[StepTimer()])
        trainer._generate = after_turn(timed(trainer._generate, "generate"))
        trainer._calculate_rewards = timed(trainer._calculate_rewards, "score")
        trainer.train()
        # what TRL ran with, as its accelerator and arguments say (trl-defaults leaves both to GRPOConfig)
        config = {"mixed_precision": str(trainer.accelerator.mixed_precision),
                  "gradient_checkpointing": args.gradient_checkpointing}
    times["step"] = [t - wait for t, wait in zip(times["step"], turns.waits, strict=True)]
    res = {k: statistics.median(v[1:]) for k, v in times.items()}
    res["steps"], res["generates"] = times["step"][1:], times["generate"][1:]
    res["gen_tokens_per_s"] = n * cfg.new_tokens / res["generate"]
    res["peak_gib"] = runtime.peak_memory_gib(torch.device("cpu"))
    return res | config


def run_one(cfg: BenchConfig) -> None:
    engine_name, model_name = cfg.one.split(":")
    path = model_for(model_name)  # built by main already: only a lookup
    steps = cfg.steps if model_name == "tiny" else cfg.large_steps
    turns = Turns(cfg.turns)
    if engine_name == "trl-defaults":
        res = run_trl(cfg, path, steps, turns)
    elif engine_name.startswith("trl"):
        res = run_trl(cfg, path, steps, turns, bf16=engine_name == "trl-bf16", gradient_checkpointing=False)
    else:
        res = run_ours(cfg, engine_name, path, steps, turns)
    Path(cfg.result).write_text(json.dumps(res))


def ratio(ours: dict, trl: dict) -> str:
    """The median over steps of our step k / TRL's step k (they ran next to each other), and its range."""
    if "steps" not in trl:
        return "-"
    per_step = [a / b for a, b in zip(ours["steps"], trl["steps"])]
    return f"{statistics.median(per_step):.2f}x ({min(per_step):.2f}-{max(per_step):.2f})"


def table(results: dict, cfg: BenchConfig) -> str:
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = [f"{cfg.prompts} prompts x {cfg.group_size} samples x {cfg.new_tokens} new tokens, one update per step; "
             f"median seconds per step (first step left out). CPU: {cpu_description()}", "",
             "| model | engine | step | generate | score | old logprobs | update | refit | everything else "
             "| gen tok/s | train tok/s | peak GiB | generate: ours / engine's own | step vs TRL (matched / defaults) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model_name, engine_name), r in results.items():
        if "error" in r:
            lines.append(f"| {model_name} | {engine_name} | {r['error']} |")
            continue
        vs = "-"
        if not engine_name.startswith("trl"):
            match = "trl-bf16" if engine_name.endswith("-bf16") else "trl"  # the same precision and compute
            vs = " / ".join(ratio(r, t) for t in (results.get((model_name, e), {}) for e in (match, "trl-defaults")))
        direct = r.get("direct_generate")
        direct_s = f"{f(r['wrapped_generate'])} / {f(direct)} ({r['wrapped_generate'] / direct - 1:+.0%})" if direct else "-"
        other = r.get("other")
        other_s = "-" if other is None else f"{other:.3f} ({other / r['step']:.0%})"
        lines.append(
            f"| {model_name} | {engine_name} | {f(r['step'])} | {f(r['generate'])} | {f(r.get('score'))} | "
            f"{f(r.get('logprobs'))} | {f(r.get('update'))} | {f(r.get('refit'))} | "
            f"{other_s} | {f(r['gen_tokens_per_s'], 0)} | "
            f"{f(r.get('train_tokens_per_s'), 0)} | {f(r['peak_gib'], 2)} | {direct_s} | {vs} |")
    lines.append("")
    lines.append("TRL's update column is its step minus generate and score (it has no refit: the same model "
                 "generates and trains). hf, vllm, trl: float32; hf-bf16, trl-bf16: bf16 compute over float32 "
                 "weights. trl, trl-bf16: gradient checkpointing off, as train.py by default (the same compute); "
                 "trl-defaults: GRPOConfig as it comes (bf16, gradient checkpointing on). Matched: hf and vllm vs "
                 "trl, hf-bf16 vs trl-bf16. 'generate: ours / engine's own': medians of the two called alternately "
                 "(ABBA) on the same prompts after the run. Step vs TRL: the median over steps of our step k / "
                 "TRL's step k, which ran next to each other, and its range.")
    return "\n".join(lines)


def run_ring(cfg: BenchConfig, model_name: str, engines: list[str], out: Path) -> dict:
    """Start one process per engine and hand out turns, one step at a time, until all have finished."""
    t0 = time.time()
    print(f"bench: {', '.join(engines)} on {model_name}, side by side ...", flush=True, end=" ")
    procs = []
    for engine_name in engines:
        go_r, go_w = os.pipe()
        done_r, done_w = os.pipe()
        res_file = out / f"{engine_name}-{model_name}.json"
        res_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--one", f"{engine_name}:{model_name}", "--result", str(res_file),
               "--turns", f"{go_r},{done_w}",
               *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in asdict(cfg).items()
                     if k in ("prompts", "group_size", "new_tokens", "steps", "large_steps")), [])]
        log = open(out / f"{engine_name}-{model_name}.log", "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, pass_fds=(go_r, done_w))
        os.close(go_r)
        os.close(done_w)
        procs.append((engine_name, p, go_w, done_r, res_file, log))
    alive = list(procs)
    while alive:
        for item in list(alive):
            _, p, go_w, done_r, _, _ = item
            try:
                os.write(go_w, b"g")
                finished = os.read(done_r, 1) == b""
            except BrokenPipeError:
                finished = True
            if finished:  # it has closed its pipes: done, or failed
                p.wait()
                alive.remove(item)
    results = {}
    for engine_name, p, go_w, done_r, res_file, log in procs:
        os.close(go_w)
        os.close(done_r)
        log.close()
        if p.returncode != 0 or not res_file.exists():
            tail = (Path(log.name).read_text().strip().splitlines() or ["?"])[-1][:200]
            res = {"error": f"failed: {tail} (see {log.name})"}
        else:
            res = json.loads(res_file.read_text())
            if engine_name.startswith("trl") and "error" not in res:  # TRL absent: its row says so
                res["update"] = res["step"] - res["generate"] - res["score"]
        results[(model_name, engine_name)] = res
    print(f"{time.time() - t0:.0f}s", flush=True)
    return results


def cpu_description() -> str:
    """This machine's CPU as the table names it: model, cores, and the vector extensions that decide speed here
    (bf16 compute is emulated, and slow, without avx512_bf16 or AMX)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown CPU")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    ext = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}, {os.cpu_count()} cores, {' '.join(ext) or 'no AVX2'}"


def validate(cfg: BenchConfig) -> None:
    runtime.check([
        (cfg.prompts >= 1, f"--prompts {cfg.prompts}: must be at least 1"),
        (cfg.group_size >= 2, f"--group-size {cfg.group_size}: GRPO needs at least 2 samples per prompt"),
        (cfg.new_tokens >= 1, f"--new-tokens {cfg.new_tokens}: must be at least 1"),
        (cfg.steps >= 2, f"--steps {cfg.steps}: must be at least 2 (the first is warm-up)"),
        (cfg.large_steps >= 2, f"--large-steps {cfg.large_steps}: must be at least 2 (the first is warm-up)"),
        (bool(cfg.models) and bool(cfg.engines), "--models and --engines: name at least one each"),
        (runtime.writable(Path(cfg.out)), f"--out {cfg.out}: cannot be written"),
    ])


def main(cfg: BenchConfig) -> None:
    if cfg.one:
        return run_one(cfg)
    validate(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in cfg.models:  # build models here, once, so no subprocess times a build
        model_for(name)
    results = {}
    for model_name in cfg.models:
        # the processes of one ring run side by side, taking turns. At 25M all of them would not fit in this
        # machine's 24 GiB at once: there the float32 ones and TRL's defaults form one ring, the bf16 pair
        # another, and vLLM (8 GiB of engine) runs on its own
        rings = [cfg.engines]
        if model_name == "25m":
            bf16 = ["hf-bf16", "trl-bf16"]
            rings = [[e for e in cfg.engines if e not in bf16 + ["vllm"]], [e for e in cfg.engines if e in bf16],
                     [e for e in cfg.engines if e == "vllm"]]
        for ring in filter(None, rings):
            results.update(run_ring(cfg, model_name, ring, out))
    text = table(results, cfg)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({f"{m}/{e}": r for (m, e), r in results.items()}, indent=1))
    print(text)


if __name__ == "__main__":
    import tyro

    runtime.one_line_errors(lambda: main(tyro.cli(BenchConfig)))

"""Step-time benchmark: where a GRPO step's time goes, per engine and model size, beside TRL's GRPOTrainer.

`python bench.py` runs a few steps of one fixed workload through train.py's own loop (16 prompts x 8 samples x
128 new tokens, EOS masked so that every response is exactly 128 tokens long, one update per step, no evaluation
or checkpoints) for each engine (HF generate, vLLM) and each model (the demo's tiny base and a ~25M-parameter
Qwen2 built locally from a config), then the same workload through TRL's GRPOTrainer, and prints one table:
seconds per step in generate / score / old logprobs / update / refit / everything else, tokens generated and
trained per second, peak memory. Each configuration runs in a subprocess of its own, so that each gets a fresh
engine and its own peak-memory reading; all of them run in this one invocation, on this machine, so the ratios
compare like with like. The machine's speed drifts by 10-20% over minutes, so the configurations run in rounds,
interleaved (five on the tiny model by default), and every figure is a median over rounds. It also times each engine's own generate called directly on the same prompts, to show
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
import train

PHASES = ["generate", "score", "logprobs", "update", "refit"]


@dataclass
class BenchConfig:
    prompts: int = 16  # prompts per step
    group_size: int = 8  # samples per prompt
    new_tokens: int = 128  # every response is exactly this long (EOS masked until then)
    steps: int = 10  # steps per run on the tiny model; the first is warm-up and left out of the medians
    large_steps: int = 3  # steps per run on the ~25M model (a step takes tens of seconds on 2 CPU cores)
    # every configuration runs this many times, interleaved (ours, TRL, ours, TRL, ...), and each figure is the
    # median over rounds: the machine's speed drifts by 10-20% over minutes, and one run each would put a drift
    # into the ratio
    rounds: int = 1
    tiny_rounds: int = 5  # rounds on the tiny model (~30 s a configuration)
    models: list[Literal["tiny", "25m"]] = field(default_factory=lambda: ["tiny", "25m"])
    # trl: TRL's GRPOTrainer with gradient checkpointing off, like train.py (the same compute: the fair match);
    # trl-defaults: as GRPOConfig comes, gradient checkpointing on (a recompute of every layer in backward)
    engines: list[Literal["hf", "vllm", "trl", "trl-defaults"]] = field(
        default_factory=lambda: ["hf", "vllm", "trl", "trl-defaults"])
    out: str = "runs/bench"  # where results.json and table.md are written
    # internal: run one configuration in this process and write its JSON result here
    one: str = ""
    result: str = ""


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
    return train.tiny_base() if name == "tiny" else large_model()


def step_prompts(cfg: BenchConfig, steps: int) -> list[list[str]]:
    """The prompts train.py's loop draws at each step (same stream, same seed)."""
    train_set, _ = data.sum3_split()
    stream = train.PromptStream(len(train_set), seed=0)
    return [[train_set[i].prompt for i in stream.take(cfg.prompts)] for _ in range(steps)]


def run_ours(cfg: BenchConfig, engine_name: str, path: str, steps: int) -> dict:
    """train.py's loop with the benchmark workload, then the engine's own generate on the same prompts."""
    import rollout

    torch.set_num_threads(os.cpu_count() or 1)
    max_len = 16 + cfg.new_tokens
    if engine_name == "vllm":
        engine = rollout.VLLMEngine(path, max_model_len=max_len, seed=0)
    else:
        engine = rollout.HFEngine(path)
    with tempfile.TemporaryDirectory() as tmp:
        tcfg = train.Config(model=path, engine=engine_name, steps=steps, prompts_per_step=cfg.prompts,
                            group_size=cfg.group_size, max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens,
                            max_seq_len=max_len, eval_every=0, checkpoint_every=0, save_final=False, plot=False,
                            quiet=True, out_dir=tmp)
        rows = train.train(tcfg, engine=engine)["history"][2:]  # [0] is the step-0 record, [1] the warm-up step
    res = {k: statistics.median(r[f"time_{k}"] for r in rows) for k in PHASES + ["step"]}
    res["other"] = statistics.median(r["time_step"] - sum(r[f"time_{k}"] for k in PHASES) for r in rows)
    n_seq = cfg.prompts * cfg.group_size
    res["gen_tokens_per_s"] = n_seq * cfg.new_tokens / res["generate"]
    res["response_len"] = statistics.mean(r["response_len_mean"] for r in rows)  # = new_tokens: the workload held
    tok = M.load_tokenizer(path)
    prompt_len = statistics.mean(len(tok(t)["input_ids"]) for texts in step_prompts(cfg, steps) for t in texts)
    res["train_tokens_per_s"] = n_seq * (prompt_len + cfg.new_tokens) / (res["logprobs"] + res["update"])
    res["peak_gib"] = train.peak_memory_gib(torch.device("cpu"))
    res["wrapped_generate"], res["direct_generate"] = wrapper_vs_direct(cfg, engine_name, engine, tok, steps - 1)
    return res


def wrapper_vs_direct(cfg: BenchConfig, engine_name: str, engine, tok, repeats: int) -> tuple[float, float]:
    """Median seconds of our engine's generate and of the engine's own generate, called alternately on the same
    prompts (the steps' prompts), so that drifts in machine speed hit both alike. "Own generate" is the plainest
    call that yields the same samples with the same engine settings (vLLM: one SamplingParams with logprobs; HF:
    model.generate on the padded batch, with the static KV cache and the attention the HF engine uses on CPU)."""
    wrapped, direct = [], []
    for k, texts in enumerate(step_prompts(cfg, repeats)):
        ids = [tok(t)["input_ids"] for t in texts]
        t0 = time.time()
        engine.generate(ids, n=cfg.group_size, max_tokens=cfg.new_tokens, min_tokens=cfg.new_tokens, seed=k)
        wrapped.append(time.time() - t0)
        t0 = time.time()
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
        direct.append(time.time() - t0)
    return statistics.median(wrapped), statistics.median(direct)


def run_trl(cfg: BenchConfig, path: str, steps: int, gradient_checkpointing: bool) -> dict:
    """The same workload through TRL's GRPOTrainer (HF generate, one update per generation batch, no KL)."""
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

    n = cfg.prompts * cfg.group_size
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=n, gradient_accumulation_steps=1,
            num_generations=cfg.group_size, max_completion_length=cfg.new_tokens, temperature=1.0,
            generation_kwargs={"min_new_tokens": cfg.new_tokens}, learning_rate=2e-4, beta=0.0, num_iterations=1,
            use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, seed=0,
            disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=gradient_checkpointing,
        )
        trainer = GRPOTrainer(model=path, reward_funcs=exact, args=args, train_dataset=ds,
                              processing_class=M.load_tokenizer(path), callbacks=[StepTimer()])
        trainer._generate = timed(trainer._generate, "generate")
        trainer._calculate_rewards = timed(trainer._calculate_rewards, "score")
        trainer.train()
    res = {k: statistics.median(v[1:]) for k, v in times.items()}
    res["gen_tokens_per_s"] = n * cfg.new_tokens / res["generate"]
    res["peak_gib"] = train.peak_memory_gib(torch.device("cpu"))
    return res


def run_one(cfg: BenchConfig) -> None:
    engine_name, model_name = cfg.one.split(":")
    path = model_for(model_name)
    steps = cfg.steps if model_name == "tiny" else cfg.large_steps
    if engine_name.startswith("trl"):
        res = run_trl(cfg, path, steps, gradient_checkpointing=engine_name == "trl-defaults")
    else:
        res = run_ours(cfg, engine_name, path, steps)
    Path(cfg.result).write_text(json.dumps(res))


def median_of(rounds: list[dict]) -> dict:
    """Each figure's median over rounds (a round that failed is reported only if all failed)."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[0]
    med = {k: statistics.median(r[k] for r in ok) for k in ok[0]}
    med["rounds"] = [r["step"] for r in ok]
    return med


def ratio(ours: dict, trl: dict) -> str:
    """Our step over TRL's. With several rounds: the median of the per-round ratios (round k of ours ran next to
    round k of TRL's, so a drift in machine speed hits both), and their range."""
    if "step" not in trl:
        return "-"
    per_round = [a / b for a, b in zip(ours.get("rounds", []), trl.get("rounds", []))]
    if len(per_round) < 2:
        return f"{ours['step'] / trl['step']:.2f}x"
    return f"{statistics.median(per_round):.2f}x ({min(per_round):.2f}-{max(per_round):.2f})"


def table(results: dict, cfg: BenchConfig) -> str:
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = [f"{cfg.prompts} prompts x {cfg.group_size} samples x {cfg.new_tokens} new tokens, one update per step; "
             "median seconds per step (first step left out), median over rounds", "",
             "| model | engine | step | generate | score | old logprobs | update | refit | everything else "
             "| gen tok/s | train tok/s | peak GiB | generate: ours / engine's own | step vs TRL (matched / defaults) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model_name, engine_name), r in results.items():
        if "error" in r:
            lines.append(f"| {model_name} | {engine_name} | {r['error']} |")
            continue
        vs = "-"
        if not engine_name.startswith("trl"):
            vs = " / ".join(ratio(r, t) for t in (results.get((model_name, e), {}) for e in ("trl", "trl-defaults")))
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
                 "generates and trains). trl: gradient checkpointing off, as train.py by default (the same compute); "
                 "trl-defaults: GRPOConfig's default, gradient checkpointing on. 'generate: ours / engine's own': "
                 "medians of the two called alternately on the same prompts after the run. Step vs TRL: the "
                 "median over rounds of our step / TRL's in the same round, and the range of that ratio.")
    return "\n".join(lines)


def main(cfg: BenchConfig) -> None:
    if cfg.one:
        return run_one(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in cfg.models:  # build models here, once, so no subprocess times a build
        model_for(name)
    runs: dict[tuple[str, str], list[dict]] = {}
    for model_name in cfg.models:
        for k in range(cfg.tiny_rounds if model_name == "tiny" else cfg.rounds):
            for engine_name in cfg.engines:
                res_file = out / f"{engine_name}-{model_name}.json"
                cmd = [sys.executable, __file__, "--one", f"{engine_name}:{model_name}", "--result", str(res_file),
                       *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in asdict(cfg).items()
                             if k in ("prompts", "group_size", "new_tokens", "steps", "large_steps")), [])]
                t0 = time.time()
                print(f"bench: {engine_name} on {model_name}, round {k + 1} ...", flush=True, end=" ")
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    res = {"error": "failed: " + (r.stderr.strip().splitlines() or ["?"])[-1][:200]}
                else:
                    res = json.loads(res_file.read_text())
                    if engine_name.startswith("trl") and "error" not in res:
                        res["update"] = res["step"] - res["generate"] - res["score"]
                print(f"{time.time() - t0:.0f}s, step {res.get('step', float('nan')):.3f}", flush=True)
                runs.setdefault((model_name, engine_name), []).append(res)
    results = {key: median_of(rs) for key, rs in runs.items()}
    text = table(results, cfg)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({f"{m}/{e}": r for (m, e), r in results.items()}, indent=1))
    print(text)


if __name__ == "__main__":
    import tyro

    main(tyro.cli(BenchConfig))

"""Math evaluation: pass@1 averaged over k samples per problem, on AIME 2024 or any file of the same
shape.

What it does: loads problems (a local .jsonl/.json/.parquet, or an HF dataset name such as
HuggingFaceH4/aime_2024 where there is network; field names are flags), builds DeepScaleR's prompt
(chat template when the tokenizer has one), samples k responses per problem with the vLLM engine
(DeepScaleR's protocol by default: k = 16, temperature 0.6, top_p 0.95, 32768 new tokens), scores
each with reward.py (or your own --reward path/to/file.py:function, guarded by user_reward.py),
writes every sample to a JSONL (written aside and renamed, never half-written) and prints a table:
correct/k per problem, pass@1 with a 95% confidence interval, pass@k, mean response length and the
fraction truncated.

Under torchrun the problems are split over the engines (one per rank, or per --tensor-parallel-size
ranks) and the figures are those one process would write.

heldout_accuracy is the same measurement as training runs log it every --eval-every steps.

What it does not do: train, or score any other way than reward.py does.

    python eval_aime.py --model runs/<run>/final --data aime24.jsonl
    torchrun --nproc_per_node 8 eval_aime.py --model runs/<run>/final --data aime24.jsonl
"""

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import tyro

import data
import distributed
import memory
import model
import reward
import rollout
import tool_calls
import toolbox
import user_reward
from checks import check, one_line_errors, writable


@dataclass
class EvalConfig:
    """pass@1 over k samples per problem (95% CI), pass@k, mean length and truncated fraction of a
    model on a problem file; every sample goes to --out. Under torchrun the problems are split over
    the engines."""

    # HF folder (e.g. a run's <out_dir>/final), hub name, or a folder's name in the cache's models/
    # (as train.py's --model: the demo's bases, once `python demo/bases.py NAME` built them)
    model: str
    data: str  # problems: .jsonl / .json / .parquet, or an HF dataset name[:split]
    out: str = "eval_samples.jsonl"  # every sample, one JSON line each
    problem_field: str = "problem"  # field holding the problem text
    answer_field: str = "answer"  # field holding the gold answer
    # a text file with {problem}, used instead of the chat template + instruction
    prompt_template: str = ""
    # math: the final answer (--answer) checked by math-verify; exact: the whole response equals
    # the answer; path/to/file.py:function: your own (response, gold) -> float, guarded as in
    # train.py (user_reward.py)
    reward: str = "math"
    # --reward math: the final answer is the last \boxed{} (boxed: DeepScaleR's), or that when it is
    # there and not empty, else the response's last number (last-number: for models too small to
    # box their answers, reward.py)
    answer: Literal["boxed", "last-number"] = "boxed"
    reward_timeout_s: float = 1.0  # --reward FILE:FUNCTION: a call running longer scores 0
    # tools the model may call, as train.py's --tool: calculator, python, path/to/file.py:function
    tool: list[str] = field(default_factory=list)
    max_tool_calls: int = 4  # --tool: a response ends after this many calls' outputs
    tool_timeout_s: float = 5.0  # --tool: a call running longer gives an error text as its output
    k: int = 16  # samples per problem
    temperature: float = 0.6  # sampling temperature
    top_p: float = 0.95  # nucleus sampling
    max_tokens: int = 32768  # response length limit
    max_model_len: int = 0  # prompt + response; 0 = longest prompt + max_tokens
    tensor_parallel_size: int = 1  # vLLM tensor parallelism (GPUs per engine)
    # GPU memory share for vLLM's weights and KV cache (no trainer beside it)
    gpu_memory_utilization: float = 0.9
    # vLLM dtype (auto: bf16 on GPU, float32 on CPU)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # vllm, or HF generate (rollout.HFEngine: no vLLM needed; slow at scale, for small models and
    # checks)
    engine: Literal["vllm", "hf"] = "vllm"
    seed: int = 0  # sampling seed
    trust_remote_code: bool = False  # let transformers/vLLM run code shipped with the model


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) /
    C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(rows: list[dict], n_problems: int, k: int) -> dict:
    """Figures from the per-sample rows (the JSONL's content): pass@1 with a 95% CI over problems,
    pass@k, ..."""
    correct = [0] * n_problems
    calls = sum(r.get("tool_calls", 0) for r in rows)  # --tool
    for r in rows:
        correct[r["problem_idx"]] += int(r["reward"] == 1.0)
    per_problem = [c / k for c in correct]
    mean = sum(per_problem) / n_problems
    var = sum((p - mean) ** 2 for p in per_problem) / max(n_problems - 1, 1)
    half = 1.96 * math.sqrt(var / n_problems)  # normal approximation over problems
    return {
        "problems": n_problems,
        "k": k,
        "pass@1": mean,
        "ci95": [mean - half, mean + half],
        f"pass@{k}": sum(pass_at_k(k, c, k) for c in correct) / n_problems,
        "mean_response_tokens": sum(r["tokens"] for r in rows) / len(rows),
        "truncated_frac": sum(r["truncated"] for r in rows) / len(rows),
        "correct": correct,
    } | (
        {  # --tool: calls per response, and of those the failed ones
            "tool_calls_mean": calls / len(rows),
            "tool_error_frac": sum(r["tool_errors"] for r in rows) / max(calls, 1),
        }
        if rows and "tool_calls" in rows[0]
        else {}
    )


def heldout_accuracy(
    engine,
    tok,
    prompts: list[list[int]],
    answers: list[str],
    reward_fn,
    k: int,
    max_tokens: int | list[int],
    temperature: float,
    seed: int,
    tp: int = 1,
    progress: bool = False,
    tools: tool_calls.Tools | None = None,
) -> dict:
    """The held-out figures a training run logs (GRPO and DPO): heldout_pass1 = mean reward over k
    samples per prompt at `temperature`, with its 95% CI over prompts as summarize() gives it
    (heldout_pass1_ci95_low, _high), heldout_greedy = mean reward of one greedy response per prompt,
    and over the k samples heldout_response_len_mean (tokens) and heldout_truncated_frac (those cut
    off at their limit), as the training rows' response_len_mean and truncated_frac.
    Each engine (rank, or group of `tp` tensor-parallel ranks sending identical requests) takes its
    share; a collective. Each prompt's samples come from streams of its own, seeded by its index in
    `prompts`: independent across ranks, and the same figures at any world size. max_tokens: one
    limit, or one per prompt. With `tools` (--tool) the responses call them (tool_calls.generate),
    the reward reads the model's own text, and heldout_tool_calls_mean (calls per sampled response)
    and heldout_tool_error_frac (of those calls, the failed ones) join the figures."""
    first, last = distributed.share(
        prompts, distributed.rank() // tp, distributed.world_size() // tp
    )
    mine, gold = prompts[first:last], answers[first:last]
    caps = max_tokens[first:last] if isinstance(max_tokens, list) else max_tokens
    sampled = tool_calls.generate(
        engine,
        mine,
        n=k,
        max_tokens=caps,
        tools=tools,
        temperature=temperature,
        seed=seed,
        progress=progress,
        first_index=first,
    )
    greedy = tool_calls.generate(
        engine, mine, n=1, max_tokens=caps, tools=tools, temperature=0.0, seed=seed,
        first_index=first,
    )  # fmt: skip
    s, g = (
        [reward_fn(tool_calls.model_text(tok, x, tools), gold[x.prompt_idx]) for x in samples]
        for samples in (sampled, greedy)
    )
    per_prompt = [0.0] * len(mine)  # each prompt's pass rate over its k samples
    for x, r in zip(sampled, s):
        per_prompt[x.prompt_idx] += r / k
    counted = float(distributed.rank() % tp == 0)
    sums = [sum(s), sum(g), sum(per_prompt), sum(p * p for p in per_prompt), len(mine)]
    # lengths in sampled tokens, as the training rows' response_len_mean (a tool's are not the
    # model's)
    length = sum(len(x.token_ids) - tool_calls.tool_tokens(x) for x in sampled)
    sums += [length, sum(x.truncated for x in sampled)]
    sums += [sum(x.tool_calls for x in sampled), sum(x.tool_errors for x in sampled)]
    tot = distributed.all_reduce_sum(counted * torch.tensor(sums, dtype=torch.float64)).tolist()
    n = tot[4]  # prompts: k samples and one greedy response each
    if not n:
        return {}
    # the 95% CI of pass@1 as summarize() gives it: normal approximation over prompts
    mean = tot[2] / n
    half = 1.96 * math.sqrt(max(tot[3] - n * mean * mean, 0.0) / max(n - 1, 1) / n)
    return {
        "heldout_pass1": tot[0] / (k * n),
        "heldout_pass1_ci95_low": mean - half,
        "heldout_pass1_ci95_high": mean + half,
        "heldout_greedy": tot[1] / n,
        "heldout_response_len_mean": tot[5] / (k * n),
        "heldout_truncated_frac": tot[6] / (k * n),
    } | (
        {
            "heldout_tool_calls_mean": tot[7] / (k * n),
            "heldout_tool_error_frac": tot[8] / tot[7] if tot[7] else 0.0,
        }
        if tools
        else {}
    )


def kv_cache_gib(cfg: EvalConfig, shape: memory.Shape, seqs: int, max_len: int) -> float:
    """The CPU engine's KV cache: room for this engine's `seqs` samples of up to `max_len` tokens
    at once, within half the memory free now, and never less than one sequence of `max_len` (vLLM
    refuses to start an engine whose cache cannot hold one, a rank with no prompts too)."""
    width, tp = 2 if cfg.dtype in ("bfloat16", "float16") else 4, cfg.tensor_parallel_size
    need, one = (memory.engine_kv_cache_gib(shape, n, max_len, width, tp) for n in (seqs, 1))
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return max(min(need, max(free / 2 / distributed.local_world_size(), 1.0)), one)


def engine_args(cfg: EvalConfig, path: str, max_len: int) -> dict:
    """rollout.VLLMEngine's arguments for this evaluation, but the CPU KV cache's size: alone on
    its GPUs (not colocated: it never sleeps)."""
    return dict(
        model_path=path,
        max_model_len=max_len,
        seed=cfg.seed,
        dtype=cfg.dtype,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        colocated=False,
        tensor_parallel_size=cfg.tensor_parallel_size,
        trust_remote_code=cfg.trust_remote_code,
        external_launcher=distributed.in_group(),
    )


def validate(cfg: EvalConfig, world: int) -> None:
    """One line naming the bad flag, before any model or engine loads."""
    check(
        [
            *model.model_checks("--model", cfg.model),
            (
                cfg.reward in ("math", "exact") or ":" in cfg.reward,
                f"--reward {cfg.reward}: use math, exact, or your own path/to/file.py:function",
            ),
            *(
                user_reward.checks(cfg.reward, cfg.reward_timeout_s)
                if cfg.reward not in ("math", "exact")
                else []
            ),
            (
                cfg.answer == "boxed" or cfg.reward == "math",
                f"--answer {cfg.answer}: chooses how --reward math reads an answer (not --reward "
                f"{cfg.reward})",
            ),
            *toolbox.checks(
                cfg.tool, cfg.tool_timeout_s, cfg.max_tool_calls, cfg.tensor_parallel_size
            ),
            (cfg.k >= 1, f"--k {cfg.k}: must be at least 1"),
            (
                cfg.temperature >= 0,
                f"--temperature {cfg.temperature}: must be 0 (greedy) or positive",
            ),
            (0 < cfg.top_p <= 1, f"--top-p {cfg.top_p}: must be in (0, 1]"),
            (cfg.max_tokens >= 1, f"--max-tokens {cfg.max_tokens}: must be at least 1"),
            (
                cfg.max_model_len == 0 or cfg.max_model_len > cfg.max_tokens,
                f"--max-model-len {cfg.max_model_len}: must be 0 (auto) or above --max-tokens "
                f"{cfg.max_tokens}",
            ),
            (
                cfg.tensor_parallel_size >= 1 and world % cfg.tensor_parallel_size == 0,
                f"--tensor-parallel-size {cfg.tensor_parallel_size}: must divide the {world} ranks",
            ),
            *memory.engine_checks(cfg.gpu_memory_utilization),
            (writable(Path(cfg.out).absolute().parent), f"--out {cfg.out}: cannot be written"),
        ]
    )


def main(cfg: EvalConfig, engine=None) -> dict:
    """Run the evaluation; `engine` lets a caller (the tests) bring a vLLM engine that holds the
    model already.

    Under torchrun each engine (each rank, or each group of --tensor-parallel-size ranks) samples
    its share of the problems; rank 0 gathers the samples and writes the same JSONL and figures as
    one process would: every problem's seed is its index in the file, whatever the split."""
    rank, world = distributed.init()
    validate(cfg, world)
    # bad rows stop here
    problems = data.load_problems(cfg.data, cfg.problem_field, cfg.answer_field)
    template = data.read_template(cfg.prompt_template)
    path = model.resolve(cfg.model)
    tok = model.load_tokenizer(path, cfg.trust_remote_code)
    prompts = [data.math_prompt(tok, p.prompt, template) for p in problems]
    max_len = cfg.max_model_len or max(map(len, prompts)) + cfg.max_tokens
    tp = cfg.tensor_parallel_size
    groups = world // tp
    first, last = distributed.share(prompts, rank // tp, groups)
    own_engine = engine is None  # an engine the caller brought is the caller's to close
    cuda = torch.cuda.is_available()
    if own_engine and cfg.engine == "hf":
        auto = torch.bfloat16 if cuda else torch.float32
        engine = rollout.HFEngine(
            path,
            dtype=auto if cfg.dtype == "auto" else getattr(torch, cfg.dtype),
            trust_remote_code=cfg.trust_remote_code,
            device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu",
        )
    elif own_engine:
        kv = {}  # CPU: room for this engine's samples at once (kv_cache_gib)
        if not cuda:
            shape = memory.Shape.from_config(path, cfg.trust_remote_code)
            kv["kv_cache_gib"] = kv_cache_gib(cfg, shape, (last - first) * cfg.k, max_len)
        engine = rollout.VLLMEngine(**engine_args(cfg, path, max_len), **kv)
    tools = data.load_tools(cfg.tool, cfg.tool_timeout_s, cfg.max_tool_calls, tok)
    samples = tool_calls.generate(
        engine,
        prompts[first:last],
        n=cfg.k,
        max_tokens=cfg.max_tokens,
        tools=tools,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=cfg.seed,
        first_index=first,
    )
    score = {
        "math": functools.partial(reward.math_reward, answer=cfg.answer),
        "exact": reward.exact_reward,
    }.get(cfg.reward) or user_reward.load(cfg.reward, cfg.reward_timeout_s)
    rows = []
    for s in samples:
        i = first + s.prompt_idx
        rows.append(
            {
                "problem_idx": i,
                "answer": problems[i].answer,
                # the whole response, tools' outputs included (special tokens skipped)
                "response": tok.decode(s.token_ids, skip_special_tokens=True),
                # the model's own text, which the reward reads (tool_calls.model_text)
                "reward": score(tool_calls.model_text(tok, s, tools), problems[i].answer),
                "truncated": s.truncated,
                "tokens": len(s.token_ids) - tool_calls.tool_tokens(s),  # the sampled ones
            }
            | (
                {
                    "tool_calls": s.tool_calls,
                    "tool_errors": s.tool_errors,
                    "tool_tokens": tool_calls.tool_tokens(s),
                }
                if tools
                else {}
            )
        )
    rows = [r for part in distributed.gather_to_main(rows if rank % tp == 0 else []) for r in part]
    custom = isinstance(score, user_reward.Guarded)  # --reward FILE:FUNCTION
    own = score.failures() if custom and rank % tp == 0 else 0
    # samples a --reward FILE:FUNCTION failed on
    failed = int(distributed.all_reduce_sum(torch.tensor([float(own)]))[0])
    distributed.close(engine if own_engine else None)  # every collective is done
    if not distributed.is_main():
        return {}
    out, tmp = Path(cfg.out), Path(cfg.out + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)  # validate() found it writable or creatable
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tmp.replace(out)
    summary = summarize(rows, len(problems), cfg.k)
    if custom:
        # samples whose reward raised, hung or returned a non-number: scored 0
        summary["reward_errors"] = failed
    for i, c in enumerate(summary["correct"]):
        print(f"problem {i:4d}  {c:3d}/{cfg.k}  gold {problems[i].answer[:40]}")
    lo, hi = summary["ci95"]
    print(
        f"\n{cfg.model} on {cfg.data}: {len(problems)} problems x {cfg.k} samples "
        f"(T={cfg.temperature}, "
        f"top_p={cfg.top_p}, {groups} engine{'s' if groups > 1 else ''})\n"
        f"pass@1 {summary['pass@1']:.4f}  (95% CI {lo:.4f} .. {hi:.4f})   pass@{cfg.k} "
        f"{summary[f'pass@{cfg.k}']:.4f}\n"
        f"mean response {summary['mean_response_tokens']:.0f} tokens, truncated "
        f"{summary['truncated_frac']:.3f}\n"
        + (f"reward errors (scored 0): {failed}\n" if custom else "")
        + (
            f"tool calls per response {summary['tool_calls_mean']:.2f}, failed "
            f"{summary['tool_error_frac']:.3f}\n"
            if cfg.tool
            else ""
        )
        + f"samples in {out}"
    )
    summary_file = out.with_suffix(".summary.json")
    summary_file.with_suffix(".tmp").write_text(
        json.dumps({"config": asdict(cfg), **summary}, indent=1)
    )
    summary_file.with_suffix(".tmp").replace(summary_file)
    return summary


if __name__ == "__main__":
    one_line_errors(lambda: main(tyro.cli(EvalConfig)))

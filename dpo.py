"""DPO beside GRPO: offline preference training. `python dpo.py` runs the CPU demo; `--help` lists
every flag.

What it does: trains a policy on (prompt, chosen, rejected) pairs with the DPO loss (Rafailov et al.
2023), its label-smoothed "conservative" variant, or IPO (Azar et al. 2023), against a frozen
reference model (the start weights). Everything else is GRPO's machinery, reused: model.py's chunked
per-token logprobs, distributed.py's FSDP2 sharding, token-budget micro-batches and
global-normalizer reductions, runtime.py's flags every run has and its run skeleton (resume,
evaluation cadence, checkpoints, Ctrl-C, the final weights), eval_aime.py's held-out accuracy.
Compared with train.py, what is *gone* is the whole online half (generation, rewards, advantages,
refit): the data are fixed pairs, and the "reward" is implicit in the log-ratio between policy and
reference. What is *new* is one loss and one data loader.

    h_i    = [log pi(y_c|x) - log pi_ref(y_c|x)] - [log pi(y_r|x) - log pi_ref(y_r|x)]
                                                                     (log-ratio margin)
    DPO    : l_i = -(1 - eps) log sigmoid(beta h_i) - eps log sigmoid(-beta h_i)
                                                                     (eps = label smoothing)
    IPO    : l_i = (h_i - 1 / (2 beta))^2, with log pi = the *mean* over response tokens
                                                                     (IPO paper, TRL)
    loss   = sum over the global batch of l_i / number of pairs in the global batch

The demo (no --data): the demo's tiny base model (pretrained with 65% careless "a+b" answers to
"a+b+c=") on a synthetic preference set made here from the demo's sum3 problems (sum3_pairs):
chosen = the right sum, rejected = the careless a+b or another wrong number (two pairs per prompt).
The base and the problems are read from the cache, where `python demo/bases.py tiny` and `python
demo/tasks.py sum3` put them (`make dpo` runs both). It reports held-out preference accuracy (pairs
of the 200 held-out prompts) and held-out task accuracy (greedy and pass@1 over 4 samples at T = 1,
the same figures as GRPO's demo, via rollout.HFEngine).

What it does not do: generate during training (DPO is offline), reward models, or multi-turn losses
(only the last assistant message of a conversation is the response). `python dpo.py export CKPT OUT`
exports a saved step.
"""

import random
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Literal

import torch
import torch.nn.functional as F

import batch
import data
import distributed
import eval_aime
import model
import reward
import rollout
import runtime
from checkpoint import export_hf
from checks import UserError, check, one_line_errors


@dataclass
class DPOConfig:
    """DPO, conservative DPO or IPO on preference pairs: the built-in demo (no flags), or your pairs
    and model. `python dpo.py export CKPT OUT` writes a saved step as an HF folder. The flags are in
    two groups: DPO's own and the run's, which train.py shares (runtime.RunConfig, here with a
    learning rate of 1e-4, no weight decay and a 600 s collective timeout); on the command line all
    are flat."""

    # preference data (--data, --val-data and --val-fraction are run options)
    prompt_field: str = "prompt"  # field of the prompt (a string, or a list of chat messages)
    # field of the preferred response (a string, or messages ending in the assistant's)
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"  # field of the dispreferred response (same forms)
    # loss

    # DPO (sigmoid) or IPO (squared, per-token-averaged logprobs)
    loss: Literal["dpo", "ipo"] = "dpo"
    # strength of the tie to the reference model (DPO's KL coefficient; IPO's target 1/(2 beta))
    beta: float = 0.1
    # DPO only: probability eps that a label is flipped (conservative DPO), in [0, 0.5)
    label_smoothing: float = 0.0
    # batch
    batch_size: int = 64  # pairs per optimizer step, over all ranks
    # prompt + the longer response; longer pairs are dropped, counted and reported
    max_seq_len: int = 64
    max_new_tokens: int = 8  # sum3 demo: response length limit of the held-out generations
    run: runtime.RunConfig = field(
        default_factory=lambda: runtime.RunConfig(lr=1e-4, weight_decay=0.0, dist_timeout_s=600)
    )
    """what every training run has, GRPO's and DPO's (runtime.py): model, data, compute, optimizer,
    evaluation, checkpoints, logging"""


# ----------------------------------------------------------------------------------------------
# The loss


@dataclass
class PairMetrics:
    """dpo_loss's diagnostics, per pair ([B] each), or summed over pairs (update: divided by the
    pair count, the logged means). The implicit rewards are the DPO paper's, for IPO too."""

    loss: float | torch.Tensor = 0.0
    reward_chosen: float | torch.Tensor = 0.0  # beta (log pi - log pi_ref)(y_c)
    reward_rejected: float | torch.Tensor = 0.0  # beta (log pi - log pi_ref)(y_r)
    reward_margin: float | torch.Tensor = 0.0  # reward_chosen - reward_rejected = beta h
    reward_acc: float | torch.Tensor = 0.0  # 1 where reward_chosen > reward_rejected (0 at a tie)
    logp_chosen: float | torch.Tensor = 0.0  # log pi(y_c | x)
    logp_rejected: float | torch.Tensor = 0.0  # log pi(y_r | x)


def dpo_loss(
    # [B] log pi(y_c | x), summed (DPO) or averaged (IPO) over response tokens
    pol_chosen: torch.Tensor,
    pol_rejected: torch.Tensor,  # [B] log pi(y_r | x)
    ref_chosen: torch.Tensor,  # [B] log pi_ref(y_c | x), no grad
    ref_rejected: torch.Tensor,  # [B] log pi_ref(y_r | x), no grad
    beta: float,
    label_smoothing: float = 0.0,
    kind: str = "dpo",
) -> tuple[torch.Tensor, PairMetrics]:
    """The per-pair loss [B] and per-pair diagnostics (PairMetrics, each [B]).

    With the log-ratio margin h = (log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r)):

      dpo: l = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
           eps = 0 is DPO (Rafailov et al. 2023): the Bradley-Terry likelihood of the preference
           under the implicit reward r(x, y) = beta log(pi(y|x) / pi_ref(y|x)). eps > 0 is
           conservative DPO (Mitchell 2023): the label is flipped with probability eps, so l is
           minimized at a finite margin beta h = log((1 - eps) / eps) instead of pushing h to
           infinity.
      ipo: l = (h - 1 / (2 beta))^2  (Azar et al. 2023): regresses the margin to a fixed target
           rather than maximizing it, so it cannot overfit deterministic preferences. The caller
           passes logprobs *averaged* over each response's tokens, as the IPO paper's
           implementation and TRL do (a sum would make the target 1/(2 beta) mean different things
           for long and short responses).

    Diagnostics (the implicit rewards of the DPO paper, also for IPO): reward_chosen = beta (log pi
    - log pi_ref)(y_c), reward_rejected likewise, margin = their difference = beta h, accuracy = 1
    where reward_chosen > reward_rejected (0 at a tie, so 0 everywhere at step 0, when policy =
    reference).
    """
    h = (pol_chosen - ref_chosen) - (pol_rejected - ref_rejected)  # [B]
    if kind == "dpo":
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(
            -beta * h
        )
    elif kind == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}: use dpo or ipo")
    r_c = beta * (pol_chosen - ref_chosen).detach()  # [B]
    r_r = beta * (pol_rejected - ref_rejected).detach()  # [B]
    return loss, PairMetrics(
        loss.detach(),
        r_c,
        r_r,
        r_c - r_r,
        (r_c > r_r).float(),
        pol_chosen.detach(),
        pol_rejected.detach(),
    )


# ----------------------------------------------------------------------------------------------
# Preference data


@dataclass(frozen=True)
class PrefRow:
    """One preference as text: the prompt (a string, or chat messages) and two responses
    (strings)."""

    prompt: str | tuple
    chosen: str
    rejected: str


@dataclass(frozen=True)
class Pair:
    """One preference as token ids; the rows the model sees are prompt + chosen and prompt +
    rejected."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]  # response tokens, ending with EOS
    rejected: tuple[int, ...]
    weight: float = 1.0  # its share of the loss: 1, or 0 for FSDP_PLACEHOLDER

    @property
    def length(self) -> int:  # the padded width of the pair's two rows
        return len(self.prompt) + max(len(self.chosen), len(self.rejected))


def load_pairs(
    path: str,
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
) -> list[PrefRow]:
    """Preference rows from a file or HF dataset (data.py's readers). Each field is a string or a
    list of chat messages ({"role", "content"}); a response given as messages is the content of its
    last message, which must be the assistant's (so UltraFeedback-style rows, whose "chosen" repeats
    the user turn, work too). A bad row raises data.DataError, one line naming the file and the row
    (train_dpo reads the data before any model loads)."""
    rows = []
    for i, row in data.read_rows(path):
        where = f"{path}: row {i}"
        if not isinstance(row, dict):
            raise data.DataError(
                f"{where}: expected an object with fields {prompt_field!r}, {chosen_field!r} and "
                f"{rejected_field!r}"
            )
        vals = []  # prompt, chosen, rejected
        for key in (prompt_field, chosen_field, rejected_field):
            if key not in row:
                raise data.DataError(
                    f"{where}: missing field {key!r} (fields: {', '.join(map(str, row))})"
                )
            v = row[key]
            if isinstance(v, (list, tuple)) and v:
                if not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m
                    for m in v
                ):
                    raise data.DataError(
                        f"{where}: {key!r} is a list, but not of chat messages with 'role' and "
                        "'content'"
                    )
                msgs = tuple((m["role"], m["content"]) for m in v)
                if key != prompt_field and msgs[-1][0] != "assistant":
                    raise data.DataError(
                        f"{where}: the last message of {key!r} is not the assistant's"
                    )
                v = msgs if key == prompt_field else msgs[-1][1]
            elif not isinstance(v, str):
                raise data.DataError(
                    f"{where}: {key!r} must be a string or a list of chat messages, "
                    f"not {type(v).__name__}"
                )
            if isinstance(v, str) and not v.strip():
                raise data.DataError(f"{where}: empty {key!r}")
            vals.append(v)
        rows.append(PrefRow(*vals))
    if not rows:
        raise data.DataError(f"{path}: no preference pairs")
    return rows


def encode_pairs(tok, rows: list[PrefRow], max_seq_len: int, what: str) -> list[Pair]:
    """Token ids: the prompt through the chat template when the tokenizer has one (else plain text,
    as for the tiny model), each response as plain tokens + EOS (the end of an assistant turn).
    Pairs longer than max_seq_len are dropped, counted and reported: truncating one would compare a
    cut response with a whole one."""
    pairs = []
    for i, r in enumerate(rows, 1):
        msgs = (
            [{"role": "user", "content": r.prompt}]
            if isinstance(r.prompt, str)
            else [{"role": role, "content": c} for role, c in r.prompt]
        )
        if tok.chat_template:
            prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
        elif isinstance(r.prompt, str):
            prompt = tok(r.prompt)["input_ids"]
        else:
            raise UserError(
                f"{what} pair {i}: the prompt is a list of chat messages, "
                "but the tokenizer has no chat template"
            )
        resp = [
            tuple(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            for t in (r.chosen, r.rejected)
        ]
        pairs.append(Pair(tuple(prompt), *resp))
    keep = [p for p in pairs if p.length <= max_seq_len]
    if len(keep) < len(pairs):
        distributed.print0(
            f"dropped {len(pairs) - len(keep)} of {len(pairs)} {what} pairs longer than "
            f"{max_seq_len} tokens (--max-seq-len)"
        )
    if pairs and not keep:
        raise UserError(
            f"every {what} pair is longer than {max_seq_len} tokens; raise --max-seq-len"
        )
    return keep


def sum3_pairs(problems: list[data.Problem], seed: int) -> list[PrefRow]:
    """The demo's preferences from the sum3 problems ("a+b+c=" -> the sum): two pairs per prompt,
    both with chosen = the right sum. The first rejects the careless a+b that the base model
    prefers (when c != 0; when c = 0 it *is* the right sum, so another wrong number in 0..27
    instead), the second another wrong number: rejecting only a+b would teach "not a+b", and the
    probability it loses could go to any other wrong answer as well as to the right one."""
    rng = random.Random(seed)
    rows = []
    for p in problems:
        a, b, c = (int(x) for x in p.prompt.rstrip("=").split("+"))
        others = rng.sample([n for n in range(28) if n not in (a + b + c, a + b)], 2)
        for wrong in ([a + b] if c else others[1:]) + others[:1]:
            rows.append(PrefRow(p.prompt, p.answer, str(wrong)))
    return rows


def load_preferences(cfg: DPOConfig) -> tuple[list[PrefRow], list[PrefRow], list[data.Problem]]:
    """(training rows, held-out rows, held-out sum3 problems for task accuracy: only for the
    synthetic set)."""
    run = cfg.run
    if not run.data:  # the demo's sum3 problems, as `python demo/tasks.py sum3` wrote them
        train_set, heldout = (data.load_problems(f) for f in data.cached_problems("sum3"))
        # the held-out pairs' wrong answers from a stream of their own (seed + 1), not the training
        # pairs' again
        return sum3_pairs(train_set, run.seed), sum3_pairs(heldout, run.seed + 1), heldout
    names = cfg.prompt_field, cfg.chosen_field, cfg.rejected_field
    rows = load_pairs(run.data, *names)
    if run.val_data:
        return rows, load_pairs(run.val_data, *names), []
    return *data.split(rows, run.val_fraction, run.seed), []


# ----------------------------------------------------------------------------------------------
# One update


def pair_logps(
    m, pairs: list[Pair], cfg: DPOConfig, device, pad_id: int, grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_c|x), log pi(y_r|x): each [n], summed over response tokens (averaged for IPO), from
    one forward over rows [2n, L]: the n chosen rows, then the n rejected ones, right-padded."""
    seqs = [p.prompt + p.chosen for p in pairs] + [p.prompt + p.rejected for p in pairs]
    resp = [len(p.chosen) for p in pairs] + [len(p.rejected) for p in pairs]
    ids, am = batch.pad(seqs, pad_id)  # [2n, L] each
    start = torch.tensor([len(p.prompt) for p in pairs] * 2)  # [2n]
    with torch.set_grad_enabled(grad), runtime.autocast(cfg.run, device):
        # [2n, T], zero past each response's end
        lp, _ = m(
            ids.to(device),
            am.to(device),
            start.to(device),
            max(resp),
            1.0,
            cfg.run.logprob_chunk_tokens,
        )
    s = lp.sum(-1)  # [2n]
    if cfg.loss == "ipo":  # the mean over response tokens
        s = s / torch.tensor(resp).to(device).clamp(min=1).to(s.dtype)
    return s[: len(pairs)], s[len(pairs) :]


# a micro-batch of zero loss in place of one this rank lacks (FSDP's collectives need the same
# passes on every rank): one token of prompt and one of each response, whatever the length of the
# real pairs, and no share of the loss
FSDP_PLACEHOLDER = Pair((1,), (2,), (2,), weight=0.0)


def pair_micro_batches(pairs: list[Pair], token_budget: int) -> list[tuple[list[int], list[Pair]]]:
    """(rows, their pairs) per micro-batch: whole pairs (the loss needs both rows) within the token
    budget counted over both padded rows, longest first (distributed.micro_batches), and as many on
    every rank: a rank with fewer runs ([], [FSDP_PLACEHOLDER]) in place of each it lacks (FSDP's
    collectives need the same passes). A collective."""
    return [
        (rows, [pairs[i] for i in rows] or [FSDP_PLACEHOLDER])
        for rows in distributed.micro_batches(
            [2 * p.length for p in pairs], list(range(len(pairs))), token_budget
        )
    ]


def update(
    policy, ref, opt, sched, pairs: list[Pair], n_global: int, cfg: DPOConfig, device, pad_id: int
) -> tuple[PairMetrics, float, bool]:
    """One optimizer step on this rank's share `pairs` of a global batch of `n_global` pairs.

    Each micro-batch: reference logprobs (no grad), policy logprobs (grad), the loss summed over its
    pairs and divided by n_global, times distributed.loss_scale() (FSDP averages over ranks; we want
    the sum), backward. So the gradient is that of the global batch's mean loss at any world size
    and any micro-batching. Returns (this rank's metric sums, the gradient norm, whether the step
    was skipped for a non-finite one).
    """
    policy.train()
    sums = PairMetrics()
    micro = pair_micro_batches(pairs, cfg.run.micro_batch_tokens)
    for k, (_, mb) in enumerate(micro):
        ref_c, ref_r = pair_logps(ref, mb, cfg, device, pad_id, grad=False)  # [n], [n]
        pol_c, pol_r = pair_logps(policy, mb, cfg, device, pad_id, grad=True)  # [n], [n]
        # [n] each
        loss, metrics = dpo_loss(
            pol_c, pol_r, ref_c, ref_r, cfg.beta, cfg.label_smoothing, cfg.loss
        )
        weight = torch.tensor([p.weight for p in mb], dtype=loss.dtype, device=loss.device)  # [n]
        # one gradient reduction per step
        with distributed.gradient_sync(policy, k == len(micro) - 1):
            ((loss * weight).sum() * (1 / n_global) * distributed.loss_scale()).backward()
        runtime.accumulate(sums, metrics, weight)
    grad_norm, skipped = runtime.optimizer_step(policy, opt, cfg.run.grad_clip)
    if not skipped:
        sched.step()
    policy.eval()
    return sums, grad_norm, skipped


# ----------------------------------------------------------------------------------------------
# Evaluation


def eval_logps(m, pairs: list[Pair], cfg: DPOConfig, device, pad_id: int) -> torch.Tensor:
    """[n, 2] log pi of (chosen, rejected) for this rank's share of `pairs` (no grad; every rank the
    same passes)."""
    out = torch.zeros(len(pairs), 2, dtype=torch.float64)
    for rows, mb in pair_micro_batches(pairs, cfg.run.micro_batch_tokens):
        lp = pair_logps(m, mb, cfg, device, pad_id, grad=False)  # chosen [n], rejected [n]
        out[rows] = torch.stack(lp, 1).double().cpu()  # a placeholder's rows are none
    return out


def evaluate_pairs(
    policy, ref_lp: torch.Tensor, pairs: list[Pair], cfg: DPOConfig, device, pad_id: int
) -> dict:
    """Held-out preference figures, reduced over ranks:
    heldout_pref_acc   = fraction of pairs where the policy itself gives y_c the higher log pi
                         (meaningful at step 0: the base model's own preference),
    heldout_reward_acc = fraction where the implicit reward beta log(pi/pi_ref) of y_c is higher
                         (DPO's "accuracy"; 0 at step 0, when every margin is 0),
    heldout_margin     = mean implicit reward margin."""
    lp = eval_logps(policy, pairs, cfg, device, pad_id)  # [n, 2]
    d = lp - ref_lp  # [n, 2] log pi - log pi_ref of (chosen, rejected)
    margin = cfg.beta * (d[:, 0] - d[:, 1])  # [n]
    tot = distributed.all_reduce_sum(
        torch.tensor(
            [
                float((lp[:, 0] > lp[:, 1]).sum()),
                float((margin > 0).sum()),
                float(margin.sum()),
                float(len(pairs)),
            ],
            dtype=torch.float64,
        )
    ).tolist()
    if not tot[3]:
        return {}
    return {
        "heldout_pref_acc": tot[0] / tot[3],
        "heldout_reward_acc": tot[1] / tot[3],
        "heldout_margin": tot[2] / tot[3],
    }


# ----------------------------------------------------------------------------------------------
# The loop


def validate(cfg: DPOConfig, world: int) -> None:
    """One clear line for a bad flag, before any data or model is loaded: DPO's own flags, and those
    every run has (runtime.run_checks)."""
    check(
        [
            (cfg.beta > 0, f"--beta {cfg.beta}: must be positive"),
            (
                0.0 <= cfg.label_smoothing < 0.5,
                f"--label-smoothing {cfg.label_smoothing}: must be in [0, 0.5)",
            ),
            (
                cfg.loss == "dpo" or cfg.label_smoothing == 0.0,
                f"--label-smoothing {cfg.label_smoothing}: only for --loss dpo "
                "(IPO has no labels to smooth)",
            ),
            (
                cfg.batch_size >= world and cfg.batch_size % world == 0,
                f"--batch-size {cfg.batch_size}: must be a positive multiple of the {world} ranks",
            ),
            (cfg.max_seq_len >= 2, f"--max-seq-len {cfg.max_seq_len}: must be at least 2"),
            (
                0 < cfg.max_new_tokens < cfg.max_seq_len,
                f"--max-new-tokens {cfg.max_new_tokens}: must be positive and below --max-seq-len "
                f"{cfg.max_seq_len}",
            ),
            *runtime.run_checks(cfg.run),
        ]
    )


def train_dpo(cfg: DPOConfig) -> dict:
    """Run DPO: the run skeleton of train.py (runtime.Run) around one update of fixed preference
    pairs per step."""
    rank, world = distributed.init(cfg.run.dist_timeout_s)
    validate(cfg, world)  # bad flags stop the run here, before any data or model loads
    device, bf16 = runtime.setup_process(cfg.run)
    train_rows, heldout_rows, heldout_problems = load_preferences(cfg)  # and bad data here
    path = model.resolve(cfg.run.model)
    tok = model.load_tokenizer(path, cfg.run.trust_remote_code)
    train_pairs = encode_pairs(tok, train_rows, cfg.max_seq_len, "training")
    heldout_pairs = encode_pairs(tok, heldout_rows, cfg.max_seq_len, "held-out")
    check(
        [
            (
                len(train_pairs) >= cfg.batch_size,
                f"--batch-size {cfg.batch_size}: only {len(train_pairs)} training pairs",
            )
        ]
    )
    remote, bf16_params = cfg.run.trust_remote_code, runtime.fsdp_bf16(cfg.run, device)
    policy = model.load_trainable(
        path, device, cfg.run.activation_checkpointing, remote, bf16_params=bf16_params
    )
    ref = (
        model.load_trainable(path, device, False, remote, bf16_params=bf16_params)
        .eval()
        .requires_grad_(False)
    )
    engine = None
    # task accuracy of the synthetic demo: generate with HF
    if heldout_problems and cfg.run.eval_every:
        engine = rollout.HFEngine(
            path, dtype=torch.bfloat16 if bf16 else torch.float32, device=device
        )
    opt, sched = runtime.optimizer(policy, cfg.run)
    stream = data.PromptStream(len(train_pairs), cfg.run.seed)  # same shuffled order on every rank
    my_heldout = heldout_pairs[slice(*distributed.share(heldout_pairs))]
    ref_heldout = (
        eval_logps(ref, my_heldout, cfg, device, tok.pad_token_id) if cfg.run.eval_every else None
    )

    def evaluate(step: int) -> dict:
        row = evaluate_pairs(policy, ref_heldout, my_heldout, cfg, device, tok.pad_token_id)
        # the sum3 demo only: held-out greedy accuracy and pass@1, exactly as GRPO's demo measures
        # them, with the policy's current weights loaded into the HF-generate engine and fresh
        # samples at every evaluation
        if engine is not None:
            engine.load_weights(model.hf_weights(policy.lm))
            row |= eval_aime.heldout_accuracy(
                engine,
                tok,
                [tok(p.prompt)["input_ids"] for p in heldout_problems],
                [p.answer for p in heldout_problems],
                reward.exact_reward,
                cfg.run.eval_samples,
                cfg.max_new_tokens,
                1.0,
                cfg.run.seed + step,
            )
        return row

    # the run folder, metrics.jsonl, Ctrl-C (only a command-line run owns the process's Ctrl-C)
    show = dict(loss="loss", acc="reward_acc", heldout="heldout_pref_acc")
    run = runtime.Run(cfg, cfg.loss.upper(), show, "dpo-", sigint=__name__ == "__main__")
    # the newest readable checkpoint's step, or 0; one saved over other pairs is refused
    start = run.resume(policy, opt, sched, stream, data.fingerprint(train_pairs))
    if not start:  # step 0's row: the start weights' held-out figures
        run.log(0, evaluate(0) if run.eval_due(0) else {})
    share = cfg.batch_size // world
    for step in run.steps(start):
        t0 = time.time()
        runtime.reset_peak_memory(device)
        # this rank's share of the global batch
        ids = stream.take(cfg.batch_size)[rank * share : (rank + 1) * share]
        pairs = [train_pairs[i] for i in ids]
        sums, grad_norm, skipped = update(
            policy, ref, opt, sched, pairs, cfg.batch_size, cfg, device, tok.pad_token_id
        )
        (tot,) = distributed.sum_over_ranks(sums)
        row = dict(
            epoch=step * cfg.batch_size / len(train_pairs),
            **{f.name: getattr(tot, f.name) / cfg.batch_size for f in fields(tot)},
            grad_norm=grad_norm,
            skipped_updates=int(skipped),
            lr=sched.get_last_lr()[0],
            time_train=time.time() - t0,
            peak_mem_gib=runtime.peak_memory_gib(device),
        )
        if run.eval_due(step):  # held-out figures every --eval-every steps and at the last
            row |= evaluate(step)
        run.log(step, row)  # metrics.jsonl and the progress bar
        stop = run.interrupted()  # Ctrl-C on any rank: a checkpoint, then the loop ends
        if stop or run.checkpoint_due(step):  # every --checkpoint-every steps and at the last
            run.save(step, policy, opt, sched, stream)
    return run.finish(policy, tok, pairs=len(train_pairs))


def main(argv: list[str]) -> None:
    one_line_errors(
        lambda: (
            export_hf(argv, "dpo.py")
            if argv[:1] == ["export"]
            else train_dpo(runtime.cli(DPOConfig, {}, argv))
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])

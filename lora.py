"""LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): `--lora-rank R`
trains low-rank adapters on the policy's linear layers instead of all its weights, through peft.

Each adapted linear layer y = W x becomes
    y = W x + (alpha / r) * B A x    W [out, in] frozen; A [r, in] random, B [out, r] zero:
                                     B A = 0 at start
so the policy starts as the base model, and only A and B get gradients and AdamW state. The defaults
follow "LoRA Without Regret" (Schulman et al., Thinking Machines, 2025): every linear layer of
attention and MLP (peft's "all-linear": all but the LM head), alpha 32 at every rank; it reports
that for RL even rank 1 matches full fine-tuning at about 10x full fine-tuning's learning rate
(README: LoRA measures this in miniature).

What it does:
- Adapters: the three flags (train.Config holds them as `lora`); flag_checks and target_checks: one
  line for a rank below 0, an alpha of 0, a target module the model lacks, an embedding or the LM
  head (not supported), or a layer peft cannot wrap, found on an empty copy of the model built from
  its config on the meta device (no weights load).
- wrap: peft's LoRA on an HF model, before it is sharded (model.load_trainable): every parameter of
  the base frozen (requires_grad False), the adapters trainable, in the base's dtype.
- adapters_off: the policy with its adapters switched off *is* the frozen base: the KL reference
  (--kl-beta > 0) without a second copy of the model.
- merged: the HF-named weights of base + adapters, W + (alpha / r) B A per adapted layer, merged on
  the shards in the trainer's precision, then cast and gathered (distributed.full_weights): what the
  engine samples from after each refit and what an HF export holds (the engine gets plain weights:
  no LoRA kernels in vLLM, and either engine works).
- adapter_state / save_adapter: the adapters alone, as peft's adapter folder (adapter_config.json,
  adapter_model.safetensors), which peft, transformers and vLLM load on top of the base.

What it does not do: choose the learning rate (LoRA wants a larger one: pass --lr), quantize the
base (QLoRA), or apply to DPO (dpo.py trains every weight).
"""

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor, Replicate

from checks import Checks, UserError

# peft's PeftModel names every parameter of the HF model below this
PEFT_PREFIX = "base_model.model."


@dataclass
class Adapters:
    """LoRA's flags (train.Config's `lora`); on the command line --lora-rank, --lora-alpha,
    --lora-targets."""

    lora_rank: int = 0  # r: LoRA's rank; 0 = full fine-tuning (every weight trains)
    # the adapters' output is scaled by alpha / r (LoRA Without Regret: 32 at every rank)
    lora_alpha: float = 32.0
    # module names to adapt (as peft matches them: q_proj, o_proj, gate_proj, ...), or all-linear:
    # every linear layer but the LM head
    lora_targets: tuple[str, ...] = ("all-linear",)

    @property
    def on(self) -> bool:
        return self.lora_rank > 0


def flag_checks(a: Adapters) -> Checks:
    return [
        (
            a.lora_rank >= 0,
            f"--lora-rank {a.lora_rank}: must be 0 (full fine-tuning) or a positive rank",
        ),
        (
            not a.on or a.lora_alpha != 0,
            f"--lora-alpha {a.lora_alpha}: must not be 0 (the adapters' output is "
            "scaled by alpha / rank: 0 would train nothing)",
        ),
        (
            not a.on or len(a.lora_targets) > 0,
            "--lora-targets: name at least one module, or all-linear",
        ),
    ]


def _peft_config(a: Adapters):
    from peft import LoraConfig

    targets = a.lora_targets[0] if a.lora_targets == ("all-linear",) else list(a.lora_targets)
    return LoraConfig(
        r=a.lora_rank,
        lora_alpha=a.lora_alpha,
        target_modules=targets,
        task_type="CAUSAL_LM",  # peft's defaults: no dropout, no bias trained
    )


def target_checks(a: Adapters, path: str, trust_remote_code: bool = False, name: str = "") -> None:
    """Raises UserError, in one line, when peft cannot put these adapters on the model at `path`
    (named `name` in the message: the flag the user gave, e.g. "--model tiny"): a target module it
    does not have, or a layer type peft cannot wrap. Only the config is read: the model is built
    empty, on the meta device."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    targets, name = " ".join(a.lora_targets), name or path
    head = empty.get_output_embeddings()
    # peft matches a target by a module's name or its last parts; it only fails when none matches at
    # all
    hits = {
        t: [m for n, m in empty.named_modules() if n == t or n.endswith("." + t)]
        for t in a.lora_targets
    }
    linear = ", ".join(
        sorted(
            {
                n.rsplit(".", 1)[-1]
                for n, m in empty.named_modules()
                if isinstance(m, torch.nn.Linear) and m is not head
            }
        )
    )  # what LoRA here can adapt
    for t in a.lora_targets:
        if t != "all-linear" and not hits[t]:
            raise UserError(
                f"--lora-targets {targets}: {name} has no module {t} (its linear layers: {linear})"
            )
    # peft wraps embeddings too, but neither the refit nor the trainer's head would see those
    # adapters: merged knows lora_A / lora_B (an embedding's are lora_embedding_A / _B), and
    # model.py's logprobs read the head's weight directly, past peft's wrapper (its adapters would
    # get no gradient). Refused here, before anything loads.
    for t in a.lora_targets:
        if any(isinstance(m, torch.nn.Embedding) or m is head for m in hits[t]):
            raise UserError(
                f"--lora-targets {targets}: {t} is {name}'s embedding or LM head, which LoRA here "
                "does not adapt (the refit merges linear layers only, and the logprobs read the "
                f"head's own weight); choose among {linear}, or all-linear"
            )
    try:
        get_peft_model(empty, _peft_config(a))
    except ValueError as e:
        msg = str(e)
        if "is not supported" in msg:
            raise UserError(
                f"--lora-targets {targets}: peft cannot put LoRA on {name}'s "
                f"{msg.split('Target module ')[-1].split(' is not supported')[0][:120]} "
                "(it wraps Linear, Embedding, Conv and Conv1D layers)"
            ) from e
        raise UserError(
            f"--lora-rank {a.lora_rank}: peft refused {name}: {msg.splitlines()[0][:200]}"
        ) from e


def wrap(lm: torch.nn.Module, a: Adapters) -> torch.nn.Module:
    """lm with LoRA adapters on a.lora_targets (a peft PeftModel): the base frozen, the adapters
    trainable, in the base's dtype (float64 in the equivalence tests), B zero so that the policy
    starts as the base. A is drawn from torch's generator: the same seed gives the same adapters on
    every rank and at every world size."""
    from peft import get_peft_model

    dtype = next(lm.parameters()).dtype
    return get_peft_model(lm, _peft_config(a), autocast_adapter_dtype=False).to(dtype)


def is_lora(lm: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(lm, PeftModel)


def scale_of(lm: torch.nn.Module) -> float:
    """alpha / r of a peft model's adapters."""
    c = lm.peft_config["default"]
    return c.lora_alpha / c.r


def adapters_off(lm: torch.nn.Module):
    """A context in which lm computes as its frozen base (every adapter switched off); a no-op
    without LoRA."""
    return lm.disable_adapter() if is_lora(lm) else nullcontext()


def merged(
    named: Iterable[tuple[str, torch.Tensor]], scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the model base + adapters is, from (peft name, tensor) pairs in
    named_parameters order: each adapted layer's weight becomes W + scale * B @ A, in the tensors'
    own precision (float32: the trainer's), on FSDP's shards where they are sharded. The caller
    casts and gathers (distributed.full_weights), so a bf16 engine's refit moves bf16 bytes, as the
    full-weight refit does, and gets the merged weight rounded once. peft lists a layer's base_layer
    parameters, then lora_A, then lora_B: only one layer's W is held back at a time.

    On shards: W [out, in] and B [out, r] are split by rows alike (FSDP2 shards dim 0), so each
    rank's rows of the merged weight are its rows of W plus its rows of B times the whole of A
    (gathered: r x in, small).

    Example: model.layers.0.mlp.up_proj.{base_layer.weight, lora_A.default.weight,
    lora_B.default.weight}
             -> model.layers.0.mlp.up_proj.weight = W + scale * B @ A"""
    held: dict[str, torch.Tensor] = {}
    for name, t in named:
        name, t = name.removeprefix(PEFT_PREFIX), t.detach()
        if name.endswith(".base_layer.weight"):
            held[name.removesuffix(".base_layer.weight")] = t
        elif ".lora_A." in name:
            held[name.split(".lora_A.")[0] + ".A"] = _whole(t)
        elif ".lora_B." in name:
            layer = name.split(".lora_B.")[0]
            W, A = held.pop(layer), held.pop(layer + ".A")
            # [out, r] @ [r, in], a rank's rows of it under FSDP
            yield layer + ".weight", W + scale * (t @ A)
        else:
            yield name.replace(".base_layer.", "."), t  # a bias, or a layer without adapters
    if held:
        raise RuntimeError(f"LoRA layers without both adapters: {sorted(held)[:3]}")


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor replicated on every rank (still a DTensor, so that it multiplies other
    shards); a plain tensor as it is."""
    if isinstance(t, DTensor):
        return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)
    return t


def adapter_state(lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' full tensors under their peft names, on the CPU (a collective under FSDP: every
    rank gathers each one, all small)."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
        for n, p in lm.named_parameters()
        if ".lora_" in n
    }


def save_adapter(
    lm: torch.nn.Module, state: dict[str, torch.Tensor], folder: Path, base: str
) -> None:
    """peft's adapter folder from adapter_state: adapter_config.json (rank, alpha, targets, base
    model `base`) and adapter_model.safetensors, which peft's PeftModel.from_pretrained and vLLM's
    LoRARequest load."""
    lm.peft_config["default"].base_model_name_or_path = base
    lm.save_pretrained(folder, state_dict=state)

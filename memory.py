"""Memory per GPU for GRPO training, estimated on paper from a model's config: `python memory.py [--config DIR]`.

What it does: prints a markdown table (the one in docs/distributed.md) of the memory one rank needs at 8K, 16K and 24K
tokens, for FSDP2 over N GPUs: float32 master weights, gradients and AdamW moments (sharded), bfloat16 copies
gathered for compute, activations of one micro-batch with and without activation checkpointing, the chunked
LM-head logits, and vLLM's share (its weights and KV cache for the rollouts). The default config is
DeepSeek-R1-Distill-Qwen-1.5B's (Qwen2 architecture, untied embeddings: 1.78B parameters).

What it does not do: measure. These are estimates; a GPU run records what they meet (docs/distributed.md).
Activation bytes per token per layer (bf16, flash attention so no S^2 term; SwiGLU MLP):
  attention: layer input, norm output, Q, K, V, attention output  -> 2 * (4H + 2 * kv_dim) bytes
  MLP:       norm input and output, gate, up, SiLU(gate), product  -> 2 * (2H + 4I) bytes
With checkpointing only each layer's input (2H bytes) is kept, plus one layer's full activations in recompute.
"""

from dataclasses import dataclass

GiB = 2**30


@dataclass
class Shape:
    hidden: int = 1536
    intermediate: int = 8960
    layers: int = 28
    heads: int = 12
    kv_heads: int = 2
    vocab: int = 151936
    tied: bool = False

    @classmethod
    def from_config(cls, path: str) -> "Shape":
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(path)
        return cls(c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                   c.num_key_value_heads, c.vocab_size, bool(getattr(c, "tie_word_embeddings", False)))

    def params(self) -> tuple[int, int]:
        """(per decoder layer, everything else)"""
        H, I, kv = self.hidden, self.intermediate, self.kv_heads * (self.hidden // self.heads)
        layer = H * (H + 2 * kv) + (H + 2 * kv) + H * H + 3 * H * I + 2 * H  # qkv (+bias), o, mlp, 2 norms
        rest = self.vocab * H * (1 if self.tied else 2) + H
        return layer, rest


def estimate(s: Shape, tokens: int, gpus: int = 8, chunk_tokens: int = 1024, vllm_fraction: float = 0.4,
             gpu_gib: float = 80.0) -> dict[str, float]:
    layer, rest = s.params()
    P = layer * s.layers + rest
    kv_dim = s.kv_heads * (s.hidden // s.heads)
    act_layer = 2 * (4 * s.hidden + 2 * kv_dim) + 2 * (2 * s.hidden + 4 * s.intermediate)  # bytes / token / layer
    return {
        "parameters (B)": P / 1e9,
        "fp32 weights (sharded)": 4 * P / gpus / GiB,
        "fp32 gradients (sharded)": 4 * P / gpus / GiB,
        "AdamW moments (sharded)": 8 * P / gpus / GiB,
        "bf16 gathered (root + 1 layer)": 2 * (rest + layer) / GiB,
        "activations, no checkpointing": act_layer * s.layers * tokens / GiB,
        "activations, checkpointing": (2 * s.hidden * s.layers + act_layer) * tokens / GiB,
        "LM-head chunk (fp32 logits, softmax)": 2 * 4 * chunk_tokens * s.vocab / GiB,
        "vLLM weights (bf16)": 2 * P / GiB,
        "vLLM KV cache, one sequence": 2 * s.layers * kv_dim * 2 * tokens / GiB,
        "vLLM share (gpu_memory_utilization)": vllm_fraction * gpu_gib,
    }


def table(s: Shape, lengths=(8192, 16384, 24576), **kw) -> str:
    rows = {n: estimate(s, n, **kw) for n in lengths}
    keys = list(rows[lengths[0]])
    out = ["| GiB per GPU | " + " | ".join(f"{n // 1024}K tokens" for n in lengths) + " |",
           "|---|" + "---|" * len(lengths)]
    for k in keys:
        out.append(f"| {k} | " + " | ".join(f"{rows[n][k]:.2f}" for n in lengths) + " |")
    static = ("fp32 weights (sharded)", "fp32 gradients (sharded)", "AdamW moments (sharded)",
              "bf16 gathered (root + 1 layer)", "LM-head chunk (fp32 logits, softmax)")
    for act in ("activations, no checkpointing", "activations, checkpointing"):
        tot = [sum(rows[n][k] for k in static) + rows[n][act] for n in lengths]
        name = "training total, " + act.split(", ")[1]
        out.append(f"| **{name}** | " + " | ".join(f"**{t:.1f}**" for t in tot) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    import tyro

    def main(config: str = "", gpus: int = 8, chunk_tokens: int = 1024, vllm_fraction: float = 0.4,
             gpu_gib: float = 80.0):
        """config: a local HF model folder (default: DeepSeek-R1-Distill-Qwen-1.5B's shape)."""
        s = Shape.from_config(config) if config else Shape()
        print(table(s, gpus=gpus, chunk_tokens=chunk_tokens, vllm_fraction=vllm_fraction, gpu_gib=gpu_gib))

    tyro.cli(main)

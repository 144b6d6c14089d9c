"""FLOPs per token of a decoder-only transformer and model FLOPs utilisation (MFU).

Training FLOPs/token = 6·(matmul params active per token, lm_head included) + 6·L·S·(H_q·d_head) for causal attention
(QK^T and AV: 2 matmuls × 2 FLOP × fwd+bwd(3×) × S/2 average context). Recompute under activation checkpointing is
not counted (MFU, not HFU).
"""

from __future__ import annotations


def flops_per_token(config, seq_len: int) -> float:
    config = config.get_text_config()  # a VLM: its decoder's (the vision tower is not counted)
    h, L, v = config.hidden_size, config.num_hidden_layers, config.vocab_size
    n_q, n_kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // n_q
    attn = h * d * (2 * n_q + 2 * n_kv)  # q, o and k, v projections
    # MoE: the top-k experts' MLPs + the router
    mlp = (3 * h * config.moe_intermediate_size * config.num_experts_per_tok + h * config.num_experts
           if getattr(config, "num_experts", 0) else 3 * h * config.intermediate_size)
    return 6.0 * (L * (attn + mlp) + h * v) + 6.0 * L * seq_len * n_q * d


def mfu(tokens: int, seconds: float, flops_per_tok: float, peak_flops_per_device: float, n_devices: int) -> float:
    return tokens * flops_per_tok / seconds / (peak_flops_per_device * n_devices)

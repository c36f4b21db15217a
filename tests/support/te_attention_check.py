"""TransformerEngine's attention under one of Megatron's --attention-backend choices, against causal attention.

    python tests/support/te_attention_check.py fused|flash|unfused|auto

Sets TE's backend switches as Megatron-Core does for that choice (language_module.py), runs
``DotProductAttention`` on packed sequences (THD, ``padding_causal``, grouped-query heads, bf16)
as the RL loop's packed training forward does, and prints one line: the largest difference from a
float32 causal attention computed sequence by sequence (TE's debug log on stderr, switched on here,
names the backend it selected). Exits 1 where the
difference exceeds what bf16 rounding explains. A separate process per choice: TE reads the
switches when it first picks a backend.
"""

import os
import sys

SWITCHES = {  # NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN as Megatron-Core sets them
    "flash": (1, 0, 0),
    "fused": (0, 1, 0),
    "unfused": (0, 0, 1),
    "auto": (1, 1, 1),
}
TOLERANCE = 2e-2  # bf16 inputs and output; a causal-mask error moves outputs by O(1)


def main(backend: str) -> int:
    for name, value in zip(("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"), SWITCHES[backend]):
        os.environ[name] = str(value)
    os.environ.setdefault("NVTE_DEBUG", "1")
    os.environ.setdefault("NVTE_DEBUG_LEVEL", "2")
    import torch
    import transformer_engine.pytorch as te

    heads, groups, dim = 8, 2, 64
    lengths = [300, 17, 190, 1]  # odd lengths, one of a single token
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, heads, dim, device="cuda", generator=gen).bfloat16()
    k = torch.randn(total, groups, dim, device="cuda", generator=gen).bfloat16()
    v = torch.randn(total, groups, dim, device="cuda", generator=gen).bfloat16()
    attention = te.DotProductAttention(heads, dim, num_gqa_groups=groups, attention_dropout=0.0,
                                       qkv_format="thd", attn_mask_type="padding_causal")
    out = attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                    max_seqlen_kv=max(lengths)).float().view(total, heads, dim)
    worst = 0.0
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs = q[start:end].float().transpose(0, 1)
        ks = k[start:end].float().repeat_interleave(heads // groups, dim=1).transpose(0, 1)
        vs = v[start:end].float().repeat_interleave(heads // groups, dim=1).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
        worst = max(worst, (out[start:end] - ref).abs().max().item())
    print(f"--attention-backend {backend}: max |TE - causal reference| = {worst:.3e}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

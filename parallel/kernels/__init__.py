"""Kernel choice, by device and dtype, in one place: models and parallel layers call these
modules and hold no `device.type` branch of their own (docs/kernels.md).

    attention.py        single-device attention: causal / ALiBi / sliding window / packed
                        documents / queries offset into the keys (KV cache)
    cpu_attention.py    the CPU bf16/fp16 SDPA pass-precision split (measured crossovers)
    attention_block.py  one ring-attention block with its log-sum-exp, forward and backward
    grouped_matmul.py   the MoE experts' grouped matmul
    lm_head_loss.py     tokens per chunk of the fused LM head + cross-entropy
    host_memory.py      large short-lived CPU buffers on transparent huge pages
    choice_log.py       each fallback logged once per process
"""

"""GPU MFU check: LoRA fine-tuning throughput of a Llama-1B-shaped model in bf16, as JSON.

``python -m bench.gpu_mfu [--batch 8] [--seq 2048] [--steps 10]`` on a machine with a CUDA GPU.
Self-contained: the model is built from a config with random weights (no download), the batch is
random token ids; FLOPs are counted by the training telemetry's own functions. Prints one JSON object (and writes it to ``--output`` if given); exits with
status 2 and a one-line message where no CUDA device is visible.

MFU = achieved model FLOP/s ÷ peak dense bf16 FLOP/s of the device (989 TFLOP/s for H100/H200
SXM unless ``--peak-tflops`` says otherwise). Model FLOPs per token follow the training
telemetry's convention (training_core/train/telemetry.py), with N counted as matmul weights only:

    4·N            forward (2N) + activation gradients (2N) through every linear layer
  + 2·N_trainable  weight gradients, only for the LoRA matrices (the base is frozen)
  + 12·L·d·T       attention scores and weighted sum, forward + backward (PaLM appendix B),
                   d = heads × head_dim

N is the sum of all ``nn.Linear`` weights (LoRA A/B and lm_head included, the embedding lookup
excluded: it is a gather, not a matmul). Recomputation (activation checkpointing) is work the
hardware does but not model FLOPs, so enabling it lowers MFU by design.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Llama 3.2 1B shape (hidden 2048, 16 layers, GQA 32/8 heads, 128k vocab, tied embeddings).
LLAMA_1B = dict(
    vocab_size=128_256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500_000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)
DEFAULT_PEAK_TFLOPS = 989.0  # dense bf16, H100 SXM / H200 (no sparsity)


def pick_attention(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        import flash_attn  # noqa: F401

        return "flash_attention_2"
    except ImportError:
        return "sdpa"


def build_model(attention: str, lora_r: int, gradient_checkpointing: bool):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**LLAMA_1B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attention)
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16, attn_implementation=attention)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lora = LoraConfig(task_type="CAUSAL_LM", r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0,
                      target_modules="all-linear")
    model = get_peft_model(model, lora)
    model.to(device="cuda", dtype=torch.bfloat16)  # LoRA matrices are created in fp32
    return model, config


def measure(args: argparse.Namespace) -> dict:
    import torch

    attention = pick_attention(args.attention)
    model, config = build_model(attention, args.lora_r, args.gradient_checkpointing)
    model.train()
    from training_core.train.model_setup import attention_shape, count_matmul_weights
    from training_core.train.telemetry import model_flops_per_token

    frozen_linear, trainable_linear = count_matmul_weights(model)
    linear = frozen_linear + trainable_linear
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    batch = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda", generator=generator)

    def step() -> torch.Tensor:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    tokens_per_s = args.batch * args.seq * args.steps / elapsed
    flops_per_token = model_flops_per_token(frozen_linear, trainable_linear, *attention_shape(config), args.seq)
    achieved = tokens_per_s * flops_per_token
    peak = args.peak_tflops * 1e12
    return {
        "device": torch.cuda.get_device_name(0),
        "model": "llama-1b-shaped (random init)",
        "parameters": total,
        "linear_parameters": linear,
        "trainable_parameters": trainable,
        "lora_r": args.lora_r,
        "dtype": "bf16",
        "attention": attention,
        "gradient_checkpointing": args.gradient_checkpointing,
        "batch": args.batch,
        "seq_len": args.seq,
        "warmup_steps": args.warmup,
        "measured_steps": args.steps,
        "s_per_step": elapsed / args.steps,
        "tokens_per_s": tokens_per_s,
        "model_flops_per_token": flops_per_token,
        "achieved_tflops": achieved / 1e12,
        "peak_tflops": args.peak_tflops,
        "mfu": achieved / peak,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "final_loss": float(loss.detach()),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocator, kernel selection)")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--attention", default="auto", choices=["auto", "sdpa", "flash_attention_2", "eager"],
                        help="auto: flash_attention_2 when flash-attn is installed, else sdpa")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS,
                        help="dense bf16 peak of the device (H100/H200 SXM: 989, A100: 312)")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench.gpu_mfu: no CUDA device visible (torch %s); this check runs only on a GPU machine"
              % torch.__version__, file=sys.stderr)
        return 2
    result = measure(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

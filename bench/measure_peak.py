"""Measure the peak memory of one real LoRA training step (transformers + peft, CPU, fp32).

Run as a subprocess by bench/scheduler_estimator_cpu.py; prints one JSON line:
``{"baseline": RSS after imports, "peak": max RSS after the step, "delta": peak - baseline}``.
The model is a random Llama built from the given shape; the step is forward + backward
+ AdamW on the LoRA parameters -- what the torch trainer does per micro batch.
"""

import json
import resource
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM


def peak_rss() -> int:
    """This process image's RSS high-water mark (VmHWM). Not ``ru_maxrss``: Linux carries
    that over ``execve`` from the forked parent, so a child of a big pytest process would
    report the parent's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    # warm up the allocator and autograd machinery on a throwaway op, so the baseline
    # includes every import and lazy initialisation, not the model.
    x = torch.randn(8, 8, requires_grad=True)
    (x @ x).sum().backward()
    baseline = rss()
    model_cfg = LlamaConfig(hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
                            num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                            intermediate_size=cfg["intermediate"], vocab_size=cfg["vocab"],
                            attn_implementation="sdpa")
    model = LlamaForCausalLM(model_cfg)
    model = get_peft_model(model, LoraConfig(r=cfg["r"], target_modules=cfg["targets"]))
    model.train()
    if cfg["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
    for _ in range(2):  # the second step has the optimizer state allocated
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = peak_rss()
    print(json.dumps({"baseline": baseline, "peak": peak, "delta": peak - baseline}))


if __name__ == "__main__":
    main()

"""PEFT LoRA checkpoints of the tiny models for tests: random A and B, B non-zero (PEFT
initialises B to zeros, which would hide every mistake)."""

from __future__ import annotations

import torch


def make_peft_adapter(base_path: str, directory, rank: int, alpha: float, targets, use_rslora: bool = False,
                      seed: int = 0) -> str:
    """A PEFT LoRA checkpoint of ``base_path`` with random A and B (B non-zero), saved by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                            use_rslora=use_rslora))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.4)
    model.save_pretrained(str(directory))
    return str(directory)


def adapter_sets(model_path, root_of, specs_of, first_seed: int = 1):
    """``get(arch) -> {name: LoRARequest}``, each arch's set built once: ``specs_of(arch)`` maps
    names to (rank, alpha, targets, use_rslora), ``model_path(arch)`` is its checkpoint,
    ``root_of(arch)`` a fresh directory; adapter i has id i + 1 and seed ``first_seed + i``."""
    from pagedserve import LoRARequest

    built: dict[str, dict] = {}

    def get(arch: str) -> dict:
        if arch not in built:
            root = root_of(arch)
            built[arch] = {
                name: LoRARequest(name, i + 1, make_peft_adapter(model_path(arch), root / name, rank, alpha, targets,
                                                                 rslora, seed=first_seed + i))
                for i, (name, (rank, alpha, targets, rslora)) in enumerate(specs_of(arch).items())}
        return built[arch]

    return get

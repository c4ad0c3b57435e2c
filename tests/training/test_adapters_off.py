"""`adapters_off`: the LoRA base forward, without touching requires_grad (FSDP2 loses grads otherwise)."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from miles.training.model import adapters_off


def test_adapters_off_runs_the_base_and_keeps_requires_grad() -> None:
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 4))
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = base(x).clone()
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=2, target_modules=["0"], init_lora_weights="gaussian"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():  # peft starts B at zero; give the adapter an effect
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        adapted = model(x)
        with adapters_off(model):
            off = model(x)
            assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    assert torch.allclose(off, expected) and not torch.allclose(adapted, expected)
    model(x).sum().backward()  # the adapter is back on and trains
    assert all(p.grad is not None for n, p in model.named_parameters() if n in trainable)

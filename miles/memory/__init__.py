"""Memory before launch: every model at its real size without its weights, and the exact static bytes per GPU.

- `config_dirs`: the component configs of a checkpoint (a family's shipped `real_config/<name>`, or a local
  checkpoint directory), and their content hash.
- `counts`: the torch-free record of a model's tensors (shapes, dtypes as the loaders set them, LoRA adapters,
  FSDP2 groups) and its byte arithmetic.
- `meta_build` / `load_dtypes` / `measure` (torch): build each component with the family's own classes on
  `torch.device("meta")`, give every tensor the dtype `from_pretrained` would, inject LoRA with the trainer's
  `apply_lora`, and summarise it into counts.
- `cache`: counts from the shipped `counts.json`, else `$MILES_HOME/memory/<hash>.json`, else measured once.
- `static`: per trainer role, engine and GPU of a plan, and per phase (train / sync / rollout), the bytes of the
  parameters, gradients, AdamW state, EMA, DMD2's teacher, the engine's pipeline and the weight-sync buffers.

`config_dirs`, `counts`, `cache` (on a hit) and `static` import no torch, so `miles plan` stays instant.
"""

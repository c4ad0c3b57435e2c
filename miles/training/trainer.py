"""The trainer: one rank of a trainer group. It never knows its role: a role is only its args.

It loads the family's DiT from `--hf-checkpoint`, adds LoRA when asked, shards it with FSDP2 (gloo
on CPU, nccl on GPU), and trains it with the method `--loss-type` names: the method table's
`impl` (`miles.methods`), a `miles.training.methods.base.TrainMethod` built once here, which gives
the pairs and the loss; the trainer keeps the velocity, the reference, the optimizer step, weights
out, checkpoints and offload.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from miles.core.errors import ConfigError
from miles.core.sample import Sample
from miles.training.methods import build_method
from miles.training.model import (
    DTYPES,
    adapters_off,
    apply_lora,
    family_of,
    frozen_copy,
    full_state_dict,
    load_transformer,
    merged_base_state_dict,
    parallelize_attention,
    shard,
)
from miles.training.pairs import Pair, dp_shard, micro_batches, stack_conditions
from miles.training.parallel import build_layout, process_group_backend, timeout_of
from miles.training.step_metrics import all_reduce_mean, is_max


def init_distributed(args: Any, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Join the trainer group's process group, on the backend this rank can really use
    (`miles.training.parallel.process_group_backend`) and with `--distributed-timeout-minutes`."""
    if dist.is_initialized():
        return
    backend = process_group_backend(args, torch.cuda.is_available())
    os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout_of(args))


class Trainer:
    def __init__(
        self,
        args: Any,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        total_steps: int = 1,
    ) -> None:
        from miles.training.optim import build_lr_scheduler, build_optimizer

        if args.deterministic_mode:
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.args, self.rank, self.world_size = args, rank, world_size
        init_distributed(args, rank, world_size, master_addr, master_port)
        # HSDP mesh and sequence-parallel group; the data is split over the dp ranks (an SP group shares it)
        self.layout = build_layout(args, rank, world_size)
        self.dp_rank, self.dp_size = self.layout.dp_rank, self.layout.dp_size
        torch.manual_seed(args.seed)
        self.family = family_of(args)
        self.family.check_uncond_grad(args.diffusion_cfg_uncond_grad)  # a user family's own guided forward
        model = load_transformer(args, self.family)
        if args.use_lora:
            model = apply_lora(model, args, self.family)
        frozen = frozen_copy(model) if args.ref_mode == "frozen" else None
        parallelize_attention(model, args, self.family, self.layout.sp_group)
        self.model = shard(model, args, self.layout.mesh, self.family.fsdp_block_lists)
        self.frozen_reference: torch.nn.Module | None = None  # --ref-mode frozen: the start weights, no grad
        if frozen is not None:
            parallelize_attention(frozen, args, self.family, self.layout.sp_group)
            self.frozen_reference = shard(frozen, args, self.layout.mesh, self.family.fsdp_block_lists)
        self._forward_model: torch.nn.Module | None = None  # the module `dit_velocity` runs when not the model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, args)
        self.scheduler = build_lr_scheduler(self.optimizer, args, total_steps)
        self.ema = None
        if args.use_ema:
            from miles.training.ema import EmaShadow

            self.ema = EmaShadow.from_args(self._trainable_named(), args, module=self.model)
        self.forward_dtype = DTYPES[args.diffusion_forward_dtype]
        self.scaler = None
        if args.diffusion_forward_dtype == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler()
        self.global_step = 0
        self.generator = torch.Generator().manual_seed(args.seed + 7919 * self.dp_rank)  # same noise in an SP group
        self.method = build_method(self)  # --loss-type's TrainMethod (miles.training.methods)
        self._offloader: Any = None  # --offload-train (miles.utils.offload), made on first use
        self._in_place_sync: Any = None  # --colocate weight sync (miles.training.in_place_sync)

    # ---- helpers ---------------------------------------------------------------------------
    def _trainable_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def velocity(
        self, x: torch.Tensor, timesteps: torch.Tensor, samples: Sequence[Sample], cfg_scale: float | None
    ) -> torch.Tensor:
        """The family's DiT velocity, with classifier-free guidance when `cfg_scale > 1`."""
        cfg = cfg_scale is not None and cfg_scale > 1.0
        neg = stack_conditions(samples, negative=True, family=self.family) if cfg else None
        pos = stack_conditions(samples, negative=False, family=self.family)
        first = samples[0].conditions if samples else None
        scale_2 = first.guidance_scale_2 if cfg and first is not None else None
        return self.dit_velocity(x, timesteps, pos, neg, cfg_scale, scale_2)

    def dit_velocity(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        pos: dict[str, torch.Tensor],
        neg: dict[str, torch.Tensor] | None,
        cfg_scale: float | None,
        cfg_scale_2: float | None = None,
    ) -> torch.Tensor:
        """`velocity` on batched condition tensors (`neg` is needed when `cfg_scale > 1`): the family's
        guided forward, the same computation the engine ran (`cfg_scale_2`: a second expert's scale), with its
        unconditional branch's gradient as `--diffusion-cfg-uncond-grad` says (under grad only)."""
        model = self.model if self._forward_model is None else self._forward_model
        x = x.to(self.forward_dtype)
        uncond_grad = self.args.diffusion_cfg_uncond_grad
        extra = {} if uncond_grad == "full" else {"uncond_grad": uncond_grad}  # full: the call of before the flag
        return self.family.guided_velocity(model, x, timesteps, pos, neg, cfg_scale, cfg_scale_2, **extra)

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Run the reference model: the LoRA base (adapter off), the frozen copy of the start weights or the EMA
        weights."""
        mode = self.args.ref_mode
        if mode == "lora_base":
            with adapters_off(self.model):
                yield
        elif mode == "frozen":
            if self.frozen_reference is None:
                raise RuntimeError("--ref-mode frozen: this trainer was built without its frozen copy")
            self._forward_model = self.frozen_reference
            try:
                yield
            finally:
                self._forward_model = None
        elif mode == "ema":
            if self.ema is None:
                raise RuntimeError("--ref-mode ema needs --use-ema")
            with self.ema.swapped_in(self._trainable_named(), module=self.model):
                yield
        else:
            raise RuntimeError(f"no reference model under --ref-mode {mode}")

    # ---- training: the method's entry points ---------------------------------------------------
    def train(self, rollout_id: int, samples: list[Sample], *extra: Any) -> Any:
        """One rollout's training by the method (`extra`: what a method takes besides the samples, e.g. DMD2's
        critic scores); a rollout method returns the mean metrics (names without the train/ prefix)."""
        return self.method.train(rollout_id, samples, *extra)

    def train_sft(self, x0: torch.Tensor, conditions: list[Sample]) -> dict[str, float]:
        """One optimizer step on clean dataset latents `x0` with their samples' conditions."""
        return self.method.train_sft(x0, conditions)

    def step(self, pairs: list[Pair], micro_fn) -> dict[str, float]:
        """Gradient accumulation of `micro_fn(batch) -> (loss, metrics)` over this rank's share of one window's
        pairs, then one optimizer step (clipping, the schedule, EMA); the metrics averaged over the ranks."""
        from miles.training.optim import clip_grad_norm

        mine = dp_shard(pairs, self.dp_rank, self.dp_size, self.args.train_dp_split_mode)
        batches = micro_batches(mine, self.args)
        n_pairs = max(1, len(mine))
        sums: dict[str, float] = {}
        skip = self.args.debug_skip_optimizer_step
        for batch in batches:
            weight = len(batch) / n_pairs
            with torch.no_grad() if skip else contextlib.nullcontext():
                loss, metrics = micro_fn(batch)
            if not skip:
                scaled = loss * weight
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            for k, v in metrics.items():
                sums[k] = max(sums.get(k, 0.0), v) if is_max(k) else sums.get(k, 0.0) + v * weight
        if not skip:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            sums["grad_norm"] = float(clip_grad_norm(self.params, self.args.clip_grad))
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.global_step += 1
            if self.ema is not None:
                self.ema.update(self._trainable_named(), module=self.model)
        sums["lr"] = float(self.scheduler.get_lr())
        return all_reduce_mean(sums, self.world_size)

    # ---- weights out -----------------------------------------------------------------------
    def _served(self) -> contextlib.AbstractContextManager[Any]:
        """The EMA weights swapped in under --ema-rollout-policy ema; else nothing to do."""
        if self.ema is not None and self.args.ema_rollout_policy == "ema":
            return self.ema.swapped_in(self._trainable_named(), module=self.model)
        return contextlib.nullcontext()

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """The weights the engines should serve (LoRA merged; EMA under --ema-rollout-policy ema)."""
        with self._served():
            state = full_state_dict(self.model)
        return merged_base_state_dict(state, self.args) if self.args.use_lora else state

    def weights_for_sync(self) -> dict[str, torch.Tensor]:
        """What one sync pushes to the engines: `engine_weights()`, or under --lora-ipc-weight-sync (and for
        LoRA on sglang engines, which take the adapter through `/v1/set_lora`) only the LoRA tensors
        (`miles.models.lora_sync`: the engines merge them into their base weights)."""
        from miles.models.lora_sync import lora_only_sync, lora_sync_payload

        if not lora_only_sync(self.args):
            return self.engine_weights()

        with self._served():
            return lora_sync_payload(self.model)

    def sync_in_place(self, engines: list[Any], version: int) -> dict[str, float]:
        """--colocate: join the gather of `weights_for_sync()`; a rank that feeds an engine (rank i * g feeds
        engine i) passes it the weights by handle (`miles.training.in_place_sync`). Returns what this rank
        pushed (tensors, bytes by handle, seconds), empty for the other ranks."""
        from miles.training.in_place_sync import InPlaceSync

        state = self.weights_for_sync()
        if self._in_place_sync is None:
            self._in_place_sync = InPlaceSync(self.args, self.rank)
        return self._in_place_sync(state, engines, version)

    # ---- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, step: int, extra: dict[str, Any]) -> str | None:
        """Model (trainable weights, or all of them for a full fine-tune), optimizer, LR schedule, EMA,
        RNG and `extra` (rollout id, data-source state), gathered to full tensors; rank 0 writes."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from miles.training.checkpoint import rng_state, save_checkpoint

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.model, options=options)
        if self.args.use_lora:
            model_state = {k: v for k, v in model_state.items() if "lora_" in k}
        parts: dict[str, Any] = {"model.pt": model_state, "lr_scheduler.pt": self.scheduler.state_dict()}
        if not self.args.no_save_optim:
            parts["optimizer.pt"] = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        if self.ema is not None:
            parts["ema.pt"] = self.ema.state_dict()
        parts["rng.pt"] = {"global": rng_state(), "generator": self.generator.get_state()}
        if self.rank != 0:
            return None
        json_parts = {"extra.json": {**extra, "global_step": self.global_step}}
        return str(save_checkpoint(save_dir, step, parts, json_parts))

    def load_checkpoint(self, load_dir: str, ckpt_step: int | None) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote (minus --no-load-optim / --no-load-rng); returns `extra`."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from miles.training.checkpoint import load_checkpoint, set_rng_state

        _, parts = load_checkpoint(load_dir, ckpt_step)
        options = StateDictOptions(full_state_dict=True, strict=not self.args.use_lora)
        set_model_state_dict(self.model, parts["model.pt"], options=options)
        if not self.args.no_load_optim:
            if "optimizer.pt" not in parts:
                raise ConfigError(f"--load {load_dir}: the checkpoint has no optimizer state; add --no-load-optim")
            set_optimizer_state_dict(self.model, self.optimizer, parts["optimizer.pt"], options=options)
        self.scheduler.load_state_dict(parts["lr_scheduler.pt"])
        if self.ema is not None and "ema.pt" in parts:
            self.ema.load_state_dict(parts["ema.pt"])
        if not self.args.no_load_rng and "rng.pt" in parts:
            set_rng_state(parts["rng.pt"]["global"])
            self.generator.set_state(parts["rng.pt"]["generator"])
        extra = dict(parts.get("extra.json") or {})
        self.global_step = int(extra.get("global_step", self.global_step))
        return extra

    def export_lora(self, out_dir: str) -> str | None:
        """Rank 0 writes the LoRA adapter in diffusers format (all ranks gather): the weights the engines serve
        (EMA under --ema-rollout-policy ema), so the adapter on its base is the exported pipeline."""
        from miles.training.export import export_lora

        with self._served():
            state = full_state_dict(self.model)
        if self.rank != 0:
            return None
        return str(export_lora(self.args, self.family, state, out_dir))

    def export_pipeline(self, out_dir: str) -> str | None:
        """Rank 0 writes a complete pipeline directory with the trained transformer (all ranks gather)."""
        from miles.training.export import export_pipeline

        state = self.engine_weights()
        if self.rank != 0:
            return None
        return str(export_pipeline(self.args, self.family, state, out_dir))

    # ---- offload between phases (--offload-train) -----------------------------------------------
    def offload(self, parts: Sequence[str] = ("optimizer", "grads", "params")) -> dict[str, float]:
        """Move `parts` off the device until `onload()` (`miles.utils.offload`: the same storages come back bit for
        bit; a storage already off stays off, so the parts may go in several calls):
            optimizer  the optimizer state
            grads      the gradients
            frozen     what a LoRA-only sync (`miles.models.lora_sync.lora_only_sync`) does not read: the frozen
                       parameters (the LoRA base), the buffers, the frozen reference and the EMA shadow unless the
                       sync serves it; nothing for a trainer whose sync reads the whole model
            params     the parameters with the buffers, the EMA shadow and the frozen reference"""
        from miles.utils.offload import Offloader, module_tensors, optimizer_tensors

        if self._offloader is None:
            local = next(iter(self.model.parameters()))
            self._offloader = Offloader(getattr(local, "_local_tensor", local).device)
        tensors: list[torch.Tensor] = []
        if "optimizer" in parts:
            tensors += optimizer_tensors(self.optimizer)
        if "grads" in parts:
            tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        if "frozen" in parts:
            tensors += self._unread_by_sync()
        if "params" in parts:
            tensors += module_tensors([self.model])
            if self.frozen_reference is not None:
                tensors += module_tensors([self.frozen_reference])
            if self.ema is not None:
                tensors += list(self.ema.shadow.values())
        return self._offloader.offload(tensors).as_metrics()

    def _unread_by_sync(self) -> list[torch.Tensor]:
        """The tensors of the model a weight sync does not read: under a LoRA-only sync everything but the trainable
        (adapter) parameters and, when it is served (`_served`), the EMA shadow; under a full sync none."""
        from miles.models.lora_sync import lora_only_sync
        from miles.utils.offload import module_tensors

        if not lora_only_sync(self.args):
            return []
        tensors = [p for p in self.model.parameters() if not p.requires_grad]
        tensors += list(self.model.buffers())
        if self.frozen_reference is not None:
            tensors += module_tensors([self.frozen_reference])
        if self.ema is not None and self.args.ema_rollout_policy != "ema":  # else `_served` swaps it in
            tensors += list(self.ema.shadow.values())
        return tensors

    def onload(self) -> dict[str, float]:
        """Bring back everything `offload` moved."""
        if self._offloader is None:
            return {"bytes": 0.0, "seconds": 0.0}
        return self._offloader.onload().as_metrics()

"""The trainer: one rank of a trainer group. It never knows its role: a role is only its args.

It loads the family's DiT from `--hf-checkpoint`, adds LoRA when asked, shards it with FSDP2 (gloo
on CPU, nccl on GPU), and trains it with the loss `--loss-type` names, recomputing Flow-GRPO
log-probs with the same `sde_step` the engine used.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from miles.algorithms.nft import nft_corrupt, nft_loss, nft_timesteps
from miles.algorithms.policy_loss import policy_loss
from miles.algorithms.sft_loss import noisy_latents, sample_sigmas, sft_loss
from miles.config.errors import ConfigError
from miles.methods import method
from miles.rollout.sde_backends import backend_step
from miles.rollout.types import Sample
from miles.training.custom_hooks import TrainHooks
from miles.training.model import (
    DTYPES,
    adapters_off,
    apply_lora,
    family_of,
    full_state_dict,
    load_transformer,
    merged_base_state_dict,
    parallelize_attention,
    shard,
    target_components,
)
from miles.training.pairs import Pair, dp_shard, expand_flow_grpo, flow_grpo_batch, micro_batches, stack_conditions
from miles.training.parallel import build_layout, process_group_backend, timeout_of
from miles.training.step_metrics import all_reduce_mean, is_max, model_output_diffs


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
        model = load_transformer(args, self.family)
        if args.use_lora:
            model = apply_lora(model, args, self.family)
        parallelize_attention(model, args, self.family, self.layout.sp_group)
        self.model = shard(model, args, self.layout.mesh, self.family.fsdp_block_lists)
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
        self.hooks = TrainHooks(args)
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
        guided forward, the same computation the engine ran (`cfg_scale_2`: a second expert's scale)."""
        return self.family.guided_velocity(
            self.model, x.to(self.forward_dtype), timesteps, pos, neg, cfg_scale, cfg_scale_2
        )

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Run the reference model: the LoRA base (adapter off) or the EMA weights."""
        mode = self.args.ref_mode
        if mode == "lora_base":
            with adapters_off(self.model):
                yield
        elif mode == "ema":
            if self.ema is None:
                raise RuntimeError("--ref-mode ema needs --use-ema")
            with self.ema.swapped_in(self._trainable_named(), module=self.model):
                yield
        else:
            raise RuntimeError(f"no reference model under --ref-mode {mode}")

    # ---- training --------------------------------------------------------------------------
    def train(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        """One rollout's optimizer steps; returns the mean metrics (names without the train/ prefix)."""
        start = time.perf_counter()
        if torch.cuda.is_available():  # the memory plan's check on a GPU (bench/gpu_acceptance.sh)
            torch.cuda.reset_peak_memory_stats()
        loss_type = self.args.loss_type
        step = method(loss_type).step  # the method table (miles.methods)
        if step is None:
            raise NotImplementedError(f"--loss-type {loss_type} is not trained on rollouts")
        micro = {"flow_grpo": self._flow_grpo_micro, "nft": self._nft_micro, "custom": self._custom_micro}
        totals: dict[str, list[float]] = {}
        first_diff = None
        for pairs in self.hooks.train_data(samples, self._expand):
            metrics = self._step(pairs, micro[step])
            if first_diff is None:
                first_diff = metrics.get("log_prob_mean_abs_diff")
            for k, v in metrics.items():
                totals.setdefault(k, []).append(v)
        out = {k: max(v) if is_max(k) else sum(v) / len(v) for k, v in totals.items()}
        if first_diff is not None:
            # the engine-trainer difference alone: measured before this rollout's first update, whereas
            # log_prob_mean_abs_diff averages all optimizer steps and so includes the policy's own drift
            out["log_prob_abs_diff_first_step"] = first_diff
        out["train_time"] = time.perf_counter() - start
        if torch.cuda.is_available():
            out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return out

    def _step(self, pairs: list[Pair], micro_fn) -> dict[str, float]:
        """Gradient accumulation over this rank's share of one window, then one optimizer step."""
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

    def _expand(self, window: list[Sample]) -> list[Pair]:
        """The built-in expansion of one window: NFT's trained sigmas, else every recorded SDE transition."""
        return self._expand_nft(window) if method(self.args.loss_type).pairs == "nft" else expand_flow_grpo(window)

    def _custom_micro(self, batch: list[Pair]) -> tuple[torch.Tensor, dict[str, float]]:
        return self.hooks.custom_micro(self, batch)

    def _flow_grpo_micro(self, batch: list[Pair]) -> tuple[torch.Tensor, dict[str, float]]:
        samples = [p.sample for p in batch]
        b = flow_grpo_batch(batch)
        x, x_next, ts, old, adv = b["latents"], b["next_latents"], b["timesteps"], b["old_log_probs"], b["advantages"]
        sig, sig_next, sig_max = b["sigmas"], b["next_sigmas"], b["sigma_max"]
        cfg, sde_type, noise = b["guidance_scale"], b["sde_type"], b["noise_level"]
        sde_mask = self.family.sde_mask(tuple(x.shape[1:]))  # the engine's (e.g. LTX-2's audio by ODE)
        step_extra = {} if sde_mask is None else {"mask": sde_mask}

        def step_of(v: torch.Tensor):
            return backend_step(  # the engine's kernel: --sde-step-backend-path, --diffusion-log-prob-no-const
                self.args,
                v,
                x,
                sig,
                sig_next,
                sde_type=sde_type,
                noise_level=noise,
                sigma_max=sig_max,
                prev_sample=x_next,
                **step_extra,
            )

        def scored(mean: torch.Tensor) -> torch.Tensor:  # the KL over the stochastic elements only
            return mean if sde_mask is None else mean.flatten(1)[:, sde_mask.to(mean.device).flatten()]

        # The reference forward runs first: swapping weights (EMA) must not happen under a live graph.
        mean_ref = None
        kl_beta = self.args.diffusion_kl_beta
        if kl_beta > 0:
            with torch.no_grad(), self.reference():
                mean_ref = scored(step_of(self.velocity(x, ts, samples, cfg)).mean)
        v = self.velocity(x, ts, samples, cfg)
        res = step_of(v)
        if self.args.diffusion_recompute_old_log_prob:
            old = res.log_prob.detach()
        loss, metrics = policy_loss(
            res.log_prob,
            old,
            adv,
            clip_range=self.args.diffusion_clip_range,
            adv_clip_max=self.args.diffusion_adv_clip_max,
            kl_beta=kl_beta,
            mean_new=scored(res.mean),
            mean_ref=mean_ref,
            std_dev_t=res.std_dev_t,
        )
        metrics.update(model_output_diffs(v, batch))
        return loss, metrics

    def _expand_nft(self, samples: list[Sample]) -> list[Pair]:
        pairs = []
        sigma_range = self.family.trainable_sigma_range(target_components(self.args))
        for sample in samples:
            if sample.remove_sample or sample.trajectory is None:
                continue
            sigmas = nft_timesteps(
                sample.trajectory.sigmas,
                self.args.diffusion_nft_timestep_fraction,
                shuffle=not self.args.no_diffusion_nft_shuffle_timesteps,
                generator=self.generator,
            )
            kept = [(i, float(s)) for i, s in enumerate(sigmas.reshape(-1).tolist())]
            if sigma_range is not None:  # only some experts train: the noise levels they denoise
                kept = [(i, s) for i, s in kept if sigma_range[0] <= s < sigma_range[1] or s == sigma_range[1] == 1.0]
            pairs.extend(Pair(sample, i, -1, s) for i, s in kept)
        return pairs

    def _nft_micro(self, batch: list[Pair]) -> tuple[torch.Tensor, dict[str, float]]:
        samples = [p.sample for p in batch]
        x0 = torch.stack([s.trajectory.latents[-1] for s in samples]).float()  # type: ignore[union-attr]
        t = torch.tensor([p.sigma for p in batch], dtype=torch.float32)
        noise = torch.randn(x0.shape, generator=self.generator)
        x_t = nft_corrupt(x0, t, noise)
        timesteps = t * 1000.0
        with torch.no_grad(), self.reference():  # before the trained forward: see _flow_grpo_micro
            v_old = self.velocity(x_t, timesteps, samples, None)
        kl_beta = self.args.diffusion_kl_beta
        v_ref = None
        if kl_beta > 0:  # DiffusionNFT's KL reference: the LoRA base (adapters off; the config rules need --use-lora)
            with torch.no_grad(), adapters_off(self.model):
                v_ref = self.velocity(x_t, timesteps, samples, None)
        v_new = self.velocity(x_t, timesteps, samples, None)
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        return nft_loss(
            x0,
            x_t,
            t,
            v_new,
            v_old,
            adv,
            beta=self.args.diffusion_nft_beta,
            adv_clip_max=self.args.diffusion_adv_clip_max,
            adaptive_weight=not self.args.no_diffusion_nft_adaptive_weight,
            v_ref=v_ref,
            kl_beta=kl_beta,
        )

    def train_sft(self, x0: torch.Tensor, conditions: list[Sample]) -> dict[str, float]:
        """One optimizer step of flow matching on clean latents `x0` with their samples' conditions."""
        start = time.perf_counter()
        pairs = [Pair(s, 0, i) for i, s in enumerate(conditions)]
        sigma_range = self.family.trainable_sigma_range(target_components(self.args))
        data_mask = self.family.data_mask(tuple(x0.shape[1:]))

        def micro(batch: list[Pair]) -> tuple[torch.Tensor, dict[str, float]]:
            idx = [p.slot for p in batch]
            clean = x0[idx].float()
            sigma = sample_sigmas(len(batch), self.generator, shift=self.args.fsdp_flow_shift)
            if sigma_range is not None:  # only some experts train: their noise levels only
                sigma = sigma_range[0] + (sigma_range[1] - sigma_range[0]) * sigma
            noise = torch.randn(clean.shape, generator=self.generator)
            x_t = noisy_latents(clean, noise, sigma)
            if self.hooks.loss is not None:  # --loss-type custom_loss
                inputs = {"latents": x_t, "timesteps": sigma * 1000.0, "sigmas": sigma, "clean_latents": clean}
                inputs |= {"noise": noise, "guidance_scale": None, "data_mask": data_mask}
                return self.hooks.custom_micro(self, batch, inputs)
            v = self.velocity(x_t, sigma * 1000.0, [p.sample for p in batch], None)
            # data_mask: only these elements carry data (e.g. LTX-2's video, not its audio)
            return sft_loss(v, clean, noise, sigma, mask=data_mask)

        metrics = self._step(pairs, micro)
        metrics["train_time"] = time.perf_counter() - start
        return metrics

    # ---- DMD2 (miles.training.dmd2_trainer): the critic group's iteration and the student's step ----
    def train_dmd2_critic(
        self, rollout_id: int, samples: list[Sample], with_external: bool
    ) -> tuple[dict[str, float], dict[int, dict[str, torch.Tensor]] | None]:
        """The critic group (--loss-type dmd2_critic): external data first when asked, then one critic step."""
        from miles.training.dmd2_trainer import critic_iteration

        return critic_iteration(self, rollout_id, samples, with_external)

    def train_dmd2(
        self, rollout_id: int, samples: list[Sample], external_data: dict[int, dict[str, torch.Tensor]]
    ) -> dict[str, float]:
        """The student (--loss-type dmd2): one step against the critic group's `external_data`."""
        from miles.training.dmd2_trainer import generator_step

        return generator_step(self, rollout_id, samples, external_data)

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
        lora_only = self.args.lora_ipc_weight_sync or getattr(self.args, "rollout_backend", None) == "sglang"
        if not (self.args.use_lora and lora_only):
            return self.engine_weights()
        from miles.models.lora_sync import lora_sync_payload

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
        """Rank 0 writes the LoRA adapter in diffusers format (all ranks gather)."""
        from miles.training.export import export_lora

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
        """Move `parts` (optimizer state, gradients, parameters with the EMA shadow) off the device until
        `onload()` (`miles.utils.offload`: the same storages come back bit for bit)."""
        from miles.utils.offload import Offloader, module_tensors, optimizer_tensors

        if self._offloader is None:
            local = next(iter(self.model.parameters()))
            self._offloader = Offloader(getattr(local, "_local_tensor", local).device)
        tensors: list[torch.Tensor] = []
        if "optimizer" in parts:
            tensors += optimizer_tensors(self.optimizer)
        if "grads" in parts:
            tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        if "params" in parts:
            tensors += module_tensors([self.model])
            if self.ema is not None:
                tensors += list(self.ema.shadow.values())
        return self._offloader.offload(tensors).as_metrics()

    def onload(self) -> dict[str, float]:
        """Bring back everything `offload` moved."""
        if self._offloader is None:
            return {"bytes": 0.0, "seconds": 0.0}
        return self._offloader.onload().as_metrics()

"""SD3's joint attention run by miles: diffusers' attention backends and Ulysses sequence parallelism.

diffusers' `JointAttnProcessor2_0` calls `F.scaled_dot_product_attention` itself, so neither
`set_attention_backend` nor diffusers' context parallelism (SD3Transformer2DModel has no `_cp_plan`)
reaches it. `JointAttention` is the same computation through `dispatch_attention_fn(backend=...)`,
optionally sharded over a sequence-parallel group:

- after the patch embedding each rank keeps its contiguous slice of the image tokens (a forward hook on
  `pos_embed`), and the output projection's tokens are gathered back (a hook on `proj_out`), so every
  rank returns the whole velocity and computes the whole loss;
- the text (context) stream is small and stays whole on every rank;
- in attention the image q/k/v go from token-sharded to head-sharded with an all-to-all, each rank
  takes its heads of the (whole) text q/k/v, attends over all image + text tokens for its heads, sends
  the image part back with the reverse all-to-all and all-gathers the text part's heads.

Every cross-rank step is an autograd function with the exact adjoint as backward (`miles.models.ulysses`),
so the gradients summed over the SP group are those of the sum of its ranks' (identical) losses; FSDP2's
gradient average over all world ranks then gives exactly the gradient of the data-parallel mean loss.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.core.errors import ConfigError
from miles.models import ulysses


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, width = x.shape
    return x.view(b, n, heads, width // heads)


class JointAttention:
    """An SD3 attention processor (joint image + text attention, or image-only for SD3.5's dual attention).

    `_attention_backend`: a diffusers backend name (None: diffusers' active backend, "native" by default);
    it is the attribute diffusers' `set_attention_backend` sets on processors. `group`: the sequence-parallel
    process group (None: no sequence parallelism).
    """

    def __init__(self) -> None:
        self._attention_backend: str | None = None
        self.group: Any = None

    @property
    def backend(self) -> str | None:
        """The backend's name (None: diffusers' active backend)."""
        name = self._attention_backend
        return None if name is None else str(getattr(name, "value", name))

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        heads, group = attn.heads, self.group
        query, key, value = (_heads(proj(hidden_states), heads) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if group is not None:
            query, key, value = (ulysses.tokens_to_heads(t, group) for t in (query, key, value))
        n_image = query.shape[1]

        if encoder_hidden_states is not None:
            ctx = [
                _heads(proj(encoder_hidden_states), heads)
                for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            ]
            if attn.norm_added_q is not None:
                ctx[0] = attn.norm_added_q(ctx[0])
            if attn.norm_added_k is not None:
                ctx[1] = attn.norm_added_k(ctx[1])
            if group is not None:
                ctx = [ulysses.local_chunk(t, 2, group) for t in ctx]  # this rank's heads of the whole text
            query, key, value = (torch.cat([x, c], dim=1) for x, c in zip((query, key, value), ctx, strict=True))

        out = dispatch_attention_fn(query, key, value, dropout_p=0.0, is_causal=False, backend=self._attention_backend)
        out = out.to(query.dtype)
        image, context = out[:, :n_image], out[:, n_image:]
        if group is not None:
            image = ulysses.heads_to_tokens(image, group)
        image = attn.to_out[1](attn.to_out[0](image.flatten(2)))
        if encoder_hidden_states is None:
            return image
        if group is not None:
            context = ulysses.gather(context, 2, group)
        context = context.flatten(2)
        if not attn.context_pre_only:
            context = attn.to_add_out(context)
        return image, context


def _processor(model: torch.nn.Module) -> JointAttention:
    """The model's `JointAttention`, installed on every attention module on first use (one shared instance)."""
    processor = getattr(model, "_miles_joint_attention", None)
    if processor is None:
        processor = JointAttention()
        model.set_attn_processor(processor)
        model._miles_joint_attention = processor
    return processor


def set_attention_backend(model: torch.nn.Module, backend: str) -> JointAttention:
    """Run every attention of an SD3 DiT on diffusers' attention backend `backend`."""
    from diffusers.models import attention_dispatch

    name = attention_dispatch.AttentionBackendName(backend)
    check = getattr(attention_dispatch, "_check_attention_backend_requirements", None)
    if check is not None:
        check(name)  # the backend's package (flash-attn, sageattention, ...) is installed
    processor = _processor(model)
    processor._attention_backend = name
    return processor


def check_heads(heads: int, sp: int) -> None:
    if heads % sp:
        raise ConfigError(
            f"--sequence-parallel-size {sp} (Ulysses degree {sp}) must divide the DiT's {heads} attention heads"
        )


def check_tokens(latent_hw: tuple[int, int], patch: int, sp: int) -> None:
    h, w = latent_hw
    tokens = (h // patch) * (w // patch)
    if tokens % sp:
        raise ConfigError(
            f"--sequence-parallel-size {sp} must divide the DiT's image tokens per sample: {tokens} here "
            f"({h // patch}x{w // patch} patches of a {h}x{w} latent); change "
            "--diffusion-height/--diffusion-width or the sequence-parallel size"
        )


def enable_sequence_parallel(model: torch.nn.Module, group: Any) -> JointAttention:
    """Shard an SD3 DiT's image tokens over the ranks of `group` (Ulysses). Every rank of the group must get
    the same inputs; each returns the whole output."""
    sp = ulysses.group_rank_size(group)[1]
    check_heads(model.config.num_attention_heads, sp)
    processor = _processor(model)
    processor.group = group
    patch = model.config.patch_size

    def split_tokens(module: torch.nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        check_tokens(tuple(inputs[0].shape[-2:]), patch, sp)
        return ulysses.local_chunk(output, 1, group)

    def gather_tokens(module: torch.nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return ulysses.gather(output, 1, group)

    model.pos_embed.register_forward_hook(split_tokens)
    model.proj_out.register_forward_hook(gather_tokens)
    return processor

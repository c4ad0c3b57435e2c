"""`miles reward serve`: any built-in reward, or a custom one, as an HTTP service (`miles.rewards.service`).

    miles reward serve --rm-type digit --hf-checkpoint tiny-sd3-digits-sft-short --port 8000
    miles reward serve --rm-type pickscore --pickscore-model-path DIR --pickscore-processor-path DIR --host 0.0.0.0
    miles reward serve --custom-rm-path my_pkg.rewards.aesthetic --port 8001

A job scores through it with `--rm-type remote_rm --rm-url http://HOST:PORT`. Torch-free at import.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from miles.core.errors import ConfigError

app = typer.Typer(help="Serve rewards over HTTP for other jobs and machines.", no_args_is_help=True)

# the flags a reward reads besides its own group: where the digit classifier and the custom rewards' files are
_EXTRA_DESTS = ("hf_checkpoint",)


@app.callback()
def _reward() -> None:
    """Rewards as a service."""


def _reward_flags() -> dict[str, Any]:
    from miles.config.catalog import FLAGS_BY_DEST
    from miles.config.catalog.reward import FLAGS

    return {flag.dest: flag for flag in FLAGS} | {dest: FLAGS_BY_DEST[dest] for dest in _EXTRA_DESTS}


def parse_reward_flags(tokens: list[str]) -> dict[str, Any]:
    """`--flag value` / `--flag=value` pairs of the Reward group (and --hf-checkpoint) -> {dest: parsed value}."""
    flags = _reward_flags()
    values: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise ConfigError(f"miles reward serve: unexpected argument {token!r}")
        name, eq, raw = token[2:].partition("=")
        dest = name.replace("-", "_")
        flag = flags.get(dest)
        if flag is None:
            raise ConfigError(
                f"miles reward serve: --{name} is not a reward flag (the Reward group of `miles train rl --help`, "
                "and --hf-checkpoint)"
            )
        if not eq:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise ConfigError(f"miles reward serve: --{name} needs a value")
            raw = tokens[i + 1]
            i += 1
        values[dest] = flag.parse(raw, f"--{name}")
        i += 1
    return values


def custom_scorer(args: Any, path: str) -> Any:
    """A `--custom-rm-path` reward as a service scorer: the items become samples and the function scores them."""
    import asyncio

    from miles.core.sample import Sample
    from miles.rewards.dispatch import custom_rewards

    def score(images: Any, prompts: Any, metadata: Any) -> list[float]:
        samples = [
            Sample(index=i, group_index=i, prompt=str(p), metadata=dict(m), image=_tensor(im))
            for i, (im, p, m) in enumerate(zip(images, prompts, metadata, strict=True))
        ]
        rewards = asyncio.run(custom_rewards(args, samples, path))
        key = args.reward_key
        out = []
        for reward in rewards:
            if isinstance(reward, dict):
                if key is None:
                    raise ConfigError(f"--custom-rm-path {path} returns dicts: serve it with --reward-key KEY")
                reward = reward[key]
            out.append(float(reward))
        return out

    return score


def _tensor(image: Any) -> Any:
    import torch

    return image if isinstance(image, torch.Tensor) else torch.as_tensor(image)


@app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: all).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port (0: a free one, printed).")] = 8000,
    max_batch_size: Annotated[
        int, typer.Option("--max-batch-size", help="Items per scorer call: concurrent requests are merged up to it.")
    ] = 64,
    ready_file: Annotated[
        str | None, typer.Option("--ready-file", help="Write the service's URL to this file once it listens.")
    ] = None,
) -> None:
    """Serve rewards: every --rm-type given (and a --custom-rm-path, served under its function's name), with the
    Reward flags they need (--hf-checkpoint, --pickscore-model-path, ...). Ends on Ctrl-C or SIGTERM."""
    from miles.config.resolution import schema_args

    values = parse_reward_flags(list(ctx.args))
    types = [t for t in values.get("rm_type") or [] if t != "remote_rm"]
    if "remote_rm" in (values.get("rm_type") or []):
        raise ConfigError("miles reward serve: remote_rm is what a job uses to reach a service; serve a reward type")
    custom = values.get("custom_rm_path")
    if not types and custom is None:
        raise ConfigError("miles reward serve: give the rewards to serve with --rm-type a,b or --custom-rm-path")
    args = schema_args(**values)
    from miles.builtin.inputs import prepare_inputs
    from miles.builtin.names import builtin_paths

    args.inputs = builtin_paths([args.hf_checkpoint])
    prepare_inputs(args)
    from miles.rewards.dispatch import RewardSettings
    from miles.rewards.service.server import serve as serve_rewards

    extra = {str(custom).rsplit(".", 1)[-1]: custom_scorer(args, str(custom))} if custom is not None else None
    settings = RewardSettings.from_args(args)
    serve_rewards(settings, types, host, port, extra=extra, max_batch_size=max_batch_size, ready_file=ready_file)

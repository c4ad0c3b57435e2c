"""Rollout on sglang-diffusion servers: protocol, launcher, engine actors, client, weight sync and the miles router.

The servers run from their own Python environment (`--sglang-python`), reached over HTTP only, so
nothing here imports sglang.
"""

"""miles: post-training for diffusion models (Flow-GRPO, DiffusionNFT, SFT, DMD2)."""

__version__ = "0.1.0"

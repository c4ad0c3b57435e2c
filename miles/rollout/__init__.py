"""Rollout: engines, samplers, data sources, rewards (`rm_hub`) and the rollout manager."""

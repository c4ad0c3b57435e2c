"""Rollout: engines, samplers, data sources and the rollout manager (the rewards it scores with: `miles.rewards`; the
sampling math the engines step with: `miles.sampling`)."""

"""The rollout side of `miles train dmd2`: the student's few-step sampler with backward simulation (sampler.py), its
rollouts on the in-process diffusers engine (engine.py) and the rollout manager that draws them and evaluates
student and teacher (manager.py)."""

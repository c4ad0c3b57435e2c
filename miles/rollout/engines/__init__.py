"""Rollout engines: the in-process diffusers engine (CPU or GPU); engine servers land later."""

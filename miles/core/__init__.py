"""The ground floor: the words every layer shares, importing nothing else of miles but the dotted-path loader
(`miles.utils.dotted`, on this floor) (torch-free but `sample`).

errors   ConfigError (a user mistake: one line, exit 2), RuntimeUnavailable, EngineFailure
sample   the rollout data contract: Sample, Trajectory, Conditions and the sample statuses
"""

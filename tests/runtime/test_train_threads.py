"""A trainer rank's torch threads: `--train-env-vars OMP_NUM_THREADS=N` when given, else the node's cores shared
among its ranks (Ray sets OMP_NUM_THREADS in every actor itself, so only the flag's value counts)."""

from __future__ import annotations

import os

from miles.config.resolution import schema_args
from miles.runtime.trainer_group import train_threads


def test_the_flag_sets_the_threads() -> None:
    assert train_threads(schema_args(train_env_vars={"OMP_NUM_THREADS": "1"}), world=1) == 1
    assert train_threads(schema_args(train_env_vars={"OMP_NUM_THREADS": 3}), world=2) == 3


def test_without_it_the_cores_are_shared_among_the_ranks() -> None:
    cores = os.cpu_count() or 1
    assert train_threads(schema_args(train_env_vars={}), world=1) == cores
    assert train_threads(schema_args(train_env_vars=None), world=cores * 4) == 1
    assert train_threads(schema_args(train_env_vars={"OMP_NUM_THREADS": "0"}), world=1) == cores

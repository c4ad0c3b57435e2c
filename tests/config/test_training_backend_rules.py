"""Training-backend flags at parse time (torch-free): backend names, HSDP / sequence-parallel sizes, dp_size."""

from __future__ import annotations

from jobs_helpers import assert_names, rejected, run

FOUR_GPUS = {"actor_num_gpus_per_node": 4, "num_gpus_per_node": 4}
EIGHT_GPUS = {"actor_num_gpus_per_node": 8, "num_gpus_per_node": 8}


def test_ring_attention_is_refused_with_one_line() -> None:
    message = rejected(sequence_parallel_size=4, ulysses_degree=2, **FOUR_GPUS)
    assert message == (
        "--sequence-parallel-size 4 (cli) with --ulysses-degree 2 (cli) needs ring attention (ring degree 2), "
        "which miles' trainer does not have; set --ulysses-degree 4 or 0 (Ulysses fills the sequence-parallel size)"
    )


def test_ulysses_auto_or_equal_to_sp_is_accepted() -> None:
    assert run(sequence_parallel_size=4, **FOUR_GPUS).args.ulysses_degree == 0
    assert run(sequence_parallel_size=4, ulysses_degree=4, **FOUR_GPUS).args.sequence_parallel_size == 4


def test_dp_size_is_world_over_sp_and_hsdp_splits_it() -> None:
    # 8 ranks, sp 2 -> dp 4 = replicate 2 x shard 2: a global batch must divide by 4.
    assert run(global_batch_size=4, sequence_parallel_size=2, dp_replicate_size=2, **EIGHT_GPUS).args
    message = rejected(global_batch_size=2, sequence_parallel_size=2, dp_replicate_size=2, **EIGHT_GPUS)
    assert_names(message, "--global-batch-size 2 (cli)", "dp_size 4", "--sequence-parallel-size 2")
    message = rejected(sequence_parallel_size=2, dp_replicate_size=4, **FOUR_GPUS)
    assert_names(message, "--dp-replicate-size 4 (cli)", "dp_size 2")


def test_unknown_process_group_backend_names_the_closest() -> None:
    message = rejected(distributed_backend="ncl")
    assert message.startswith(
        "--distributed-backend ncl (cli) is not a torch.distributed backend (did you mean 'nccl'?)"
    )
    assert "gloo" in message


def test_fsdp_cpu_backend_must_hold_cpu_tensors() -> None:
    message = rejected(fsdp_cpu_backend="nccl")
    assert message == "--fsdp-cpu-backend nccl (cli) cannot hold CPU tensors; use one of gloo, ucc, mpi"
    assert run(fsdp_cpu_backend="mpi").args.fsdp_cpu_backend == "mpi"


def test_attention_backend_names_are_checked_at_parse_time() -> None:
    message = rejected(fsdp_attention_backend="_native_maths")
    assert message.startswith(
        "--fsdp-attention-backend _native_maths (cli) is not a diffusers attention backend "
        "(did you mean '_native_math'?)"
    )
    # a CUDA-only name is a valid name: only the trainer rank knows whether it has CUDA
    for name in ("native", "_native_math", "flash", "sage"):
        assert run(fsdp_attention_backend=name).args.fsdp_attention_backend == name


def test_sequence_parallel_refuses_the_dmd2_gan_head() -> None:
    message = rejected("dmd2", sequence_parallel_size=2, dmd2_gan_loss_weight=0.1, **FOUR_GPUS)
    assert_names(message, "--sequence-parallel-size 2 (cli)", "--dmd2-gan-loss-weight 0.1 (cli)", "GAN head")

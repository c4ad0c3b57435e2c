"""`eval_batches`: which requests the in-process engine runs in one forward (evaluation requests up to
--rollout-microgroup-size samples, training microgroups up to --rollout-engine-batch-size)."""

from __future__ import annotations

from dataclasses import replace

from miles.rollout.engines.base import GenerateRequest
from miles.rollout.engines.diffusers_engine import eval_batches


def _req(prompt: str, n: int = 1, evaluation: bool = True, **kw) -> GenerateRequest:
    return GenerateRequest(
        prompt=prompt,
        metadata={},
        group_index=0,
        indices=list(range(n)),
        seeds=list(range(n)),
        sde_steps=[[] for _ in range(n)],
        num_steps=kw.pop("num_steps", 4),
        guidance_scale=4.0,
        noise_level=0.0,
        sde_type="ode",
        height=64,
        width=64,
        evaluation=evaluation,
        **kw,
    )


def test_consecutive_evaluation_requests_share_a_batch_up_to_the_size() -> None:
    reqs = [_req(p) for p in "abcde"]
    assert [[r.prompt for r in b] for b in eval_batches(reqs, 2)] == [["a", "b"], ["c", "d"], ["e"]]
    assert [len(b) for b in eval_batches(reqs, 16)] == [5]
    assert [len(b) for b in eval_batches(reqs, 1)] == [1] * 5
    assert [len(b) for b in eval_batches(reqs, 0)] == [1] * 5


def test_requests_count_their_samples() -> None:
    reqs = [_req("a", 3), _req("b", 2), _req("c", 1)]
    assert [len(b) for b in eval_batches(reqs, 4)] == [1, 2]


def test_rollout_requests_and_different_settings_stay_alone() -> None:
    train = [_req("a", evaluation=False), _req("b", evaluation=False)]
    assert [len(b) for b in eval_batches(train, 16)] == [1, 1]
    mixed = [_req("a"), _req("b", num_steps=8), _req("c", num_steps=8), replace(_req("d"), height=128)]
    assert [[r.prompt for r in b] for b in eval_batches(mixed, 16)] == [["a"], ["b", "c"], ["d"]]
    extra = [_req("a"), _req("b", extra={"frames": 2})]
    assert [len(b) for b in eval_batches(extra, 16)] == [1, 1]


def test_training_microgroups_batch_up_to_the_engine_batch_size() -> None:
    """The third argument is --rollout-engine-batch-size (`forward_batch_sizes`)."""
    train = [_req(p, 4, evaluation=False) for p in "abcde"]
    assert [len(b) for b in eval_batches(train, 16, 8)] == [2, 2, 1]
    assert [len(b) for b in eval_batches(train, 16, 0)] == [1] * 5  # unset: each microgroup alone
    assert [len(b) for b in eval_batches(train, 16, 3)] == [1] * 5  # a microgroup larger than the batch: alone
    # evaluation and training never share a batch; each kind keeps its own size
    mixed = [_req("a", 2), _req("b", 2, evaluation=False), _req("c", 2, evaluation=False), _req("d", 2)]
    assert [[r.prompt for r in b] for b in eval_batches(mixed, 1, 8)] == [["a"], ["b", "c"], ["d"]]


def test_microgroups_with_a_schedule_of_their_own_stay_alone() -> None:
    shared = [_req(p, 2, evaluation=False, shared_prefix=True) for p in "ab"]
    assert [len(b) for b in eval_batches(shared, 16, 16)] == [1, 1]
    tail = [_req(p, 2, evaluation=False, post_sde_steps_ratio=0.5) for p in "ab"]
    assert [len(b) for b in eval_batches(tail, 16, 16)] == [1, 1]
    other = [_req("a", 2, evaluation=False), _req("b", 2, evaluation=False, record_means=True)]
    assert [len(b) for b in eval_batches(other, 16, 16)] == [1, 1]

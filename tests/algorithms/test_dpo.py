"""Diffusion-DPO for flow matching (`miles.algorithms.dpo`) against the numbers of algorithms_next.md D.6 and the
peers' formulas written out here (flow_grpo / Flow-Factory / verl-omni, and diffusers' beta_d form)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from miles.algorithms.dpo import (
    PairSelection,
    denoising_error,
    dpo_loss,
    dpo_sigmas,
    group_pair,
    preference_pairs,
    sigmas_at,
)

# D.6.1
E_THETA_W, E_REF_W, E_THETA_L, E_REF_L = 0.30, 0.32, 0.35, 0.33


def _errors(requires_grad: bool = True) -> tuple[torch.Tensor, ...]:
    values = (E_THETA_W, E_THETA_L, E_REF_W, E_REF_L)
    return tuple(torch.tensor([v], dtype=torch.float64, requires_grad=requires_grad) for v in values)


def diffusers_loss(theta_w, theta_l, ref_w, ref_l, beta_d: float) -> torch.Tensor:
    """diffusers' train_diffusion_dpo.py: `-logsigmoid(beta_dpo * ((ref_w - ref_l) - (model_w - model_l)))`."""
    model_diff = theta_w - theta_l
    ref_diff = ref_w - ref_l
    return -F.logsigmoid(beta_d * (ref_diff - model_diff)).mean()


def flow_peers_loss(theta_w, theta_l, ref_w, ref_l, beta: float) -> torch.Tensor:
    """flow_grpo's train_sd3_dpo.py (and Flow-Factory's / verl-omni's DPO losses): `-logsigmoid(-0.5 * beta *
    ((model_w - model_l) - (ref_w - ref_l)))`."""
    inside = -0.5 * beta * ((theta_w - theta_l) - (ref_w - ref_l))
    return -F.logsigmoid(inside).mean()


def peer_mse(model_pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The peers' per-sample error: `((model_pred - target) ** 2).mean(dim=all but the batch)`."""
    return ((model_pred.float() - target.float()) ** 2).reshape(model_pred.shape[0], -1).mean(dim=1)


# ---- D.6.1: the loss, its gradient and the beta convention ----------------------------------------------------------
def test_the_d61_loss_and_its_gradients_by_autograd() -> None:
    theta_w, theta_l, ref_w, ref_l = _errors()
    loss, metrics = dpo_loss(theta_w, theta_l, ref_w, ref_l, beta=100.0)
    assert float(loss.detach()) == pytest.approx(0.126928, abs=5e-7)  # z = -50 * (-0.02 - 0.02) = 2: -log sigmoid(2)
    assert metrics["loss"] == pytest.approx(0.126928, abs=5e-7)
    loss.backward()
    assert float(theta_w.grad) == pytest.approx(5.96015, abs=5e-6)  # (beta/2)(1 - sigmoid(2)): lowers the winner's
    assert float(theta_l.grad) == pytest.approx(-5.96015, abs=5e-6)  # and raises the loser's error
    assert ref_w.grad is None and ref_l.grad is None  # the reference is detached
    assert metrics["implicit_accuracy"] == 1.0  # Delta_w = -0.02 < Delta_l = 0.02
    assert metrics["margin"] == pytest.approx(0.04)
    assert (metrics["e_theta_winner"], metrics["e_ref_winner"]) == pytest.approx((0.30, 0.32))
    assert (metrics["e_theta_loser"], metrics["e_ref_loser"]) == pytest.approx((0.35, 0.33))


def test_diffusers_form_is_ours_at_beta_d_half_beta() -> None:
    errors = _errors(requires_grad=False)
    ours, _ = dpo_loss(*errors, beta=100.0)
    theta_w, theta_l, ref_w, ref_l = errors
    assert float(diffusers_loss(theta_w, theta_l, ref_w, ref_l, beta_d=50.0)) == pytest.approx(float(ours), abs=1e-12)
    assert float(diffusers_loss(theta_w, theta_l, ref_w, ref_l, beta_d=100.0)) == pytest.approx(0.018150, abs=5e-7)
    assert float(dpo_loss(*errors, beta=200.0)[0]) == pytest.approx(0.018150, abs=5e-7)  # beta_d 100 = our beta 200


def test_at_theta_equal_ref_the_loss_is_ln2_and_the_gradient_beta_over_4() -> None:
    theta_w = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    theta_l = torch.tensor([0.35], dtype=torch.float64, requires_grad=True)
    loss, metrics = dpo_loss(theta_w, theta_l, theta_w.detach().clone(), theta_l.detach().clone(), beta=100.0)
    value = float(loss.detach())
    assert value == pytest.approx(math.log(2), abs=1e-12) and round(value, 6) == 0.693147
    loss.backward()
    assert float(theta_w.grad) == pytest.approx(25.0) and float(theta_l.grad) == pytest.approx(-25.0)
    assert metrics["implicit_accuracy"] == 0.0 and metrics["margin"] == 0.0  # strict: a tie is not a win


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_peers_formulas_match_ours_on_random_inputs(seed: int) -> None:
    """From random velocities: our `denoising_error` + `dpo_loss` against the peers' MSE and both peer losses."""
    gen = torch.Generator().manual_seed(seed)
    pairs, shape = 6, (4, 8, 8)
    x0_w, x0_l, noise = (torch.randn(pairs, *shape, generator=gen) for _ in range(3))
    v = {k: torch.randn(pairs, *shape, generator=gen) for k in ("theta_w", "theta_l", "ref_w", "ref_l")}
    beta = float(torch.empty(1).uniform_(50, 5000, generator=gen))
    ours, _ = dpo_loss(
        denoising_error(v["theta_w"], x0_w, noise),
        denoising_error(v["theta_l"], x0_l, noise),
        denoising_error(v["ref_w"], x0_w, noise),
        denoising_error(v["ref_l"], x0_l, noise),
        beta=beta,
    )
    mse = {k: peer_mse(v[k], noise - (x0_w if k.endswith("_w") else x0_l)) for k in v}
    args = (mse["theta_w"], mse["theta_l"], mse["ref_w"], mse["ref_l"])
    assert float(ours) == pytest.approx(float(flow_peers_loss(*args, beta=beta)), abs=1e-6)
    assert float(ours) == pytest.approx(float(diffusers_loss(*args, beta_d=beta / 2)), abs=1e-6)


def test_denoising_error_is_the_per_sample_velocity_mse_over_the_masked_elements() -> None:
    x0 = torch.zeros(2, 2, 1, 1)
    noise = torch.ones(2, 2, 1, 1)  # target noise - x0 = 1
    v = torch.tensor([[1.0, 3.0], [0.0, 1.0]]).reshape(2, 2, 1, 1)
    assert denoising_error(v, x0, noise).tolist() == [2.0, 0.5]
    mask = torch.tensor([True, False]).reshape(2, 1, 1)
    assert denoising_error(v, x0, noise, mask).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="must match"):
        denoising_error(v, x0[:1], noise)


def test_a_zero_weight_drops_a_pair_and_the_weights_scale_the_mean() -> None:
    theta_w = torch.tensor([0.30, 9.0], dtype=torch.float64)
    theta_l = torch.tensor([0.35, 0.0], dtype=torch.float64)
    ref_w, ref_l = torch.tensor([0.32, 0.0], dtype=torch.float64), torch.tensor([0.33, 0.0], dtype=torch.float64)
    loss, metrics = dpo_loss(theta_w, theta_l, ref_w, ref_l, beta=100.0, weight=torch.tensor([2.0, 0.0]))
    assert float(loss) == pytest.approx(0.126928, abs=5e-7)  # the mean over 2 pairs of (2 * first, 0 * second)
    assert metrics["implicit_accuracy"] == 1.0 and metrics["e_theta_winner"] == pytest.approx(0.30)
    with pytest.raises(ValueError, match="--diffusion-dpo-beta must be > 0"):
        dpo_loss(theta_w, theta_l, ref_w, ref_l, beta=0.0)


# ---- D.6.2: pairs, the tie rule -------------------------------------------------------------------------------------
def flow_grpo_pair(rewards: list[float]) -> tuple[int, int]:
    """flow_grpo's PerPromptStatTracker.update(type='dpo'): argmax / argmin, a constant group forced to (1, 0)."""
    r = torch.tensor(rewards)
    if bool((r == r[0]).all()):
        return 1, 0
    return int(r.argmax()), int(r.argmin())


def flow_factory_pair(rewards: list[float]) -> tuple[int, int]:
    """Flow-Factory's _form_pairs_from_advantages: argmax / argmin of the advantages (the first of equal values)."""
    r = torch.tensor(rewards)
    adv = r - r.mean()
    return int(adv.argmax()), int(adv.argmin())


def verl_omni_pair(rewards: list[float]) -> tuple[int, int]:
    """verl-omni's build_online_dpo_pair_indices: stable descending sort, first against last."""
    order = sorted(range(len(rewards)), key=lambda i: -rewards[i])
    return order[0], order[-1]


def test_the_d62_pairs_of_the_peers_and_ours() -> None:
    distinct = [0.3, 0.9, 0.1, 0.9]
    assert flow_grpo_pair(distinct) == flow_factory_pair(distinct) == verl_omni_pair(distinct) == (1, 2)
    assert group_pair(distinct) == (1, 2)  # among equal best rewards the first index wins

    tied = [0.5, 0.5, 0.5]
    assert (flow_grpo_pair(tied), flow_factory_pair(tied), verl_omni_pair(tied)) == ((1, 0), (0, 0), (0, 2))
    # ours: no pair. flow_grpo's forced labels are noise, Flow-Factory's self-pair has loss ln 2 and zero gradient,
    # verl-omni's first-vs-last prefers one of equal samples: a tied group carries no preference
    assert group_pair(tied) is None


def test_the_tie_rule_first_best_wins_last_worst_loses() -> None:
    assert group_pair([0.2, 0.9, 0.9, 0.2]) == (1, 3)
    assert group_pair([0.1, 0.1, 0.5]) == (2, 1)
    assert group_pair([0.7]) is None  # one sample: nothing to compare
    assert group_pair([0.1, 0.9]) == verl_omni_pair([0.1, 0.9]) == (1, 0)
    with pytest.raises(ValueError, match="not finite"):
        group_pair([0.1, float("nan")])


def test_preference_pairs_take_one_pair_per_group_and_count_the_rest() -> None:
    groups = [7, 7, 7, 7, 8, 8, 8, 9, 5, 5]
    rewards = [0.3, 0.9, 0.1, 0.9, 0.5, 0.5, 0.5, 0.4, 0.2, 0.6]
    selection = preference_pairs(groups, rewards)
    assert selection == PairSelection(pairs=[(1, 2), (9, 8)], tied_groups=1, single_groups=1)
    with pytest.raises(ValueError, match="group ids"):
        preference_pairs([1, 1], [0.1])


# ---- D.6.3: the noise levels ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("u", "timestep", "sigma"),
    [(0.001, 999.666, 0.99967), (0.25, 900.0, 0.9), (0.5, 750.0, 0.75), (0.75, 500.0, 0.5), (0.999, 2.994, 0.00299)],
)
def test_the_d63_sampler_rows_on_the_shift3_grid(u: float, timestep: float, sigma: float) -> None:
    got = float(sigmas_at(torch.tensor([u]), shift=3.0)[0])
    assert round(got * 1000.0, 3) == pytest.approx(timestep, abs=1e-3)
    assert got == pytest.approx(sigma, abs=5e-6)


@pytest.mark.slow  # importing diffusers takes ~1.5 s
def test_the_grid_is_the_shift3_scheduler_read_from_the_noise_end() -> None:
    """Index k of FlowMatchEulerDiscreteScheduler(1000, shift=3).sigmas (fp32 there, float64 here)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    u = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    assert torch.allclose(sigmas_at(u, shift=3.0), scheduler.sigmas[:1000].float(), atol=1e-6)


def test_the_d63_sampler_statistics() -> None:
    sigmas = dpo_sigmas(200_000, torch.Generator().manual_seed(0), shift=3.0)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (200_000,)
    assert float(sigmas.median()) == pytest.approx(0.7507, abs=0.003)
    assert float(sigmas.mean()) == pytest.approx(0.7147, abs=0.003)
    assert float((sigmas > 0.9).float().mean()) == pytest.approx(0.136, abs=0.003)
    assert float((sigmas < 0.25).float().mean()) == pytest.approx(0.0136, abs=0.002)
    unshifted = dpo_sigmas(200_000, torch.Generator().manual_seed(0), shift=None)
    assert float(unshifted.median()) == pytest.approx(0.5, abs=0.005)  # --fsdp-flow-shift unset: no shift

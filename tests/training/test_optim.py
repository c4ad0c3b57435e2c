"""AdamW construction, the Megatron-style learning-rate schedules, scheduler resume flags, gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch

from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.training.optim import MilesLRScheduler, build_lr_scheduler, build_optimizer, clip_grad_norm


@pytest.fixture(scope="module", autouse=True)
def _import_torch_optim():
    """torch.optim's first optimizer imports torch._dynamo (about 1 s on CPU); pay it once, outside the tests."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


@pytest.fixture(scope="module")
def base_args():
    return resolve("rl", recipe="tiny-digits-grpo", cli={"lr_warmup_iters": 0}).args  # each test sets its own schedule


def _args(base_args, **updates):
    return base_args.with_values(updates, "cli")


def _sched(base_args, total_steps=100, **updates):
    args = _args(base_args, **updates)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([param], args)
    return build_lr_scheduler(opt, args, total_steps), opt


def _lrs(sched: MilesLRScheduler, steps):
    return {n: sched.lr_at(n) for n in steps}


# ---- optimizer ------------------------------------------------------------------------------------------


def test_build_optimizer_is_adamw_with_the_flags(base_args):
    args = _args(base_args, lr=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.1)
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    live = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer([frozen, live], args)
    assert type(opt) is torch.optim.AdamW
    (group,) = opt.param_groups
    assert group["params"] == [live]
    assert group["lr"] == 3e-4 and group["betas"] == (0.8, 0.95)
    assert group["eps"] == 1e-6 and group["weight_decay"] == 0.1


def test_build_optimizer_defaults_and_errors(base_args):
    param = torch.nn.Parameter(torch.zeros(1))
    group = build_optimizer([param], base_args).param_groups[0]
    assert group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8 and group["weight_decay"] == 0.0
    with pytest.raises(ValueError, match="no trainable"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1), requires_grad=False)], base_args)


# ---- schedules ------------------------------------------------------------------------------------------


def test_constant_with_warmup(base_args):
    sched, opt = _sched(base_args, lr=1.0, lr_warmup_init=0.1, lr_warmup_iters=10, lr_decay_style="constant")
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # step 0 = warmup start
    assert _lrs(sched, [0, 5, 10, 11, 100, 1000]) == pytest.approx(
        {0: 0.1, 5: 0.55, 10: 1.0, 11: 1.0, 100: 1.0, 1000: 1.0}
    )


def test_constant_without_warmup(base_args):
    sched, opt = _sched(base_args, lr=2e-4)
    assert opt.param_groups[0]["lr"] == 2e-4
    assert sched.step() == 2e-4 and sched.lr_at(10**6) == 2e-4


def test_linear_decay_to_min_lr(base_args):
    sched, _ = _sched(base_args, lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style="linear")
    got = _lrs(sched, [0, 10, 55, 100, 101, 500])
    # after warmup: min + (1 - (n-10)/90) * 0.9
    assert got == pytest.approx({0: 0.0, 10: 1.0, 55: 0.55, 100: 0.1, 101: 0.1, 500: 0.1})


def test_cosine_decay(base_args):
    sched, _ = _sched(base_args, lr=1.0, min_lr=0.0, lr_decay_style="cosine", lr_decay_iters=50)
    got = _lrs(sched, [0, 25, 50, 51, 100])
    assert got == pytest.approx({0: 1.0, 25: 0.5, 50: 0.0, 51: 0.0, 100: 0.0}, abs=1e-12)
    assert sched.lr_at(10) == pytest.approx(0.5 * (math.cos(math.pi * 0.2) + 1))


def test_inverse_square_root(base_args):
    sched, _ = _sched(base_args, lr=1.0, min_lr=0.2, lr_warmup_iters=4, lr_decay_style="inverse-square-root")
    got = _lrs(sched, [2, 4, 16, 25, 100, 101])
    # 1 * sqrt(4)/sqrt(n), floored at min_lr, and min_lr past the decay length
    assert got == pytest.approx({2: 0.5, 4: 1.0, 16: 0.5, 25: 0.4, 100: 0.2, 101: 0.2})
    no_warmup, _ = _sched(base_args, lr=1.0, lr_decay_style="inverse-square-root")
    assert no_warmup.lr_at(0) == 1.0 and no_warmup.lr_at(4) == pytest.approx(0.5)


def test_min_lr_floor_for_every_style(base_args):
    for style in ("linear", "cosine", "inverse-square-root"):
        sched, _ = _sched(base_args, lr=1.0, min_lr=0.3, lr_decay_style=style, lr_warmup_iters=5)
        assert min(sched.lr_at(n) for n in range(0, 200) if n > 5) == pytest.approx(0.3)
    with pytest.raises(ConfigError, match="--min-lr"):
        _sched(base_args, lr=0.1, min_lr=0.5, lr_decay_style="linear")


@pytest.mark.parametrize(
    ("style", "quarter", "half"),
    [
        ("linear", 0.75, 0.5),
        ("cosine", 0.5 * (math.cos(math.pi * 0.25) + 1), 0.5),
        ("exponential", 2 * 0.5**0.25 - 1, 2 * 0.5**0.5 - 1),
        ("minus_sqrt", 1 - 0.5, 1 - math.sqrt(0.5)),
    ],
)
def test_wsd_phases(base_args, style, quarter, half):
    sched, _ = _sched(
        base_args,
        lr=1.0,
        min_lr=0.0,
        lr_warmup_iters=10,
        lr_decay_style="WSD",
        lr_wsd_decay_iters=20,
        lr_wsd_decay_style=style,
    )
    # warmup 0..10, stable to step 80, decay over 80..100, then min_lr
    assert sched.lr_at(5) == pytest.approx(0.5)
    assert sched.lr_at(10) == sched.lr_at(50) == sched.lr_at(80) == 1.0
    assert sched.lr_at(85) == pytest.approx(quarter)
    assert sched.lr_at(90) == pytest.approx(half)
    assert sched.lr_at(100) == pytest.approx(0.0, abs=1e-12)
    assert sched.lr_at(101) == 0.0


def test_wsd_defaults_and_errors(base_args):
    sched, _ = _sched(base_args, lr=1.0, lr_decay_style="WSD", lr_wsd_decay_iters=10)
    assert sched.wsd_decay_style == "exponential"  # Megatron's default
    with pytest.raises(ConfigError, match="--lr-wsd-decay-iters"):
        _sched(base_args, lr=1.0, lr_decay_style="WSD")
    with pytest.raises(ConfigError, match="--lr-wsd-decay-iters 200"):
        _sched(base_args, lr=1.0, lr_decay_style="WSD", lr_wsd_decay_iters=200)


def test_warmup_fraction_and_conflicts(base_args):
    sched, _ = _sched(base_args, total_steps=200, lr=1.0, lr_warmup_fraction=0.1, lr_decay_style="linear")
    assert sched.warmup_steps == 20
    assert sched.lr_at(10) == pytest.approx(0.5) and sched.lr_at(20) == 1.0
    with pytest.raises(ConfigError, match="--lr-warmup-fraction"):
        _sched(base_args, lr=1.0, lr_warmup_fraction=0.1, lr_warmup_iters=5)
    with pytest.raises(ConfigError, match="warmup"):
        _sched(base_args, lr=1.0, lr_warmup_iters=100, lr_decay_style="cosine")


def test_step_sets_the_optimizer_lr(base_args):
    sched, opt = _sched(base_args, lr=1.0, lr_warmup_iters=4, lr_decay_style="linear", lr_decay_iters=8)
    seen = [opt.param_groups[0]["lr"]]
    for _ in range(9):
        sched.step()
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert sched.get_lr() == sched.get_last_lr()[0] == 0.0


# ---- resume ---------------------------------------------------------------------------------------------


def test_state_round_trip(base_args):
    sched, _ = _sched(base_args, lr=1.0, lr_warmup_iters=5, lr_decay_style="cosine")
    sched.step(30)
    state = sched.state_dict()
    fresh, opt = _sched(base_args, lr=1.0, lr_warmup_iters=5, lr_decay_style="cosine")
    fresh.load_state_dict(state)
    assert fresh.num_steps == 30 and fresh.get_lr() == sched.get_lr()
    assert opt.param_groups[0]["lr"] == sched.get_lr()
    assert fresh.step() == sched.step()


def test_use_checkpoint_lr_scheduler_takes_the_checkpoint(base_args):
    old, _ = _sched(base_args, lr=1.0, lr_decay_style="linear")
    old.step(50)
    new, opt = _sched(base_args, lr=0.1, lr_decay_style="constant")  # --use-checkpoint-lr-scheduler is on
    new.load_state_dict(old.state_dict())
    assert (new.max_lr, new.decay_style, new.num_steps) == (1.0, "linear", 50)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


def test_override_lr_scheduler_keeps_the_args(base_args):
    old, _ = _sched(base_args, lr=1.0, lr_decay_style="linear")
    old.step(50)
    new, opt = _sched(
        base_args, lr=0.1, lr_decay_style="constant", use_checkpoint_lr_scheduler=False, override_lr_scheduler=True
    )
    new.load_state_dict(old.state_dict())
    assert (new.max_lr, new.decay_style, new.num_steps) == (0.1, "constant", 50)
    assert opt.param_groups[0]["lr"] == 0.1


def test_scheduler_flag_conflicts(base_args):
    with pytest.raises(ConfigError, match=r"--override-lr-scheduler.*--use-checkpoint-lr-scheduler"):
        _sched(base_args, override_lr_scheduler=True)  # use-checkpoint is on by default
    old, _ = _sched(base_args, lr=1.0)
    neither, _ = _sched(base_args, lr=0.5, use_checkpoint_lr_scheduler=False)
    with pytest.raises(ConfigError, match=r"--lr: command line 0\.5, checkpoint 1\.0"):
        neither.load_state_dict(old.state_dict())
    same, _ = _sched(base_args, lr=1.0, use_checkpoint_lr_scheduler=False)
    same.load_state_dict({**old.state_dict(), "num_steps": 7})
    assert same.num_steps == 7


# ---- clipping -------------------------------------------------------------------------------------------


def _with_grads(*grads):
    params = []
    for grad in grads:
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        params.append(param)
    return params


def test_clip_grad_norm_clips_and_returns_the_norm():
    params = _with_grads(torch.tensor([3.0, 0.0]), torch.tensor([[0.0], [4.0]]))
    assert clip_grad_norm(params, 1.0) == pytest.approx(5.0)
    assert torch.cat([p.grad.flatten() for p in params]).norm().item() == pytest.approx(1.0, rel=1e-5)
    assert params[0].grad[0].item() == pytest.approx(0.6, rel=1e-5)


def test_clip_grad_norm_below_threshold_and_disabled():
    params = _with_grads(torch.tensor([3.0, 4.0]))
    assert clip_grad_norm(params, 10.0) == pytest.approx(5.0)
    assert torch.equal(params[0].grad, torch.tensor([3.0, 4.0]))
    params = _with_grads(torch.tensor([30.0, 40.0]))
    assert clip_grad_norm(params, 0.0) == pytest.approx(50.0)
    assert torch.equal(params[0].grad, torch.tensor([30.0, 40.0]))
    no_grad = torch.nn.Parameter(torch.ones(2))
    assert clip_grad_norm([no_grad], 1.0) == 0.0

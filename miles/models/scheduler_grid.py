"""The schedulers' sigma grids in numpy, torch- and diffusers-free: what `TrainPipelineConfig.grid_schedule` (and
`miles.sampling.grid`) compute instead of `set_timesteps`, with diffusers 0.42.1's arithmetic (fp32 constructor
values, float64 spacing, the same shift expressions), so the grids are equal to the engines' to the last bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def dynamic_shift_mu(image_seq_len: int, config: Mapping[str, Any]) -> float:
    """The resolution-dependent shift `mu`: linear in the image token count between the scheduler's
    (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift), as FLUX and Qwen-Image compute it."""
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + (base_shift - slope * base_len)


FLOW_MATCH_EULER = "FlowMatchEulerDiscreteScheduler"
UNIPC = "UniPCMultistepScheduler"
# the constructor defaults (diffusers 0.42.1) of the keys the schedule math and the families read: a live
# scheduler's `.config` holds every constructor argument, a scheduler_config.json may leave some out
_SCHEDULER_DEFAULTS: dict[str, dict[str, Any]] = {
    FLOW_MATCH_EULER: {
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "use_dynamic_shifting": False,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
        "invert_sigmas": False,
        "shift_terminal": None,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "time_shift_type": "exponential",
        "stochastic_sampling": False,
    },
    UNIPC: {
        "num_train_timesteps": 1000,
        "prediction_type": "epsilon",
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "use_flow_sigmas": False,
        "flow_shift": 1.0,
        "timestep_spacing": "linspace",
        "steps_offset": 0,
        "final_sigmas_type": "zero",
        "use_dynamic_shifting": False,
        "time_shift_type": "exponential",
        "shift_terminal": None,
    },
}


def scheduler_class_name(config: Mapping[str, Any]) -> str:
    """The scheduler class a config is for: its `_class_name`, else UniPC when it has UniPC's flow keys (the tiny
    builds' dicts), else FlowMatchEuler."""
    name = config.get("_class_name")
    if name:
        return str(name)
    return UNIPC if ("flow_shift" in config or "use_flow_sigmas" in config) else FLOW_MATCH_EULER


def live_scheduler_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` as the scheduler built from it holds it: the constructor's defaults for what it leaves out (a new
    dict; `_class_name` set). ValueError for a scheduler class the torch-free grid does not know."""
    name = scheduler_class_name(config)
    defaults = _SCHEDULER_DEFAULTS.get(name)
    if defaults is None:
        known = ", ".join(_SCHEDULER_DEFAULTS)
        raise ValueError(f"scheduler {name}: the torch-free grid reproduces {known} only")
    return {**defaults, **config, "_class_name": name}


def resolve_token_count(token_count: int | Callable[[], int] | None, family: str) -> int:
    """The image token count a dynamic shift reads (`token_count` or what it returns); ValueError without one."""
    if token_count is None:
        raise ValueError(f"model family {family!r}: a dynamic shift needs the image token count")
    return int(token_count() if callable(token_count) else token_count)


def _time_shift(config: Mapping[str, Any], mu: float, sigma: float, t: Any) -> Any:
    """diffusers' resolution-dependent shift of the sigmas `t` (numpy; the same expression, so the same dtype)."""
    import math

    import numpy as np

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # a huge mu: inf / inf, NaN as in diffusers
        if config.get("time_shift_type", "exponential") == "exponential":
            return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)
        if config["time_shift_type"] == "linear":
            return mu / (mu + (1 / t - 1) ** sigma)
    raise ValueError(f"time_shift_type {config['time_shift_type']!r}: expected 'exponential' or 'linear'")


def _static_shift(shift: float, t: Any) -> Any:
    """The static shift `shift * t / (1 + (shift - 1) * t)` (numpy; diffusers' expression, so its dtype)."""
    return shift * t / (1 + (shift - 1) * t)


def _stretch_to_terminal(t: Any, terminal: float) -> Any:
    """Stretch the sigmas `t` so that the last one is `terminal` (diffusers' `stretch_shift_to_terminal`)."""
    import numpy as np

    one_minus_z = 1 - t
    scale_factor = one_minus_z[-1] / (1 - terminal)
    with np.errstate(invalid="ignore", divide="ignore"):  # one step: 0 / 0, NaN as in diffusers
        return 1 - (one_minus_z / scale_factor)


def _refuse_sigma_conversions(config: Mapping[str, Any]) -> None:
    for key in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas"):
        if config.get(key):
            raise ValueError(f"scheduler config {key}=true: the torch-free grid does not reproduce it")


def flow_match_euler_grid(
    config: Mapping[str, Any], num_steps: int, sigmas: Any = None, mu: float | None = None
) -> tuple[Any, Any]:
    """`FlowMatchEulerDiscreteScheduler(**config).set_timesteps(num_steps, sigmas=sigmas, mu=mu)` in numpy: `(sigmas
    [T+1], timesteps [T])` as float32 arrays, with diffusers 0.42.1's arithmetic step for step (the constructor's
    fp32 sigma_min/sigma_max, the float64 linspace between them, the shift or the dynamic time shift, the terminal
    stretch, the fp32 cast, timesteps = sigmas x N in fp32). `config` as `live_scheduler_config` gives it."""
    import numpy as np

    config = live_scheduler_config(config)
    _refuse_sigma_conversions(config)
    n_train = config["num_train_timesteps"]
    shift = config["shift"]
    dynamic = bool(config["use_dynamic_shifting"])
    if config["time_shift_type"] not in ("exponential", "linear"):
        raise ValueError("`time_shift_type` must either be 'exponential' or 'linear'")
    if dynamic and mu is None:
        raise ValueError("a dynamic-shift scheduler needs `mu`")
    # the constructor: fp32 train timesteps N..1 over N, shifted in fp32 unless the shift is dynamic
    ends = np.array([n_train, 1], dtype=np.float32) / n_train
    if not dynamic:
        ends = _static_shift(shift, ends)
    sigma_max, sigma_min = float(ends[0]), float(ends[1])
    if sigmas is None:
        timesteps = np.linspace(sigma_max * n_train, sigma_min * n_train, num_steps)
        values = timesteps / n_train
    else:
        values = np.array(sigmas).astype(np.float32)
    values = _time_shift(config, float(mu), 1.0, values) if dynamic else _static_shift(shift, values)
    if config["shift_terminal"]:
        values = _stretch_to_terminal(values, config["shift_terminal"])
    values = np.asarray(values).astype(np.float32)
    timesteps = values * n_train
    return np.concatenate([values, np.zeros(1, dtype=np.float32)]), timesteps.astype(np.float32)


def unipc_flow_sigmas(config: Mapping[str, Any], num_steps: int, mu: float | None = None) -> Any:
    """`UniPCMultistepScheduler(**config).set_timesteps(num_steps, mu=mu).sigmas` for flow sigmas, in numpy: float32
    `[T+1]` (the float64 linspace from 1 to 1/N, the flow shift or the dynamic time shift, the terminal stretch, a
    first sigma of 1 lowered by 1e-6, the final sigma, the fp32 cast), as diffusers 0.42.1 computes them."""
    import numpy as np

    config = live_scheduler_config(config)
    if config["_class_name"] != UNIPC:
        raise ValueError(f"unipc_flow_sigmas: a {config['_class_name']} config")
    if config["use_dynamic_shifting"] and mu is None:
        raise ValueError("`mu` must be passed when `use_dynamic_shifting` is set to be `True`")
    if config["timestep_spacing"] not in ("linspace", "leading", "trailing"):
        raise ValueError(f"timestep_spacing {config['timestep_spacing']!r} is not supported")
    _refuse_sigma_conversions(config)
    if not config["use_flow_sigmas"]:
        raise ValueError("a UniPC scheduler without flow sigmas (a VP schedule): the torch-free grid does not have it")
    n_train = config["num_train_timesteps"]
    sigmas = np.linspace(1, 1 / n_train, num_steps + 1)[:-1]
    if config["use_dynamic_shifting"]:
        sigmas = _time_shift(config, float(mu), 1.0, sigmas)
    else:
        sigmas = _static_shift(config["flow_shift"], sigmas)
    if config["shift_terminal"]:
        sigmas = _stretch_to_terminal(sigmas, config["shift_terminal"])
    eps = 1e-6
    if np.fabs(sigmas[0] - 1) < eps:
        sigmas[0] -= eps
    if config["final_sigmas_type"] == "sigma_min":
        last = sigmas[-1]
    elif config["final_sigmas_type"] == "zero":
        last = 0
    else:
        raise ValueError(f"final_sigmas_type {config['final_sigmas_type']!r}: expected 'zero' or 'sigma_min'")
    return np.concatenate([sigmas, [last]]).astype(np.float32)

"""The sampling math shared by the rollout engines, the trainer and the config (no Ray, no engines):

    sde.py             one denoising step (SDE, CPS or ODE) with its log-prob, the sigma shift
    sde_backends.py    the step's kernel (`--diffusion-sde-type`, `--sde-step-backend-path`)
    ode_solvers.py     DPM-Solver++ 2M and the compressed schedule after the SDE window
    seeds.py           the rollout seed layout and the noise drawn from it
    step_strategies.py which steps run as SDE steps (`--diffusion-step-strategy-path`)
    plan.py            how one request samples beyond its SDE steps (shared prefix, post-window steps)
    grid.py            the denoising grid without torch (what `inspect-config` and `plan` print)
    trained_steps.py   which steps an RL job trains on that grid (the config rules warn before launch)

The package imports nothing; grid.py, step_strategies.py and trained_steps.py are torch-free (the config reads them
before torch is loaded).
"""

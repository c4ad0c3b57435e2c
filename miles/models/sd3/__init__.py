"""The `sd3` family: Stable Diffusion 3 / 3.5 and the embedded default `tiny-sd3`.

`config` is its TrainPipelineConfig (torch-free, registered by the family registry), `parallel` its
training-side sequence/tensor parallel attention (diffusers' SD3 processor has neither); the offline tiny-sd3
build is `miles.builtin.tiny.sd3`.
"""

"""The offline tiny builds: the one build frame (`frame.TinyBuild`: the phases in order, timed on a progress bar,
the save and the metadata; `DigitsImageBuild`, `DigitFramesBuild` and `MovingDigitsBuild` hold the data, VAE and
classifier phases of the image, one-frame and moving-digit builds), the atomic directory and the report (`build`),
the video builds' VAE helpers (`video_vae`), the text encoders and VAE at toy size (`components`) and the VAE fit
on the digits (`vae_fit`). Each family's build is one module here (`miles.builtin.tiny.<family>`), named in
`miles.builtin.names.TINY_BUILDERS`; the metadata a job reads stays in `miles.models.tiny`.
"""

"""What the offline tiny builds share: their metadata files (`metadata`, torch-free), the one build frame
(`frame.TinyBuild`: the phases in order, timed on a progress bar, the save and the metadata; `DigitsImageBuild`,
`DigitFramesBuild` and `MovingDigitsBuild` hold the data, VAE and classifier phases of the image, one-frame and
moving-digit builds), the atomic directory and the report (`build`), the video builds' VAE helpers
(`video_vae`), the offline tokenizers, the text encoders and VAE at toy size (`components`) and the VAE fit on the
digits (`vae_fit`). Each family's own build is a subclass in its package (`miles.models.<family>.tiny`).
"""

"""What the offline tiny builds share: their metadata files (`metadata`, torch-free), the build frame
(`build`), the offline tokenizers, the text encoders and VAE at toy size (`components`) and the VAE fit
on the digits (`vae_fit`). Each family's own builder lives in its package (`miles.models.sd3.tiny`,
`miles.models.flux.tiny`, `miles.models.qwen_image.tiny`).
"""

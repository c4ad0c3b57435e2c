"""The `wan2_2_ti2v` family package: Wan2.2 TI2V-5B image-to-video (one transformer, `expand_timesteps`) on the
`wan2_2` family's text, VAE and schedule (`config`); its real-size configs (`real_config/`) for the memory plan; the
offline `tiny-wan2_2-ti2v` build is `miles.builtin.tiny.wan2_2_ti2v`."""

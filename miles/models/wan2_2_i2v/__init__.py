"""The `wan2_2_i2v` family package: Wan2.2 image-to-video (I2V-A14B) on the `wan2_2` family's two experts
(`config`); its real-size configs (`real_config/`) for the memory plan; the offline `tiny-wan2_2-i2v` build is
`miles.builtin.tiny.wan2_2_i2v`."""

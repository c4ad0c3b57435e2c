"""The `z_image` family package: Z-Image and Z-Image-Turbo text-to-image (`config`); its real-size configs
(`real_config/`) for the memory plan; the offline `tiny-z-image` build is `miles.builtin.tiny.z_image`."""

"""The `flux2` family package: FLUX.2-klein text-to-image (`config`); its real-size configs (`real_config/`) for
the memory plan; the offline `tiny-flux2-klein` build is `miles.builtin.tiny.flux2`."""

"""The `flux_kontext` family package: FLUX.1 Kontext editing (`config`), on the `flux` family's DiT and packing;
its real-size configs (`real_config/`) for the memory plan."""

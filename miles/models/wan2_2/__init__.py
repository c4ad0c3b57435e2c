"""The `wan2_2` family package: its `TrainPipelineConfig` (`config`), the two-expert module (`experts`) and the
offline `tiny-wan2_2` builder (`tiny`)."""

"""The `wan2_2` family package: its `TrainPipelineConfig` (`config`) and the two-expert module (`experts`); the
offline `tiny-wan2_2` build is `miles.builtin.tiny.wan2_2`."""

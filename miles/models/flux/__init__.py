"""The `flux` family package: its `TrainPipelineConfig` (`config`); the offline `tiny-flux` build is
`miles.builtin.tiny.flux`."""

"""The `flux` family package: its `TrainPipelineConfig` (`config`) and the offline `tiny-flux` builder (`tiny`)."""

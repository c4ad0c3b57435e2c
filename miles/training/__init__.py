"""The training side: optimizer and learning-rate schedule, the EMA shadow, checkpoints, the trained model."""

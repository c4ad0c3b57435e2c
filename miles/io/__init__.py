"""Files miles writes and reads: rollout files (`rollout_file`), and later checkpoints, image grids, exports."""

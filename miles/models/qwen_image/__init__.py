"""The `qwen_image` family package: its `TrainPipelineConfig` (`config`) and its byte-level BPE tokenizer
(`tokenizer`); the offline `tiny-qwen-image` build is `miles.builtin.tiny.qwen_image`."""

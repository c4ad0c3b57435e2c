"""The `qwen_image` family package: its `TrainPipelineConfig` (`config`), the offline `tiny-qwen-image` builder
(`tiny`) and its byte-level BPE tokenizer (`tokenizer`)."""

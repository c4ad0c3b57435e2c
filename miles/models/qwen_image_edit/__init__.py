"""The `qwen_image_edit` family package: its `TrainPipelineConfig` (`config`, Qwen-Image-Edit-Plus: 2509, 2511); the
offline `tiny-qwen-image-edit` build is `miles.builtin.tiny.qwen_image_edit`."""

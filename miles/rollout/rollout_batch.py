"""One rollout's samples and metrics, and how they travel from the rollout manager to the driver and trainers."""

from __future__ import annotations

import dataclasses
from typing import Any

from miles.core.packed import Packed
from miles.core.sample import Sample

PREVIEW_SAMPLES = 64  # the samples a batch carries to the driver for the image log

# trainer-side hooks that are handed the samples themselves (and may read their images)
TRAINER_SAMPLE_HOOKS = (
    "custom_convert_samples_to_train_data_path",
    "custom_expand_samples_to_train_pairs_path",
    "custom_prepare_train_batch_path",
)


def images_travel(args: Any) -> bool:
    """Whether a rollout's decoded images go on past the manager with its samples: where the driver reads every
    sample (--save-debug-rollout-data, --save-debug-train-data, a --custom-rollout-log-function-path hook) or a
    trainer-side hook is handed them. Otherwise the trainers get the samples without images (they train on the
    trajectories and conditions; a float image is most of a sample, 12 MB at 1024 px) and the driver the
    preview's images only."""
    driver = ("save_debug_rollout_data", "save_debug_train_data", "custom_rollout_log_function_path")
    return any(getattr(args, name, None) for name in (*driver, *TRAINER_SAMPLE_HOOKS))


def preview_of(samples: list[Sample]) -> list[Sample]:
    """The first `PREVIEW_SAMPLES` samples with their images, without trajectory or conditions."""
    return [dataclasses.replace(s, trajectory=None, conditions=None) for s in samples[:PREVIEW_SAMPLES]]


def without_images(rollout_id: int, samples: list[Sample], metrics: dict[str, float]) -> RolloutBatch:
    """The batch the manager hands on when nothing past it reads the images (`images_travel`): the preview keeps
    its images, every sample leaves without."""
    stripped = [dataclasses.replace(s, image=None) for s in samples]
    return RolloutBatch(rollout_id, stripped, metrics, preview=preview_of(samples))


class RolloutBatch:
    """One rollout's samples and metrics. Leaving the manager actor, the samples go once into Ray's object store,
    packed (`miles.core.packed`); the driver gets the reference, the metrics and a preview (the first
    `PREVIEW_SAMPLES` samples without trajectory or conditions, for the image log), and fetches the samples only if
    something reads `samples` (a rollout hook, --save-debug-rollout-data); the trainers take the reference
    (`trainer_input`), so a rollout crosses no process it does not need to."""

    def __init__(
        self,
        rollout_id: int,
        samples: list[Sample] | None = None,
        metrics: dict[str, float] | None = None,
        ref: Any = None,
        preview: list[Sample] | None = None,
    ) -> None:
        self.rollout_id = rollout_id
        self._samples = samples
        self.metrics = dict(metrics or {})
        self._ref = ref
        self._preview = preview

    @property
    def samples(self) -> list[Sample]:
        if self._samples is None:
            import ray

            self._samples = ray.get(self._ref)
        return self._samples

    @property
    def preview(self) -> list[Sample]:
        """The first `PREVIEW_SAMPLES` samples (image, prompt, reward; no trajectory or conditions)."""
        if self._preview is not None:
            return self._preview
        return self.samples[:PREVIEW_SAMPLES]

    def trainer_input(self) -> Any:
        """What `TrainerGroup.train` takes: the reference while the samples are not fetched here, else the list."""
        return self._ref if self._samples is None else self._samples

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        import ray

        preview = self._preview if self._preview is not None else preview_of(self.samples)
        if self._ref is not None and self._samples is None:  # passed on unfetched: the same reference
            return RolloutBatch, (self.rollout_id, None, self.metrics, self._ref, preview)
        if not ray.is_initialized():  # pickled outside a Ray job: inline
            return RolloutBatch, (self.rollout_id, Packed(self.samples), self.metrics, None, preview)
        ref = self._ref if self._ref is not None else ray.put(Packed(self.samples))
        return RolloutBatch, (self.rollout_id, None, self.metrics, ref, preview)

"""One rollout's samples and metrics, and how they travel from the rollout manager to the driver and trainers."""

from __future__ import annotations

import dataclasses
from typing import Any

from miles.core.packed import Packed
from miles.core.sample import Sample

PREVIEW_SAMPLES = 64  # the samples a batch carries to the driver for the image log


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

        preview = self._preview
        if preview is None:
            head = self.samples[:PREVIEW_SAMPLES]
            preview = [dataclasses.replace(s, trajectory=None, conditions=None) for s in head]
        if self._ref is not None and self._samples is None:  # passed on unfetched: the same reference
            return RolloutBatch, (self.rollout_id, None, self.metrics, self._ref, preview)
        if not ray.is_initialized():  # pickled outside a Ray job: inline
            return RolloutBatch, (self.rollout_id, Packed(self.samples), self.metrics, None, preview)
        ref = self._ref if self._ref is not None else ray.put(Packed(self.samples))
        return RolloutBatch, (self.rollout_id, None, self.metrics, ref, preview)

"""Data files: the prompt data, the eval sets and SFT data, streamed row by row through the reader the runtime
uses (`miles.data.prompts`, over every format of `miles.data.formats`), so a problem is the row the runtime would
have stopped at, found first.

A prompt row must parse, carry a non-empty string at `--input-key`, an object (or nothing) at `--metadata-key` and a
well-formed list (or nothing) at `--media-key`, and hold what its reward needs (`miles.rewards.dispatch.
check_reward_inputs`: a digit label, a quoted OCR target). Every medium a row names must be a regular file that
decodes (`miles.data.media`: PIL opens it, its size is at most `MAX_MEDIA_PIXELS`, every pixel is decoded; a video
PIL cannot read is only checked to exist). An SFT row names its caption (a non-empty string) and an image (or video)
file that exists; an image must decode (the same check). Under a method whose `train sft` rows are preferences
(offline DPO, the method table's `sft_rows`), a row names its caption and two different image files, each existing
and decoding (`miles.training.preference_rows`). SFT and preference rows may carry media too, checked the same way.
Built-in data sets pass (they are generated on first use). A URL is refused as the user wrote it (only local files
are read).

"; fix or remove that line" follows a problem of one line (or row) of a file (`file:LINE: ...`, `file:row N: ...`),
never one of the file as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.core.errors import ConfigError
from miles.data.media import MediaRef, check_image, check_media
from miles.data.prompt_file import PromptKeys, iter_jsonl_objects, kind, url_problem
from miles.data.prompts import check_sft_row, iter_prompt_rows
from miles.utils.text import clip, clip_repr

if TYPE_CHECKING:
    from miles.config.resolve import ResolvedJob

# a per-line check: (file:line, the row, its prompt, its metadata) -> raises ConfigError
LineCheck = Callable[[str, dict[str, Any], str, dict[str, Any]], None]

_REMEDY = "fix or remove that line"


def _builtin(spec: Any) -> bool:
    from miles.builtin.names import is_builtin_dataset

    return is_builtin_dataset(spec)


def reward_check(args: Any) -> LineCheck | None:
    """The reward's needs of each line (None: nothing to check, e.g. under --custom-rm-path)."""
    if args.custom_rm_path:
        return None
    from miles.rewards import REWARD_TYPES, reward_names
    from miles.rewards.dispatch import check_reward_inputs

    defaults = reward_names(args)

    def check(where: str, row: dict[str, Any], prompt: str, metadata: dict[str, Any]) -> None:
        override = metadata.get("rm_type")
        types = [override] if override else defaults
        if types == ["digit"] and type(label := metadata.get("label")) is int and 0 <= label <= 9:
            return  # the common case, without a call (a million lines)
        if not types:
            raise ConfigError(f"{where}: no reward type: set --rm-type (or metadata.rm_type, or --custom-rm-path)")
        if override and (not isinstance(override, str) or override not in REWARD_TYPES):
            raise ConfigError(
                f"{where}: metadata.rm_type {clip_repr(override)} is not a reward type "
                f"({', '.join(REWARD_TYPES)}); use one of them or --custom-rm-path"
            )
        for rm_type in types:
            try:
                check_reward_inputs(rm_type, prompt, metadata)
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None

    return check


@dataclass
class DataCount:
    """What a scan read: its rows, and how many of them carry media."""

    rows: int = 0
    with_media: int = 0

    def add(self, media: tuple[MediaRef, ...]) -> None:
        self.rows += 1
        self.with_media += bool(media)


def condition_images(args: Any) -> tuple[str, tuple[int, int]] | None:
    """(family, the number of condition images its rows must carry) of the job's model; None where the family
    does not resolve (the config's rules say why)."""
    from miles.models.families import resolve_family

    try:
        family = resolve_family(args.hf_checkpoint, args.diffusion_model_family, args.train_pipeline_config_path)
    except (ConfigError, ValueError, LookupError):
        return None
    return family.name, tuple(family.condition_images)


def media_count_problem(media: tuple[MediaRef, ...], wanted: tuple[str, tuple[int, int]] | None, key: str) -> str:
    """Why a row's condition media do not suit the model ('' when they do)."""
    if wanted is None:
        return ""
    family, (low, high) = wanted
    count = sum(m.role == "condition" for m in media)
    if high == 0 and count:
        return (
            f"the row carries {count} condition image(s) at {key!r} but model family {family!r} generates from text "
            "alone; use a family that takes them (flux_kontext, ...) or rows without media"
        )
    if not low <= count <= high:
        span = str(low) if low == high else f"{low} to {high}"
        return (
            f"model family {family!r} edits {span} condition image(s) per row and the row carries {count} at "
            f"{key!r}: give each row its source as {{{key!r}: [{{'role': 'condition', 'image': 'src.png'}}]}}"
        )
    return ""


def scan_prompt_file(
    path: Path, keys: PromptKeys, checks: list[LineCheck], wanted: tuple[str, tuple[int, int]] | None = None
) -> DataCount:
    """Read every row of the prompt data (any format) and check its media files, and that their number suits the
    model (`wanted`: its family and the condition images it takes); ConfigError at the first bad row (or when
    there is none)."""
    count = DataCount()
    for where, row, record in iter_prompt_rows(path, keys):
        for check in checks:
            check(where, row, record.prompt, record.metadata)
        check_media(where, keys.media, record.media)
        problem = media_count_problem(record.media, wanted, keys.media)
        if problem:
            raise ConfigError(f"{where}: {problem}")
        count.add(record.media)
    return count


def _first_row_has_image(args: Any) -> LineCheck:
    """DMD2's GAN head reads real images from the prompt data (`train_dmd2.check_gan_data`: the first row)."""
    seen = [False]

    def check(where: str, row: dict[str, Any], prompt: str, metadata: dict[str, Any]) -> None:
        if not seen[0] and "image" not in row:
            raise ConfigError(
                f"{where}: --dmd2-gan-loss-weight {args.dmd2_gan_loss_weight} needs real images but the row has "
                "no 'image' field; give rows with images (e.g. digits:sft) or set --dmd2-gan-loss-weight 0"
            )
        seen[0] = True

    return check


def scan_sft_file(path: Path, keys: PromptKeys, wanted: tuple[str, tuple[int, int]] | None = None) -> DataCount:
    """Every SFT row names its caption and an image (or video) file that exists (relative to the JSONL file), and
    every medium it carries exists, decodes and suits the model (`wanted`, as for prompt rows)."""
    count = DataCount()
    root = path.parent
    for where, _, row in iter_jsonl_objects(path, "SFT data"):
        media = check_sft_row(where, row, keys, root)
        key = "video" if "video" in row else "image"
        name = row[key]
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: {key!r} must be a file path, got {kind(name)}")
        file = root / name
        if not file.is_file():
            raise ConfigError(f"{where}: SFT {key} not found: {clip(str(file), 160)}")
        if key == "image":
            check_image(where, file, "SFT image")
        check_media(where, keys.media, media)
        problem = media_count_problem(media, wanted, keys.media)
        if problem:
            raise ConfigError(f"{where}: {problem}")
        count.add(media)
    if not count.rows:
        raise ConfigError(f"{path}: no SFT rows")
    return count


def scan_preference_file(path: Path, args: Any) -> DataCount:
    """Every preference row (offline DPO) names its caption and two different image files that exist and decode,
    and every medium it carries exists and decodes."""
    from miles.training.preference_rows import check_preference_row, preference_keys

    count = DataCount()
    for where, _, row in iter_jsonl_objects(path, "preference data"):
        parsed = check_preference_row(where, row, args, path.parent)
        for key, flag in preference_keys(args)[1:]:
            file = path.parent / row[key]
            if not file.is_file():
                raise ConfigError(f"{where}: {key!r} ({flag}) image not found: {clip(str(file), 160)}")
            check_image(where, file, "SFT image")
        check_media(where, args.media_key, parsed.media)
        count.add(parsed.media)
    if not count.rows:
        raise ConfigError(f"{path}: no preference rows")
    return count


def _sft_rows(args: Any) -> str:
    """What the method's `train sft` rows hold (the method table's `sft_rows`)."""
    from miles.methods import METHODS

    known = METHODS.get(str(args.loss_type))
    return known.sft_rows if known is not None else "image"


def _job_scores_prompts(resolved: ResolvedJob) -> bool:
    args = resolved.args
    return resolved.spec.scores and not args.train_only and args.load_debug_rollout_data is None


def check_prompt_data(resolved: ResolvedJob) -> list[str]:
    """`--prompt-data` of a job that reads it through the default data source (or as SFT rows)."""
    args = resolved.args
    spec = args.prompt_data
    job = resolved.spec
    if spec is None or _builtin(spec) or args.load_debug_rollout_data is not None:
        return []
    url = url_problem(str(spec), "SFT data" if job.trains_on_dataset else "prompt data")
    if url:
        return [f"--prompt-data {url}"]
    path = Path(str(spec)).expanduser()
    try:
        if job.trains_on_dataset and _sft_rows(args) == "preference":
            scan_preference_file(path, args)
            return []
        if job.trains_on_dataset:
            scan_sft_file(path, PromptKeys.of(args), condition_images(args))
            return []
        if args.disable_rollout_global_dataset or args.data_source_path:
            return []  # your data source reads the data its own way
        checks: list[LineCheck] = []
        reward = reward_check(args) if _job_scores_prompts(resolved) else None
        if reward is not None:
            checks.append(reward)
        if job.distills and float(args.dmd2_gan_loss_weight) > 0:
            checks.append(_first_row_has_image(args))
        scan_prompt_file(path, PromptKeys.of(args), checks, condition_images(args))
    except ConfigError as exc:
        return [f"--prompt-data {exc}{_hint(str(exc), path)}"]
    return []


def _hint(message: str, path: Path) -> str:
    """'; fix or remove that line' after a problem of one line (or row) of `path` (`path:LINE: ...`,
    `path:row N: ...`), else nothing."""
    prefix = f"{path}:"
    if not message.startswith(prefix):
        return ""
    line, sep, _ = message[len(prefix) :].partition(": ")
    return f"; {_REMEDY}" if sep and line.removeprefix("row ").isdigit() else ""


def eval_data_used(resolved: ResolvedJob) -> bool:
    """The job reads its eval sets: `miles eval`, and a training job given them (it evaluates after its last
    rollout; `miles.config.eval_schedule`)."""
    from miles.config.eval_schedule import evaluates

    return evaluates(resolved.args, resolved.spec.name)


def _eval_sets(args: Any) -> Iterator[tuple[str, str]]:
    """(label, data set spec) of every eval set."""
    if args.eval_config:
        from miles.rollout.evaluation import eval_datasets  # imports torch: only with --eval-config

        for i, dataset in enumerate(eval_datasets(args)):
            yield f"--eval-config {args.eval_config} datasets[{i}] ({dataset.name})", dataset.path
        return
    for name, spec in (args.eval_prompt_data or {}).items():
        yield f"--eval-prompt-data {name}", str(spec)


def check_eval_data(resolved: ResolvedJob) -> list[str]:
    """Every eval set the job reads: each line a prompt line with what the reward needs."""
    if not eval_data_used(resolved):
        return []
    args = resolved.args
    reward = reward_check(args)
    problems = []
    try:
        sets = list(_eval_sets(args))
    except ConfigError as exc:
        return [str(exc)]
    for label, spec in sets:
        if _builtin(spec):
            continue
        url = url_problem(spec)
        if url:
            problems.append(f"{label} {url}")
            continue
        path = Path(spec).expanduser()
        try:
            keys = PromptKeys.of(args, evaluation=True)
            scan_prompt_file(path, keys, [reward] if reward else [], condition_images(args))
        except ConfigError as exc:
            problems.append(f"{label} {exc}{_hint(str(exc), path)}")
    return problems

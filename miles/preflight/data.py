"""Data files: the prompt data, the eval sets and SFT data, streamed line by line through the reader the runtime
uses (`miles.data.prompt_file`), so a problem is the line the runtime would have stopped at, found first.

A prompt line must parse, carry a non-empty string at `--input-key` and an object (or nothing) at
`--metadata-key`, and hold what its reward needs (`miles.rewards.dispatch.check_reward_inputs`: a digit
label, a quoted OCR target). An SFT row names its caption (a non-empty string) and an image (or video) file that
exists; an image must decode (PIL's `verify`, a read of the file without decoding every pixel). Under a method whose
`train sft` rows are preferences (offline DPO, the method table's `sft_rows`), a row names its caption and two
different image files, each existing and decoding (`miles.training.preference_rows`). Built-in data sets
pass (they are generated on first use). A URL is refused as the user wrote it (only local files are read).

"; fix or remove that line" follows a problem of one line of a file (`file:LINE: ...`), never one of the file as
a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.core.errors import ConfigError
from miles.data.prompt_file import check_sft_row, iter_jsonl_objects, kind, prompt_fields, url_problem
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


def scan_prompt_file(path: Path, input_key: str, metadata_key: str | None, checks: list[LineCheck]) -> None:
    """Read every line of a prompt file; ConfigError at the first bad one (or when there is none)."""
    count = 0
    for where, _, row in iter_jsonl_objects(path):
        prompt, metadata = prompt_fields(where, row, input_key, metadata_key)
        for check in checks:
            check(where, row, prompt, metadata)
        count += 1
    if not count:
        raise ConfigError(f"{path}: no prompts (the file is empty)")


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


def scan_sft_file(path: Path, input_key: str) -> None:
    """Every SFT row names its caption and an image (or video) file that exists (relative to the JSONL file)."""
    count = 0
    for where, _, row in iter_jsonl_objects(path, "SFT data"):
        check_sft_row(where, row, input_key)
        key = "video" if "video" in row else "image"
        name = row[key]
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: {key!r} must be a file path, got {kind(name)}")
        file = path.parent / name
        if not file.is_file():
            raise ConfigError(f"{where}: SFT {key} not found: {clip(str(file), 160)}")
        if key == "image":
            _check_image(where, file)
        count += 1
    if not count:
        raise ConfigError(f"{path}: no SFT rows")


def scan_preference_file(path: Path, args: Any) -> None:
    """Every preference row (offline DPO) names its caption and two different image files that exist and decode."""
    from miles.training.preference_rows import check_preference_row, preference_keys

    count = 0
    for where, _, row in iter_jsonl_objects(path, "preference data"):
        check_preference_row(where, row, args)
        for key, flag in preference_keys(args)[1:]:
            file = path.parent / row[key]
            if not file.is_file():
                raise ConfigError(f"{where}: {key!r} ({flag}) image not found: {clip(str(file), 160)}")
            _check_image(where, file)
        count += 1
    if not count:
        raise ConfigError(f"{path}: no preference rows")


def _sft_rows(args: Any) -> str:
    """What the method's `train sft` rows hold (the method table's `sft_rows`)."""
    from miles.methods import METHODS

    known = METHODS.get(str(args.loss_type))
    return known.sft_rows if known is not None else "image"


def _check_image(where: str, file: Path) -> None:
    """ConfigError naming `where` unless PIL can read `file` as an image (`verify`: headers and checksums)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(file) as image:
            image.verify()
    except UnidentifiedImageError:
        raise ConfigError(
            f"{where}: SFT image {clip(str(file), 160)} does not decode (not an image PIL knows)"
        ) from None
    except Exception as exc:  # a damaged file: OSError, SyntaxError, ValueError, struct.error, ...
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{where}: SFT image {clip(str(file), 160)} does not decode ({clip(detail, 120)})") from None


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
            scan_sft_file(path, args.input_key)
            return []
        if args.disable_rollout_global_dataset or args.data_source_path:
            return []  # your data source reads the data its own way
        checks: list[LineCheck] = []
        reward = reward_check(args) if _job_scores_prompts(resolved) else None
        if reward is not None:
            checks.append(reward)
        if job.distills and float(args.dmd2_gan_loss_weight) > 0:
            checks.append(_first_row_has_image(args))
        scan_prompt_file(path, args.input_key, args.metadata_key, checks)
    except ConfigError as exc:
        return [f"--prompt-data {exc}{_hint(str(exc), path)}"]
    return []


def _hint(message: str, path: Path) -> str:
    """'; fix or remove that line' after a problem of one line of `path` (`path:LINE: ...`), else nothing."""
    prefix = f"{path}:"
    if not message.startswith(prefix):
        return ""
    line, sep, _ = message[len(prefix) :].partition(": ")
    return f"; {_REMEDY}" if sep and line.isdigit() else ""


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
            key = args.eval_input_key or args.input_key
            scan_prompt_file(path, key, args.metadata_key, [reward] if reward else [])
        except ConfigError as exc:
            problems.append(f"{label} {exc}{_hint(str(exc), path)}")
    return problems

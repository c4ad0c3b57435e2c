"""--load names a complete checkpoint; --output-dir, --save and the dump templates can be written."""

from __future__ import annotations

from pathlib import Path

from preflight_helpers import Job

from miles.preflight import find_problems
from miles.preflight.checkpoint import check_load, check_outputs


def _checkpoint(root: Path, step: int, parts: tuple[str, ...] = ("model.pt", "lr_scheduler.pt", "optimizer.pt")):
    folder = root / f"iter_{step:07d}"
    folder.mkdir(parents=True)
    for name in parts:
        (folder / name).write_bytes(b"x")
    (folder / "extra.json").write_text('{"rollout_id": 3}')
    (root / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
    return folder


def test_load_of_a_missing_folder(job: Job, tmp_path: Path) -> None:
    missing = tmp_path / "ckpt"
    assert find_problems(job("rl", load=str(missing))) == [f"--load {missing}: no such checkpoint directory"]


def test_load_of_an_empty_folder(job: Job, tmp_path: Path) -> None:
    empty = tmp_path / "ckpt"
    empty.mkdir()
    assert check_load(job("rl", load=str(empty))) == [
        f"--load {empty}: no latest_checkpointed_iteration.txt (not a checkpoint directory, or no save finished); "
        "pass --ckpt-step to pick one (available steps: none)"
    ]


def test_load_of_a_complete_checkpoint_passes(job: Job, tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ckpt", 3)
    assert check_load(job("rl", load=str(tmp_path / "ckpt"))) == []


def test_load_without_optimizer_state_needs_no_load_optim(job: Job, tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ckpt", 3, ("model.pt", "lr_scheduler.pt"))
    assert check_load(job("rl", load=str(tmp_path / "ckpt"))) == [
        f"--load {tmp_path / 'ckpt'}: iter_0000003 has no optimizer state (saved with --no-save-optim); "
        "add --no-load-optim"
    ]
    assert check_load(job("rl", load=str(tmp_path / "ckpt"), no_load_optim="true")) == []


def test_the_dmd2_critic_resumes_from_its_own_folder(job: Job, tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ckpt", 3)
    critic = tmp_path / "ckpt" / "critic"
    assert check_load(job("dmd2", recipe="tiny-digits-4step", load=str(tmp_path / "ckpt"))) == [
        f"--load {critic}: no such checkpoint directory"
    ]


def test_an_output_dir_under_a_regular_file(job: Job, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "run"
    assert find_problems(job("rl", output_dir=str(out))) == [
        f"--output-dir {out}: cannot be created: {blocker} is a file, not a folder; choose another --output-dir"
    ]


def test_save_that_is_a_file_and_a_dump_template_under_one(job: Job, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    template = f"{blocker}/dumps/r{{rollout_id}}.pt"
    resolved = job("rl", save=str(blocker), save_debug_rollout_data=template)
    assert check_outputs(resolved) == [
        f"--save {blocker}: is a file, not a folder; choose another --save",
        f"--save-debug-rollout-data {template} (folder {blocker / 'dumps'}): cannot be created: {blocker} is a "
        "file, not a folder; choose another --save-debug-rollout-data",
    ]


def test_writable_outputs_pass(job: Job, tmp_path: Path) -> None:
    assert check_outputs(job("rl", save=str(tmp_path / "new" / "ckpt"))) == []


def test_load_of_a_checkpoint_whose_manifest_is_damaged(job: Job, tmp_path: Path) -> None:
    import json

    folder = _checkpoint(tmp_path / "ckpt", 3)
    files = {name: {"size": (folder / name).stat().st_size} for name in ("model.pt", "lr_scheduler.pt")}
    files["model.pt"]["size"] = "abc"
    (folder / "manifest.json").write_text(json.dumps({"version": 1, "files": files}))
    assert find_problems(job("rl", load=str(tmp_path / "ckpt"))) == [
        f"--load {tmp_path / 'ckpt'}: no complete checkpoint: iter_0000003/manifest.json is not a valid manifest "
        '(the size of model.pt is "abc", not a byte count)'
    ]


def test_dump_details_under_a_file_is_one_problem(job: Job, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    dump = blocker / "x"
    assert check_outputs(job("rl", dump_details=str(dump))) == [
        f"--dump-details {dump}: cannot be created: {blocker} is a file, not a folder; choose another --dump-details"
    ]


def test_a_derived_dump_folder_is_named_under_dump_details(job: Job, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "rollout_data").write_text("")
    assert check_outputs(job("rl", dump_details=str(dump))) == [
        f"--dump-details {dump} (folder {dump / 'rollout_data'}): is a file, not a folder; choose another "
        "--dump-details"
    ]


def test_save_over_another_runs_checkpoints_is_refused_unless_resumed(job: Job, tmp_path: Path) -> None:
    """A fresh run saving into a folder of checkpoints would point the latest back to its own step 0."""
    from miles.preflight.checkpoint import check_save_over_checkpoints

    ckpt = tmp_path / "ckpt"
    assert check_save_over_checkpoints(job("rl", save=str(ckpt))) == []  # nothing there yet
    _checkpoint(ckpt, 0)
    _checkpoint(ckpt, 1)
    assert check_save_over_checkpoints(job("rl", save=str(ckpt))) == [
        f"--save {ckpt}: already holds checkpoints (steps 0, 1) of another run; resume it with --load {ckpt}, or "
        "give a new --save folder (a fresh start there would overwrite them)"
    ]
    assert check_save_over_checkpoints(job("rl", save=str(ckpt), load=str(ckpt))) == []  # resuming it


def _finished(out: Path, save: Path | None = None) -> None:
    """`out` as a run that ended with exit 0 left it (`miles.io.finished`)."""
    from types import SimpleNamespace

    from miles.io.finished import mark_finished

    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("config.yaml", "lr: 1\n"), ("metrics.jsonl", '{"rollout_id": 0}\n')):
        (out / name).write_text(text)
    mark_finished(SimpleNamespace(output_dir=str(out), save=str(save) if save else None), "train rl")


def test_an_output_dir_holding_a_finished_run_is_refused_through_a_symlink(job: Job, tmp_path: Path) -> None:
    """A finished run's folder is not written over, however it is reached; continuing it with --load of its
    --save is the one way to write there again."""
    from miles.preflight.checkpoint import check_finished_runs

    done, ckpt = tmp_path / "done", tmp_path / "ckpt"
    _finished(done, ckpt)
    link = tmp_path / "latest"
    link.symlink_to(done)
    (problem,) = check_finished_runs(job("rl", output_dir=str(link)))
    assert problem.startswith(f"--output-dir {link} (-> {done}): holds a finished train rl run (")
    assert problem.endswith(f"give a new --output-dir, or continue it with --load {ckpt}")
    assert check_finished_runs(job("rl", output_dir=str(link), load=str(ckpt), save=str(ckpt))) == []
    assert check_finished_runs(job("rl", output_dir=str(tmp_path / "new"))) == []
    # through the whole preflight, before anything is written: the finished run's files stay byte for byte
    before = {p.name: p.read_bytes() for p in done.iterdir()}
    assert any("holds a finished train rl run" in p for p in find_problems(job("rl", output_dir=str(link))))
    assert {p.name: p.read_bytes() for p in done.iterdir()} == before


def test_save_into_another_runs_output_dir_is_refused(job: Job, tmp_path: Path) -> None:
    from miles.preflight.checkpoint import check_finished_runs

    done = tmp_path / "done"
    _finished(done)
    (problem,) = check_finished_runs(job("rl", output_dir=str(tmp_path / "new"), save=str(done)))
    assert problem.startswith(f"--save {done}: is the output directory of a finished train rl run (")
    unfinished = tmp_path / "crashed"  # a run that never finished: still another run's output directory
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text("lr: 1\n")
    (unfinished / "metrics.jsonl").write_text("")
    (problem,) = check_finished_runs(job("rl", output_dir=str(tmp_path / "new"), save=str(unfinished)))
    assert problem.startswith(f"--save {unfinished}: is the output directory of another run;")
    own = tmp_path / "mine"  # --save the job's own output dir: allowed
    assert check_finished_runs(job("rl", output_dir=str(own), save=str(own))) == []


def test_a_name_the_os_refuses_is_a_problem_not_a_crash(job: Job, tmp_path: Path) -> None:
    """An OS limit (a name longer than the filesystem's 255 bytes) is a usage problem with its flag, not a check
    that could not run."""
    long = tmp_path / ("a" * 300)
    assert check_outputs(job("rl", output_dir=str(long))) == [
        f"--output-dir {long}: cannot be used (File name too long); choose another --output-dir"
    ]
    assert any("File name too long" in p for p in find_problems(job("rl", output_dir=str(long))))

"""`--pickscore-num-frames`: at least 1 (unset scores every frame), refused at parse time naming the flag."""

from __future__ import annotations

from jobs_helpers import assert_names, rejected, run


def test_pickscore_num_frames_below_one_is_refused() -> None:
    for value in (0, -2):
        assert_names(rejected(pickscore_num_frames=value), "--pickscore-num-frames", f"{value}", "minimum 1")
    assert run(pickscore_num_frames=3).args.pickscore_num_frames == 3
    assert run().args.pickscore_num_frames is None

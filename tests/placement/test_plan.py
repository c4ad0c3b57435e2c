"""The placement plan (pure): where every trainer rank, engine and reward worker goes, and the errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from miles.config.jobs import job_spec
from miles.config.resolve import resolve
from miles.core.errors import ConfigError
from miles.placement.cluster import ClusterSpec, NodeSpec, flags_cluster, parse_cluster
from miles.placement.plan import Plan, make_plan
from miles.placement.ray_placement import _units
from miles.placement.render import plan_lines
from miles_cli.main import main


def plan_of(recipe: str, cluster: str | None = None, job: str | None = None, **cli: Any) -> Plan:
    resolved = resolve(job, recipe=recipe, cli=cli)
    spec = parse_cluster(cluster) if cluster else flags_cluster(resolved.args)
    return make_plan(resolved.args, spec, resolved.spec)


def holds(plan: Plan) -> dict[tuple[int, int], list[tuple[str, int, float]]]:
    return {gpu: [(s.role, s.index, round(s.share, 4)) for s in slots] for gpu, slots in plan.by_gpu().items()}


def assert_no_gpu_above_one(plan: Plan) -> None:
    for node, gpu in plan.by_gpu():
        assert plan.gpu_total(node, gpu) <= 1.0 + 1e-9, (node, gpu)


def test_sd3_ocr_grpo_colocates_trainer_and_engines_on_two_gpus() -> None:
    plan = plan_of("sd3-ocr-grpo")
    assert holds(plan) == {
        (0, 0): [("actor", 0, 0.7), ("engine", 0, 0.25)],
        (0, 1): [("actor", 1, 0.7), ("engine", 1, 0.25)],
    }
    assert len(plan.nodes) == 1 and plan.nodes[0].gpus == 2
    assert_no_gpu_above_one(plan)


def test_sd3_pickscore_nft_gives_pickscore_its_own_gpu() -> None:
    plan = plan_of("sd3-pickscore-nft")
    assert holds(plan)[(0, 2)] == [("reward", 0, 1.0)]
    assert holds(plan)[(0, 1)] == [("actor", 1, 0.7), ("engine", 1, 0.25)]
    assert plan.num_gpus == 3
    assert_no_gpu_above_one(plan)


def test_sd35_4step_puts_critic_actor_and_engine_on_each_of_eight_gpus() -> None:
    plan = plan_of("sd35-4step")
    table = holds(plan)
    assert sorted(table) == [(0, g) for g in range(8)]
    for g in range(8):
        assert table[(0, g)] == [("actor", g, 0.35), ("critic", g, 0.35), ("engine", g, 0.25)]
    assert_no_gpu_above_one(plan)


def test_two_node_plan_fills_node_by_node() -> None:
    plan = plan_of("sd3-ocr-grpo", "2x8", actor_num_nodes=2, actor_num_gpus_per_node=8, num_gpus_per_node=8)
    ranks = {s.index: (s.node, s.gpus) for s in plan.slots_of("actor")}
    assert ranks[0] == (0, (0,)) and ranks[7] == (0, (7,)) and ranks[8] == (1, (0,)) and ranks[15] == (1, (7,))
    engines = {s.index: (s.node, s.gpus) for s in plan.slots_of("engine")}
    assert engines == ranks  # colocated engine i on rank i's GPU
    assert_no_gpu_above_one(plan)


def test_json_rows_are_node_gpu_role_index_share() -> None:
    plan = plan_of("sd3-ocr-grpo")
    assert plan.rows()[:2] == [
        {"node": 0, "gpu": 0, "role": "actor", "index": 0, "share": 0.7},
        {"node": 0, "gpu": 0, "role": "engine", "index": 0, "share": 0.25},
    ]


def test_colocated_reward_splits_its_share_between_workers_on_one_gpu() -> None:
    plan = plan_of("sd3-pickscore-nft", colocate_reward=True, pickscore_num_workers=3, num_gpus_per_node=2)
    table = holds(plan)
    assert table[(0, 0)] == [("actor", 0, 0.7), ("engine", 0, 0.25), ("reward", 0, 0.025), ("reward", 2, 0.025)]
    assert table[(0, 1)] == [("actor", 1, 0.7), ("engine", 1, 0.25), ("reward", 1, 0.05)]
    assert plan.num_gpus == 2
    assert_no_gpu_above_one(plan)


def test_fractional_reward_workers_are_packed() -> None:
    plan = plan_of(
        "sd3-pickscore-nft", pickscore_num_workers=3, pickscore_num_gpus_per_worker=0.5, num_gpus_per_node=4
    )
    table = holds(plan)
    assert table[(0, 2)] == [("reward", 0, 0.5), ("reward", 1, 0.5)]
    assert table[(0, 3)] == [("reward", 2, 0.5)]


def test_a_reward_worker_above_one_gpu_must_be_whole() -> None:
    with pytest.raises(ConfigError, match=r"--pickscore-num-gpus-per-worker 1\.5: above 1 it must be a whole"):
        plan_of("sd3-pickscore-nft", pickscore_num_gpus_per_worker=1.5, num_gpus_per_node=4)


def test_non_colocated_engines_take_free_gpus_after_the_trainer() -> None:
    plan = plan_of(
        "sd3-ocr-grpo",
        "1x8",
        colocate=False,
        lora_ipc_weight_sync=False,
        rollout_num_gpus=4,
        rollout_num_gpus_per_engine=2,
        num_gpus_per_node=8,
    )
    assert [(s.index, s.gpus, s.share) for s in plan.slots_of("engine")] == [(0, (2, 3), 1.0), (1, (4, 5), 1.0)]
    assert [(s.index, s.gpus, s.share) for s in plan.slots_of("actor")] == [(0, (0,), 1.0), (1, (1,), 1.0)]
    assert _units(plan, 0) == [(0,), (1,), (2, 3), (4, 5)]  # one bundle for each multi-GPU engine


def test_dmd2_trainers_split_a_whole_gpu_without_colocation() -> None:
    plan = plan_of("tiny-digits-4step")
    assert holds(plan) == {
        (0, 0): [("actor", 0, 0.5), ("critic", 0, 0.5)],
        (0, 1): [("engine", 0, 1.0)],
    }


def test_jobs_without_engines_place_only_the_trainer() -> None:
    assert [s.role for s in plan_of("tiny-digits-sft").slots] == ["actor"]
    assert [s.role for s in plan_of("sd3-ocr-grpo", job="rollout-only").slots] == ["engine", "engine"]
    replay = plan_of("sd3-ocr-grpo", job="replay", load_debug_rollout_data="rollout_0.pt")
    assert [s.role for s in replay.slots] == ["actor", "actor"]


def test_plan_that_does_not_fit_names_the_numbers() -> None:
    with pytest.raises(ConfigError) as excinfo:
        plan_of("sd35-4step", "1x4")
    message = str(excinfo.value)
    assert "\n" not in message
    for part in ("--actor-num-nodes 1", "--actor-num-gpus-per-node 8", "1 node x 4 GPUs (--cluster 1x4)", "4 usable"):
        assert part in message, message


def test_num_gpus_per_node_caps_each_node() -> None:
    plan_of("sd3-ocr-grpo", "1x8", actor_num_gpus_per_node=4, num_gpus_per_node=8)
    with pytest.raises(ConfigError, match="--num-gpus-per-node 4"):
        plan_of("sd3-ocr-grpo", "1x8", actor_num_gpus_per_node=8, num_gpus_per_node=4)


def test_engines_left_without_gpus_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"engine 0 of 2 .* 2 usable GPUs, 2 taken by actor x2; add --colocate"):
        plan_of("sd3-ocr-grpo", "1x2", colocate=False, lora_ipc_weight_sync=False, rollout_num_gpus=2)


def test_colocated_engine_across_nodes_is_refused_at_parse_time() -> None:
    with pytest.raises(ConfigError, match="--rollout-num-gpus-per-engine 2 must divide --actor-num-gpus-per-node 3"):
        resolve(
            "rl",
            recipe="sd3-ocr-grpo",
            cli={
                "actor_num_nodes": 2,
                "actor_num_gpus_per_node": 3,
                "num_gpus_per_node": 3,
                "rollout_num_gpus_per_engine": 2,
                "global_batch_size": 6,
                "rollout_batch_size": 6,
                "n_samples_per_prompt": 6,
            },
        )


def test_rollout_num_engines_sets_and_must_agree_with_rollout_gpus() -> None:
    args = resolve("rl", recipe="tiny-digits-grpo", cli={"rollout_num_engines": 3}).args
    assert args.rollout_num_gpus == 3
    with pytest.raises(ConfigError, match=r"--rollout-num-engines 3 .* contradicts --rollout-num-gpus 2"):
        resolve("rl", recipe="tiny-digits-grpo", cli={"rollout_num_engines": 3, "rollout_num_gpus": 2})


def test_ray_cluster_with_a_cpu_head_plans_on_the_gpu_nodes_only() -> None:
    cluster = ClusterSpec((NodeSpec(gpus=4, cpus=8, node_id="a"), NodeSpec(gpus=4, cpus=8, node_id="b")), "Ray's")
    args = resolve("rl", recipe="sd3-ocr-grpo", cli={"actor_num_nodes": 2, "num_gpus_per_node": 4}).args
    plan = make_plan(args, cluster, job_spec(args.job))
    assert {(s.index, s.node) for s in plan.slots_of("actor")} == {(0, 0), (1, 0), (2, 1), (3, 1)}


def test_plan_lines_show_one_row_per_gpu() -> None:
    lines = plan_lines(plan_of("sd3-ocr-grpo"))
    assert lines[0].startswith("placement on 1 node x 2 GPUs (the cluster the flags describe")
    assert lines[2].split() == ["0", "0", "actor", "0", "(0.70),", "engine", "0", "(0.25)", "0.95"]


def test_miles_plan_cli_json_and_errors(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["plan", "--recipe", "sd3-pickscore-nft", "--format", "json"]) == 0
    rows = [{k: v for k, v in r.items() if k != "memory"} for r in json.loads(capsys.readouterr().out)]
    assert {"node": 0, "gpu": 2, "role": "reward", "index": 0, "share": 1.0} in rows
    assert (
        main(["plan", "--recipe", "sd3-ocr-grpo", "--actor-num-gpus-per-node", "4", "--num-gpus-per-node", "2"]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exceeds --num-gpus-per-node 2" in err
    assert main(["plan", "--recipe", "sd35-4step", "--cluster", "1x4"]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main(["plan", "--recipe", "sd35-4step", "--cluster", "two"]) == 2
    assert "expected NODESxGPUS" in capsys.readouterr().err


def test_inspect_config_shows_the_plan_under_the_trainer_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect-config", "--recipe", "sd35-4step", "--cluster", "2x8"]) == 0
    out = capsys.readouterr().out
    assert out.index("critic (train dmd2)") < out.index(
        "placement on 2 nodes x 8 GPUs (--cluster 2x8): 8 GPU(s) on 1 node(s) used"
    )
    assert "actor 7 (0.35), critic 7 (0.35), engine 7 (0.25)" in out


def test_sft_refuses_encoder_gpus_it_would_not_use() -> None:
    with pytest.raises(ConfigError, match=r"--rollout-num-gpus 2 \(cli\): `miles train sft` encodes its data"):
        resolve("sft", recipe="tiny-digits-sft", cli={"rollout_num_gpus": 2})


def test_offload_flags_belong_to_the_training_loops(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect-config", "--recipe", "tiny-digits-sft", "--offload"]) == 2
    assert "--offload is for `miles train dmd2`, `miles train rl`, not `miles train sft`" in capsys.readouterr().err
    assert resolve("rl", recipe="sd3-ocr-grpo").args.offload_train is True  # derived from --colocate

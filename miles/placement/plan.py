"""The placement plan: which node and GPU(s) every trainer rank, engine and reward worker of a job gets.

One pure function of the resolved args and a cluster (`miles.placement.cluster`), computed before any
actor starts; torch- and Ray-free, so `miles plan` and `inspect-config` print it instantly.

- Trainer ranks (`actor`, and `critic` for `train dmd2`): `--actor-num-nodes` nodes with
  `--actor-num-gpus-per-node` free GPUs each, filled node by node (rank r on node r // per_node).
  Several trainer groups (DMD2's critic and actor) always share their ranks' GPUs.
- Engines: `--rollout-num-gpus-per-engine` GPUs each, on one node. Under `--colocate` engine i sits on
  the GPUs of trainer ranks [i*g, (i+1)*g); otherwise engines take free GPUs after the trainers.
- Reward workers (PickScore, `--pickscore-num-gpus-per-worker` > 0): on the rollout GPUs under
  `--colocate-reward`, else on free GPUs (fractions of one GPU are packed together).
- Shares of one GPU under `--colocate`: trainers 0.7 (split evenly between trainer groups), engine 0.25,
  reward 0.05 (split between the workers on the GPU); without colocation a slot owns its GPUs (trainer
  groups split 1.0).
- `--num-gpus-per-node` caps how many GPUs of each node the job may use.

A plan that does not fit is one `ConfigError` naming the numbers, never a wait for resources.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from miles.core.errors import ConfigError
from miles.placement.cluster import ClusterSpec, NodeSpec
from miles.rewards import reward_names

TRAIN_SHARE = 0.7
ROLLOUT_SHARE = 0.25
REWARD_SHARE = 0.05
ROLES = ("actor", "critic", "engine", "reward")
_EPS = 1e-9


@dataclass(frozen=True)
class Slot:
    """One placed actor: its role, its index (rank, engine or worker number), node, GPUs and share of each."""

    role: str
    index: int
    node: int
    gpus: tuple[int, ...]
    share: float

    @property
    def label(self) -> str:
        return f"{self.role} {self.index}"


@dataclass(frozen=True)
class Plan:
    cluster: ClusterSpec
    nodes: tuple[NodeSpec, ...]  # the nodes of the plan (an elastic cluster's as added)
    slots: tuple[Slot, ...]
    colocate: bool = False

    def slots_of(self, role: str) -> list[Slot]:
        return sorted((s for s in self.slots if s.role == role), key=lambda s: s.index)

    def rows(self) -> list[dict[str, Any]]:
        """The JSON form: one row per (slot, GPU), in (node, gpu, role order, index) order."""
        rows = [
            {"node": s.node, "gpu": gpu, "role": s.role, "index": s.index, "share": round(s.share, 6)}
            for s in self.slots
            for gpu in s.gpus
        ]
        return sorted(rows, key=lambda r: (r["node"], r["gpu"], ROLES.index(r["role"]), r["index"]))

    def by_gpu(self) -> dict[tuple[int, int], list[Slot]]:
        """(node, gpu) -> the slots on it, in role order."""
        table: dict[tuple[int, int], list[Slot]] = {}
        for row in self.rows():
            slot = next(s for s in self.slots if s.role == row["role"] and s.index == row["index"])
            table.setdefault((row["node"], row["gpu"]), []).append(slot)
        return dict(sorted(table.items()))

    def gpu_total(self, node: int, gpu: int) -> float:
        return sum(s.share for s in self.by_gpu().get((node, gpu), []))

    @property
    def num_gpus(self) -> int:
        return len(self.by_gpu())


@dataclass
class _Node:
    spec: NodeSpec
    capacity: int  # GPUs the job may use here (the node's, capped by --num-gpus-per-node)
    used: dict[int, float] = field(default_factory=dict)  # gpu -> share taken

    def free(self) -> list[int]:
        return [g for g in range(self.capacity) if g not in self.used]


class _Builder:
    def __init__(self, args: Any, cluster: ClusterSpec) -> None:
        self.args = args
        self.cluster = cluster
        self.cap = int(args.num_gpus_per_node)
        self.nodes = [_Node(spec, min(spec.gpus, self.cap)) for spec in cluster.nodes]
        self.slots: list[Slot] = []

    # ---- nodes ---------------------------------------------------------------------------------
    def _grow(self) -> _Node | None:
        if not self.cluster.elastic:
            return None
        node = _Node(NodeSpec(gpus=self.cluster.gpus_per_node), min(self.cluster.gpus_per_node, self.cap))
        self.nodes.append(node)
        return node

    def nodes_with_free(self, count: int, exclude: Iterable[int] = ()) -> Iterable[int]:
        """Node indices with `count` free GPUs, in order, growing an elastic cluster as asked."""
        skip = set(exclude)
        for k, node in enumerate(self.nodes):
            if k not in skip and len(node.free()) >= count:
                yield k
        while True:
            node = self._grow()
            if node is None or len(node.free()) < count:
                return
            yield len(self.nodes) - 1

    def take(self, k: int, count: int) -> tuple[int, ...]:
        gpus = tuple(self.nodes[k].free()[:count])
        for gpu in gpus:
            self.nodes[k].used[gpu] = 0.0
        return gpus

    def add(self, role: str, index: int, k: int, gpus: tuple[int, ...], share: float) -> None:
        for gpu in gpus:
            self.nodes[k].used[gpu] = self.nodes[k].used.get(gpu, 0.0) + share
        self.slots.append(Slot(role, index, k, gpus, share))

    # ---- errors --------------------------------------------------------------------------------
    def usage(self) -> str:
        counts: dict[str, int] = {}
        for slot in self.slots:
            counts[slot.role] = counts.get(slot.role, 0) + 1
        taken = sum(len(n.used) for n in self.nodes)
        usable = sum(n.capacity for n in self.nodes)
        placed = ", ".join(f"{role} x{n}" for role, n in counts.items())
        return f"{usable} usable GPUs, {taken} taken" + (f" by {placed}" if placed else "")

    def fail(self, what: str, hint: str = "") -> None:
        where = f"{self.cluster.describe(tuple(n.spec for n in self.nodes))}, --num-gpus-per-node {self.cap}"
        raise ConfigError(f"placement: {what} does not fit on the cluster ({where}): {self.usage()}{hint}")


def _trainer_roles(job: Any, args: Any) -> tuple[str, ...]:
    if not job.trains or args.debug_rollout_only:
        return ()
    return tuple(job.trainer_roles)


def _runs_engines(job: Any, args: Any) -> bool:
    return job.starts_engines and not args.train_only


def _reward_gpus(job: Any, args: Any) -> float:
    """GPUs per PickScore worker when the job scores with PickScore on GPUs, else 0."""
    if not job.scores or args.train_only or "pickscore" not in reward_names(args):
        return 0.0
    return float(args.pickscore_num_gpus_per_worker or 0.0)


def num_engines(args: Any) -> int:
    """Engines of a job: --rollout-num-engines, else --rollout-num-gpus / --rollout-num-gpus-per-engine
    (--rollout-num-gpus is the train world size under --colocate), else one."""
    if args.rollout_num_engines:
        return int(args.rollout_num_engines)
    if args.rollout_num_gpus:
        return max(1, int(args.rollout_num_gpus) // int(args.rollout_num_gpus_per_engine))
    return 1


def make_plan(args: Any, cluster: ClusterSpec, job: Any) -> Plan:
    """Place every trainer rank, engine and GPU reward worker of `job` (`miles.config.jobs.job_spec(args.job)`)."""
    b = _Builder(args, cluster)
    colocate = bool(args.colocate)
    roles = _trainer_roles(job, args)
    per_node = int(args.actor_num_gpus_per_node)
    world = int(args.actor_num_nodes) * per_node

    # 1. The trainer GPUs (under --colocate also the engines' GPUs, even with no trainer in the job).
    rank_gpus: list[tuple[int, int]] = []  # rank -> (node, gpu)
    if roles or (colocate and _runs_engines(job, args)):
        chosen: list[int] = []
        for k in b.nodes_with_free(per_node):
            chosen.append(k)
            if len(chosen) == int(args.actor_num_nodes):
                break
        if len(chosen) < int(args.actor_num_nodes):
            b.fail(
                f"the trainer ({per_node} GPUs on each of {args.actor_num_nodes} node(s): --actor-num-nodes "
                f"{args.actor_num_nodes} x --actor-num-gpus-per-node {per_node})"
            )
        for k in chosen:
            rank_gpus.extend((k, gpu) for gpu in b.take(k, per_node))
    train_share = (TRAIN_SHARE if colocate and _runs_engines(job, args) else 1.0) / max(1, len(roles))
    for role in roles:
        for rank, (k, gpu) in enumerate(rank_gpus):
            b.add(role, rank, k, (gpu,), train_share)

    # 2. Engines.
    engine_gpus: list[tuple[int, int]] = []
    if _runs_engines(job, args):
        g = int(args.rollout_num_gpus_per_engine)
        n = num_engines(args)
        if colocate:
            if n * g != world:
                raise ConfigError(
                    f"placement: --colocate puts one engine on every {g} trainer GPU(s) "
                    f"(--rollout-num-gpus-per-engine {g}), i.e. {world // g} engines on the {world} trainer GPUs, "
                    f"not {n} (--rollout-num-engines {args.rollout_num_engines})"
                )
            for i in range(n):
                span = rank_gpus[i * g : (i + 1) * g]
                if len({k for k, _ in span}) != 1:
                    raise ConfigError(
                        f"placement: engine {i} would span nodes: --rollout-num-gpus-per-engine {g} must divide "
                        f"--actor-num-gpus-per-node {per_node} under --colocate (an engine's GPUs are on one node)"
                    )
                b.add("engine", i, span[0][0], tuple(gpu for _, gpu in span), ROLLOUT_SHARE)
                engine_gpus.extend(span)
        else:
            for i in range(n):
                k = next(iter(b.nodes_with_free(g)), None)
                if k is None:
                    b.fail(
                        f"engine {i} of {n} ({g} GPU(s) on one node: --rollout-num-gpus-per-engine {g})",
                        "; add --colocate to share the trainer's GPUs, or lower --rollout-num-gpus",
                    )
                gpus = b.take(k, g)
                b.add("engine", i, k, gpus, 1.0)
                engine_gpus.extend((k, gpu) for gpu in gpus)

    # 3. GPU reward workers.
    per_worker = _reward_gpus(job, args)
    if per_worker > 0:
        _place_rewards(b, args, per_worker, engine_gpus)

    for node in b.nodes:
        for gpu, total in node.used.items():
            if total > 1.0 + _EPS:  # pragma: no cover - an invariant of the builder
                raise AssertionError(f"GPU {gpu} planned at {total}")
    used_nodes = tuple(n.spec for n in b.nodes)
    if cluster.elastic:
        used_nodes = tuple(n.spec for n in b.nodes if n.used)
    return Plan(cluster, used_nodes, tuple(b.slots), colocate)


def _place_rewards(b: _Builder, args: Any, per_worker: float, engine_gpus: list[tuple[int, int]]) -> None:
    workers = int(args.pickscore_num_workers)
    if args.colocate_reward:
        if not engine_gpus:
            raise ConfigError(
                "placement: --colocate-reward puts reward workers on the rollout GPUs, and no engine runs"
            )
        counts: dict[tuple[int, int], int] = {}
        for w in range(workers):
            where = engine_gpus[w % len(engine_gpus)]
            counts[where] = counts.get(where, 0) + 1
        for w in range(workers):
            k, gpu = engine_gpus[w % len(engine_gpus)]
            b.add("reward", w, k, (gpu,), REWARD_SHARE / counts[(k, gpu)])
        return
    if per_worker >= 1:
        if per_worker != int(per_worker):
            raise ConfigError(
                f"--pickscore-num-gpus-per-worker {per_worker:g}: above 1 it must be a whole number of GPUs "
                "(Ray shares fractions of one GPU only)"
            )
        count = int(per_worker)
        for w in range(workers):
            k = next(iter(b.nodes_with_free(count)), None)
            if k is None:
                b.fail(f"reward worker {w} of {workers} ({count} GPU(s): --pickscore-num-gpus-per-worker {count})")
            b.add("reward", w, k, b.take(k, count), 1.0)
        return
    opened: list[tuple[int, int]] = []  # GPUs given to reward workers, packed with fractions
    for w in range(workers):
        spot = next(((k, g) for k, g in opened if b.nodes[k].used[g] + per_worker <= 1.0 + _EPS), None)
        if spot is None:
            k = next(iter(b.nodes_with_free(1)), None)
            if k is None:
                b.fail(f"reward worker {w} of {workers} (--pickscore-num-gpus-per-worker {per_worker:g})")
            spot = (k, b.take(k, 1)[0])
            opened.append(spot)
        b.add("reward", w, spot[0], (spot[1],), per_worker)

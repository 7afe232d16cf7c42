"""The MOPD student sharded with FSDP2 across Ray workers (`distill.trainer_workers` > 1).

    ShardedStudent (driver)        the Student's interface; `model` is a full CPU copy of the
                                   trained weights: what the engine loads and `save` writes
      TrainerWorker × N (Ray)      one rank each of a process group: gloo on CPU, NCCL on CUDA
          load                     `Student.load` with the model `fully_shard`ed per decoder sublayer
                                   (attention, MLP or MoE) and at the root: its AdamW over the shards
          train_step               its share of the step's rollouts in length-sorted micro-batches,
                                   each micro-batch's loss weighted by its share of the whole step's
                                   tokens; FSDP sums the gradients of all ranks; clip to the full
                                   norm; AdamW; the MoE bias from every rank's routed tokens
          full_state_dict          rank 0 gathers the full weights (the others return {})

Summing (not averaging) the ranks' gradients of token-share-weighted losses gives the gradient of
the one-process step: the parameters after a step match those of `Student` (tests: to 1e-5).
"""

from __future__ import annotations

import socket
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from mopd.cluster import connect_ray
from mopd.distill.scorer import TeacherScores
from mopd.distill.student import (
    Student,
    collate,
    gradient_shares,
    length_sorted_micro_batches,
    orm_advantages,
    step_metrics,
    token_weights,
)
from mopd.model import is_k3
from mopd.recipe import DistillSpec
from mopd.rollout.episodes import Rollout

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
PLACEMENT_TIMEOUT_S = 300  # a cluster that autoscales may take minutes to add the GPUs


# ----------------------------------------------------------------------------- the driver
class ShardedStudent(Student):
    """Trains on N Ray workers; holds a full CPU copy of the student, refreshed after every step."""

    def __init__(self, workers, group, model, tokenizer, spec: DistillSpec):
        super().__init__(model, tokenizer, optimizer=None, spec=spec)
        self.workers, self.group = workers, group

    @classmethod
    def load(
        cls, model_dir: Path, spec: DistillSpec, reference_dir: Path, device: str = "cpu", ray_address: str | None = None
    ) -> ShardedStudent:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import mopd.model  # noqa: F401  (registers the K3 hybrid)

        connect_ray(ray_address)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        group = reserve_workers(spec.trainer_workers, device)
        actor = ray.remote(TrainerWorker)
        workers = [
            actor.options(
                num_cpus=1, num_gpus=1 if device == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            ).remote(rank, spec.trainer_workers, device)
            for rank in range(spec.trainer_workers)
        ]  # fmt: skip
        student = cls(workers, group, model, tokenizer, spec)
        try:
            address = ray.get(workers[0].rendezvous_address.remote())
            ray.get([w.load.remote(address, str(model_dir), spec, str(reference_dir)) for w in workers])
        except BaseException:
            student.close()
            raise
        return student

    def train_step(self, rollouts: list[Rollout], scores: list[TeacherScores], cells: list[str]) -> dict:
        """`Student.train_step` with the rollouts dealt out to the ranks (strided over the length order,
        so every rank gets long and short ones)."""
        full = collate(rollouts, scores, self.model.config.pad_token_id or 0)
        orm = orm_advantages(rollouts, cells)
        weights = token_weights(rollouts, cells, self.spec.balance_tokens)
        order = sorted(range(len(rollouts)), key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].token_ids))
        shares = [order[rank :: len(self.workers)] for rank in range(len(self.workers))]
        passes = max(len(length_sorted_micro_batches([rollouts[i] for i in rows], self.spec.micro_batch_tokens)) for rows in shares)
        idle = (rollouts[order[0]], scores[order[0]])
        results = ray.get([
            worker.train_step.remote([rollouts[i] for i in rows], [scores[i] for i in rows], orm[rows], weights[rows], passes, idle)
            for worker, rows in zip(self.workers, shares, strict=True)
        ])  # fmt: skip
        train_logprobs = torch.zeros_like(full.rollout_logprobs)
        for rows, result in zip(shares, results, strict=True):
            for i, logprobs in zip(rows, result["logprobs"], strict=True):
                train_logprobs[i, : len(logprobs)] = logprobs
        self.model.load_state_dict(self.full_state_dict())
        return {
            "loss": sum(r["loss"] for r in results),
            "grad_norm": results[0]["grad_norm"],
            **step_metrics(rollouts, cells, full, train_logprobs, self.spec),
            **gradient_shares(rollouts, cells, weights),
            **results[0]["moe"],
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return ray.get([w.full_state_dict.remote() for w in self.workers])[0]

    def optimizer_state(self) -> dict:
        """The full optimizer state in `Student`'s format (parameters by their index in the model):
        a checkpoint resumes on any number of workers."""
        by_name = ray.get([w.optimizer_state.remote() for w in self.workers])[0]
        return renamed(by_name, {name: i for i, name in enumerate(parameter_names(self.model))})

    def set_learning_rate(self, learning_rate: float) -> None:
        ray.get([w.set_learning_rate.remote(learning_rate) for w in self.workers])

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        remove_placement_group(self.group)
        self.workers = []


def reserve_workers(count: int, device: str):
    """A placement group of one CPU (and a GPU on cuda) per rank: the ranks start all together or
    not at all (a rank left waiting for resources would hang the others in the rendezvous)."""
    bundle = {"CPU": 1, **({"GPU": 1} if device == "cuda" else {})}
    group = placement_group([bundle] * count)
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"distill.trainer_workers: {count} workers of {bundle} each did not fit in the Ray cluster "
            f"in {PLACEMENT_TIMEOUT_S} s (it has {ray.cluster_resources()})"
        )
    return group


# ----------------------------------------------------------------------------- one rank
class TrainerWorker:
    """One rank: a `Student` whose model is sharded with FSDP2 over the process group."""

    def __init__(self, rank: int, world_size: int, device: str):
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")  # Ray shows each actor its GPU as 0

    def rendezvous_address(self) -> str:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def load(self, address: str, model_dir: str, spec: DistillSpec, reference_dir: str) -> None:
        """`Student.load` with the model sharded over the group; ExOPD's reference is a full copy on every
        rank (each scores its own rows)."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=address, rank=self.rank, world_size=self.world_size)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.student = Student.load(
            model_dir, spec, reference_dir, self.device,
            place=lambda model: shard(model, mesh), restore_optimizer=restore_sharded_optimizer,
        )  # fmt: skip

    def train_step(
        self, rollouts: list[Rollout], scores: list[TeacherScores], orm: torch.Tensor, row_weights: torch.Tensor,
        passes: int, idle: tuple[Rollout, TeacherScores],
    ) -> dict:  # fmt: skip
        """This rank's micro-batches (each row's tokens at its weight in the whole step's loss), then zero-weight
        passes up to `passes`: FSDP's gathers and reductions are collectives, every rank must run as many."""
        student, model = self.student, self.student.model
        pad_id = model.config.pad_token_id or 0
        student.optimizer.zero_grad(set_to_none=True)
        loss_sum, logprobs = 0.0, [torch.empty(0)] * len(rollouts)
        micro_batches = length_sorted_micro_batches(rollouts, student.spec.micro_batch_tokens) if rollouts else []
        for n, rows in enumerate(micro_batches + [None] * (passes - len(micro_batches))):
            model.set_requires_gradient_sync(n == passes - 1)  # one reduction a step, after the last pass
            if rows is None:
                self.idle_pass(*idle)
                continue
            batch = collate([rollouts[i] for i in rows], [scores[i] for i in rows], pad_id).to(self.device)
            loss, train_logprobs = student.micro_batch_loss(batch, [scores[i] for i in rows], orm[rows], row_weights[rows])
            loss.backward()
            loss_sum += float(loss.detach())
            for row, i in enumerate(rows):
                logprobs[i] = train_logprobs[row, : len(rollouts[i].token_ids)].detach().cpu()
        grad_norm = clip_full_norm(model, student.spec.max_grad_norm)
        student.optimizer.step()
        share_router_records(model)
        moe = model.update_moe_bias() if hasattr(model, "update_moe_bias") else {}  # K3: quantile balancing
        return {"loss": loss_sum, "grad_norm": grad_norm, "logprobs": logprobs, "moe": moe}

    def idle_pass(self, rollout: Rollout, scores: TeacherScores) -> None:
        """A forward and backward that adds nothing: zero loss weight, and the routers in eval mode so
        its tokens are not counted as the step's expert load."""
        routers = self.student.model.routers().values() if hasattr(self.student.model, "routers") else []
        batch = collate([rollout], [scores], self.student.model.config.pad_token_id or 0).to(self.device)
        for router in routers:
            router.train(False)
        try:
            loss, _ = self.student.micro_batch_loss(batch, [scores], torch.zeros(1))
            (loss * 0.0).backward()
        finally:
            for router in routers:
                router.train(True)

    def set_learning_rate(self, learning_rate: float) -> None:
        self.student.set_learning_rate(learning_rate)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = get_model_state_dict(self.student.model, options=FULL)
        return state if self.rank == 0 else {}

    def optimizer_state(self) -> dict:
        state = get_optimizer_state_dict(self.student.model, self.student.optimizer, options=FULL)
        return state if self.rank == 0 else {}


def restore_sharded_optimizer(model, optimizer, path: Path) -> None:
    """A checkpoint's optimizer state (`Student`'s format: parameters by index) into this rank's shards."""
    by_name = renamed(torch.load(path, weights_only=True), dict(enumerate(parameter_names(model))))
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def parameter_names(model) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def renamed(optimizer_state: dict, rename: dict) -> dict:
    """An optimizer state dict with its parameter keys mapped: torch's indices ↔ the FQNs of
    `torch.distributed.checkpoint.state_dict`."""
    return {
        "state": {rename[key]: value for key, value in optimizer_state["state"].items()},
        "param_groups": [{**group, "params": [rename[p] for p in group["params"]]} for group in optimizer_state["param_groups"]],
    }


def shard(model, mesh) -> None:
    """FSDP2: each decoder layer's attention and its MLP or MoE are units, the rest (embeddings, head,
    norms, AttnRes queries) is the root's. Not the whole layer: it returns nothing (it advances the
    residual state in place), and FSDP gathers a unit's weights again for backward from a hook on its
    output tensors. Gradients are summed over ranks (each rank's loss is already weighted by its
    share of the step); experts no token of a rank picked still join the reduction, with zero grads.
    Any other architecture: each decoder layer (its `_no_split_modules` class) is a unit."""
    if is_k3(model.config):
        for layer in model.model.layers:
            fully_shard(layer.self_attn, mesh=mesh)
            fully_shard(layer.mlp if layer.mlp is not None else layer.block_sparse_moe, mesh=mesh)
    else:
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for unit in model.modules():  # these two setters act on one unit, not on the units inside it
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (the divide factor's default op)
    model.set_reduce_scatter_unused_params(True)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The modules transformers keeps whole across devices (`_no_split_modules`): a stock model's decoder layers."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers to shard (its _no_split_modules is {sorted(names)})")
    return layers


def clip_full_norm(model, max_norm: float) -> float:
    """`clip_grad_norm_` on the norm of the full gradient (each rank holds DTensor shards of it)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


def share_router_records(model) -> None:
    """Give every rank's routers the whole step's records (summed load, all tokens' scores), so each
    rank applies the same balancing update to its replica of the bias. (K3 only: other models have none.)"""
    for router in (model.routers().values() if hasattr(model, "routers") else []):
        bias = router.e_score_correction_bias
        load = router.step_load if router.step_load is not None else torch.zeros_like(bias)
        dist.all_reduce(load)
        router.step_load = load
        if router.balance == "quantile":
            local = torch.cat(router.step_scores) if router.step_scores else bias.new_zeros((0, len(bias)))
            router.step_scores = [all_gather_rows(local)]


def all_gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, concatenated in rank order (ranks may hold different numbers of rows)."""
    counts = [torch.zeros(1, dtype=torch.long, device=local.device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(local)], device=local.device))
    width = int(max(counts))
    padded = local.new_zeros((width, *local.shape[1:]))
    padded[: len(local)] = local
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded)
    return torch.cat([rows[: int(n)] for rows, n in zip(gathered, counts, strict=True)])

"""Global-batch contrastive losses under DDP: 2 gloo processes reproduce the single-process computation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from coretune import distributed, objectives
from coretune.memory import CrossBatchMemory
from coretune.mining import mine_hard_pairs
from coretune.pretrain.losses import global_moco_v3_infonce, global_nt_xent, moco_v3_infonce, nt_xent

D, K = 8, 3
#: (case name, objective, hyper-parameters, rows per rank)
CASES: list[tuple[str, str, dict[str, Any], tuple[int, int]]] = [
    ("core", "core", {}, (6, 6)),
    ("core_unequal", "core", {}, (5, 3)),
    ("ce_con", "ce_con", {}, (6, 6)),
    ("ce_con_mixh", "ce_con_mixh", {}, (6, 6)),
    ("scl", "scl", {}, (6, 6)),
    ("bi_tuning", "bi_tuning", {"momentum_backbone": False, "queue_size": 4}, (6, 6)),
]


def _batch(sizes: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """Features, labels and inputs of the global batch (rank 0's rows first)."""
    g = torch.Generator().manual_seed(sum(sizes))
    n = sum(sizes)
    return torch.randn(n, D, generator=g), torch.arange(n) % K, torch.randn(n, 5, generator=g)


def _rows(sizes: tuple[int, int], rank: int | None) -> slice:
    return slice(None) if rank is None else slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def _objective_case(name: str, hparams: dict[str, Any], sizes: tuple[int, int], rank: int | None) -> dict[str, Any]:
    """One step of objective ``name`` on the rows of ``rank`` (``None``: the whole batch in one process)."""
    z_all, y_all, _ = _batch(sizes)
    torch.manual_seed(1)
    obj = objectives.create(name, D, K, **hparams)
    rows = _rows(sizes, rank)
    z = z_all[rows].clone().requires_grad_()
    torch.manual_seed(7)  # the engine seeds every step identically on all processes
    out = obj(z, y_all[rows])
    out.loss.backward()
    result = {
        "gathers": obj.gathers,
        "loss": out.loss.detach(),
        "terms": out.terms,
        "logits": out.logits.detach(),
        "z_grad": z.grad,
        "param_grads": {n: p.grad for n, p in obj.named_parameters()},
        "buffers": {n: b.clone() for n, b in obj.named_buffers()},
    }
    if name == "core":
        torch.manual_seed(7)
        z_global = distributed.gather_rows(z.detach())
        pairs = mine_hard_pairs(z_global, distributed.gather_rows(y_all[rows]), K)
        result["pairs"] = {k: v for k, v in vars(pairs).items() if k != "pos_features" and k != "neg_features"}
    return result


class _Model(nn.Module):
    """A linear "backbone" and an objective, as :class:`coretune.engine.FineTuner` chains them."""

    def __init__(self, objective: str) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.backbone = nn.Linear(5, D)
        self.objective = objectives.create(objective, D, K)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        z = self.backbone(x)
        if self.objective.gathers:
            z = distributed.scale_grad(z, distributed.world_size())
        return self.objective(z, y).loss


def _ddp_case(objective: str, sizes: tuple[int, int], rank: int | None) -> dict[str, Tensor]:
    """Parameter gradients of :class:`_Model` after backward (and DDP's averaging when ``rank`` is given)."""
    _, y_all, x_all = _batch(sizes)
    model = _Model(objective)
    net = DistributedDataParallel(model) if rank is not None else model
    rows = _rows(sizes, rank)
    torch.manual_seed(7)
    net(x_all[rows], y_all[rows]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _simclr_case(rank: int | None) -> dict[str, Tensor]:
    """SimCLR's loss and (DDP-averaged) gradients of a linear embedding, 4 + 4 image pairs (``None``: all 8 in
    one process). One forward of both views, as ``SimCLR.contrastive_loss``."""
    g = torch.Generator().manual_seed(3)
    x1, x2 = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    torch.manual_seed(2)
    model = nn.Linear(5, 4)
    net = DistributedDataParallel(model) if rank is not None else model
    rows = _rows((4, 4), rank)
    z1, z2 = net(torch.cat([x1[rows], x2[rows]])).chunk(2)
    loss = global_nt_xent(z1, z2, 0.5)
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


def _moco_v3_case(rank: int | None) -> dict[str, Tensor]:
    """MoCo v3's symmetric loss (``MoCoV3.contrastive_loss``) of a linear query network against a linear key network
    (no gradient), 4 + 4 image pairs (``None``: all 8 in one process): each process's queries against the keys of
    both; its loss and the DDP-averaged gradients of the query network."""
    g = torch.Generator().manual_seed(4)
    x1, x2 = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    torch.manual_seed(5)
    model, keys = nn.Linear(5, 4), nn.Linear(5, 4).requires_grad_(False)
    net = DistributedDataParallel(model) if rank is not None else model
    rows = _rows((4, 4), rank)
    q1, q2 = net(x1[rows]), net(x2[rows])
    k1, k2 = keys(x1[rows]), keys(x2[rows])
    loss = global_moco_v3_infonce(q1, k2, 0.2) + global_moco_v3_infonce(q2, k1, 0.2)
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


#: (rows per rank) of the three steps of :func:`_memory_case`: unequal, and more rows than the memory holds.
MEMORY_STEPS = ((3, 2), (4, 4), (2, 5))


def _memory_case(gather: bool, rank: int | None) -> dict[str, Any]:
    """Three steps of ``core`` with a 10-row memory on the rows of ``rank`` (``None``: the global batches in one
    process): the memory's state after each step and each step's loss."""
    torch.manual_seed(1)
    obj = objectives.create("core", D, K, memory=CrossBatchMemory(10, warmup_steps=0), gather=gather)
    states, losses = [], []
    for sizes in MEMORY_STEPS:
        z_all, y_all, _ = _batch(sizes)
        rows = _rows(sizes, rank)
        torch.manual_seed(7)
        losses.append(obj(z_all[rows], y_all[rows]).loss.detach())
        states.append({n: b.clone() for n, b in obj.memory.state_dict().items()})
    return {"states": states, "losses": losses}


def _worker(rank: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    try:
        results: dict[str, Any] = {
            "world_size": distributed.world_size(),
            "rank": distributed.rank(),
            "sizes": distributed.batch_sizes(3 + rank),
        }
        for case, name, hparams, sizes in CASES:
            results[case] = _objective_case(name, hparams, sizes, rank)
        results["ddp_core"] = _ddp_case("core", (6, 6), rank)
        results["simclr"] = _simclr_case(rank)
        results["moco_v3"] = _moco_v3_case(rank)
        results["memory"] = {gather: _memory_case(gather, rank) for gather in (True, False)}
        torch.save(results, Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(str(folder),), nprocs=2, join=True)
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _close(a: Tensor, b: Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.ddp
def test_process_group_helpers(ranks: list[dict[str, Any]]) -> None:
    assert [(r["world_size"], r["rank"]) for r in ranks] == [(2, 0), (2, 1)]
    assert ranks[0]["sizes"] == ranks[1]["sizes"] == [3, 4]


@pytest.mark.ddp
@pytest.mark.parametrize(("case", "name", "hparams", "sizes"), CASES, ids=[c[0] for c in CASES])
def test_gathered_loss_and_feature_gradients_equal_the_full_batch(
    ranks: list[dict[str, Any]], case: str, name: str, hparams: dict[str, Any], sizes: tuple[int, int]
) -> None:
    single = _objective_case(name, hparams, sizes, None)
    assert not single["gathers"] and all(r[case]["gathers"] for r in ranks)
    for rank, result in enumerate(ranks):
        rows = _rows(sizes, rank)
        out = result[case]
        assert _close(out["loss"], single["loss"]), (rank, float(out["loss"]), float(single["loss"]))
        assert out["terms"].keys() == single["terms"].keys()
        assert all(_close(out["terms"][k], single["terms"][k]) for k in single["terms"])
        assert out["logits"].shape == (sizes[rank], K)  # the local rows, for the engine's train metrics
        assert _close(out["logits"], single["logits"][rows])
        assert _close(out["z_grad"], single["z_grad"][rows])  # d loss / d own rows, no sum over ranks
        for param, grad in single["param_grads"].items():  # heads see every row: the full gradient
            assert _close(out["param_grads"][param], grad), param
        for buffer, value in single["buffers"].items():  # Bi-tuning's queues hold every rank's keys
            assert _close(out["buffers"][buffer].float(), value.float()), buffer


@pytest.mark.ddp
def test_global_mining_draws_agree_across_ranks(ranks: list[dict[str, Any]]) -> None:
    z_all, y_all, _ = _batch((6, 6))
    torch.manual_seed(7)
    single = vars(mine_hard_pairs(z_all, y_all, K))
    for result in ranks:
        for key, value in result["core"]["pairs"].items():
            assert torch.equal(value, single[key]), key


@pytest.mark.ddp
def test_ddp_averaged_parameter_gradients_equal_the_full_batch(ranks: list[dict[str, Any]]) -> None:
    single = _ddp_case("core", (6, 6), None)
    for result in ranks:
        grads = result["ddp_core"]
        assert grads.keys() == single.keys()
        for name, grad in single.items():
            assert _close(grads[name], grad), name


@pytest.mark.ddp
def test_simclr_contrasts_the_global_batch_with_the_single_process_gradients(ranks: list[dict[str, Any]]) -> None:
    single = _simclr_case(None)
    for result in ranks:  # both processes: the loss of all 16 views, and the full-batch gradients after DDP
        assert result["simclr"].keys() == single.keys()
        for name, value in single.items():
            assert _close(result["simclr"][name], value), name
    per_process = _simclr_case_local()
    assert not _close(per_process, single["loss"])  # the per-process loss (4 pairs) differs: not a tautology


@pytest.mark.ddp
def test_moco_v3_scores_each_process_queries_against_the_global_keys(ranks: list[dict[str, Any]]) -> None:
    single = _moco_v3_case(None)
    # each process: the loss of its own 4 queries against all 8 keys; their mean is the single-process loss, and
    # DDP's average of the gradients the single-process gradients (moco-v3's concat_all_gather)
    torch.testing.assert_close(sum(r["moco_v3"]["loss"] for r in ranks) / 2, single["loss"])
    for result in ranks:
        for name in ("weight", "bias"):
            assert _close(result["moco_v3"][name], single[name]), name
    g = torch.Generator().manual_seed(4)
    x1, x2 = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    torch.manual_seed(5)
    model, keys = nn.Linear(5, 4), nn.Linear(5, 4)
    with torch.no_grad():  # process 1's loss by hand: its queries' positives are keys 4-7 of the gathered 8
        own = moco_v3_infonce(model(x1[4:]), keys(x2), 0.2, 4) + moco_v3_infonce(model(x2[4:]), keys(x1), 0.2, 4)
    torch.testing.assert_close(ranks[1]["moco_v3"]["loss"], own)


def _simclr_case_local() -> Tensor:
    g = torch.Generator().manual_seed(3)
    x1, x2 = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    torch.manual_seed(2)
    z1, z2 = nn.Linear(5, 4)(torch.cat([x1[:4], x2[:4]])).chunk(2)
    return nt_xent(z1, z2, 0.5).detach()


def test_single_process_helpers_are_identities() -> None:
    z = torch.randn(4, 3, requires_grad=True)
    y = torch.tensor([0, 1, 0, 1])
    assert distributed.world_size() == 1 and distributed.rank() == 0 and not distributed.is_distributed()
    assert distributed.gather_with_grad(z) is z and distributed.gather_rows(y) is y
    assert distributed.batch_sizes(4) == [4]
    features, labels, rows = distributed.gather_batch(z, y)
    assert features is z and labels is y and rows == slice(0, 4)
    assert not objectives.create("core").gathers  # gather=True, but a single process


def test_scale_grad_is_identity_forward_and_scales_backward() -> None:
    z = torch.randn(4, 3, requires_grad=True)
    out = distributed.scale_grad(z, 3.0)
    assert torch.equal(out, z)
    (out * torch.arange(3.0)).sum().backward()
    assert torch.equal(z.grad, 3.0 * torch.arange(3.0).expand(4, 3))


@pytest.mark.parametrize("name", ["core", "ce_con", "ce_con_mixh", "scl", "bi_tuning"])
def test_contrastive_objectives_gather_by_default_and_can_opt_out(name: str) -> None:
    assert objectives.create(name).gather is True
    assert objectives.create(name, gather=False).gather is False


@pytest.mark.ddp
@pytest.mark.parametrize("gather", [True, False], ids=["global-loss", "per-process-loss"])
def test_every_process_holds_the_same_memory_filled_with_the_global_batch(
    ranks: list[dict[str, Any]], gather: bool
) -> None:
    """With or without the global loss, the memory is written with every process's rows in rank order: the same
    queue on both processes, and the one a single process builds from the global batches (wrapping around)."""
    single = _memory_case(True, None)
    for step, sizes in enumerate(MEMORY_STEPS):
        want = single["states"][step]
        assert int(want["filled"]) == min(10, sum(sum(s) for s in MEMORY_STEPS[: step + 1]))
        for result in ranks:
            got = result["memory"][gather]["states"][step]
            for name, value in want.items():
                assert torch.equal(got[name], value), (step, sizes, name)
    if gather:  # and the same loss as one process on the global batch, step after step
        for result in ranks:
            assert all(map(_close, result["memory"][True]["losses"], single["losses"]))

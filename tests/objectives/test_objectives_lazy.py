"""Objectives made with ``num_classes=`` (and ``feature_dim=``) for a plain PyTorch loop: heads built at once or
at the first call, the same numbers as ``.build()``, the optimiser rule, and no new hyper-parameter or CLI flag."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path

import pytest
import torch
from torch import nn

from coretune import objectives
from coretune.cli import main
from coretune.objectives import CETuning, CoreTuning, Objective

Factory = Callable[..., nn.Module]
LABELS = torch.tensor([0, 1, 2, 0, 1, 2])


def _step(obj: Objective, backbone: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss of one seeded training call and its gradients w.r.t. the objective's parameters."""
    obj.generator = torch.Generator().manual_seed(0)
    out = obj(backbone(x), LABELS, inputs=x)
    grads = torch.autograd.grad(out.loss, [p for p in obj.parameters() if p.requires_grad], allow_unused=True)
    return out.loss.detach(), [torch.zeros(()) if g is None else g for g in grads]


@pytest.mark.parametrize("name", sorted(objectives.available()))
def test_a_lazily_built_objective_gives_the_numbers_of_a_built_one(name: str, tiny_backbone: Factory) -> None:
    backbone = tiny_backbone(16)
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    built = objectives.create(name, 16, 3)
    built.attach_backbone(backbone)
    lazy = objectives.create(name, num_classes=3)
    lazy.attach_backbone(backbone)
    for objective in (built, lazy):
        if objective.needs_class_counts:  # logit adjustment: the training priors, as a fit observes them
            objective.observe_class_counts(torch.tensor([6, 3, 1]))
    assert not lazy.is_built and lazy.num_classes is None
    torch.manual_seed(5)  # the heads' initialisation draws from the global generator, as build() does
    logits = lazy.predict(backbone(x))  # the dry call that builds the heads
    assert logits.shape == (6, 3) and lazy.is_built and (lazy.feature_dim, lazy.num_classes) == (16, 3)
    assert lazy.state_dict().keys() == built.state_dict().keys()
    for key, value in built.state_dict().items():
        torch.testing.assert_close(lazy.state_dict()[key], value, rtol=0, atol=0, msg=key)
    loss_built, grads_built = _step(built, backbone, x)
    loss_lazy, grads_lazy = _step(lazy, backbone, x)
    assert loss_lazy.item() == loss_built.item()
    for got, want in zip(grads_lazy, grads_built, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_first_training_call_builds_the_heads_too() -> None:
    obj = CoreTuning(num_classes=3, proj_dim=8)
    obj.generator = torch.Generator().manual_seed(0)
    out = obj(features=torch.randn(6, 5), labels=LABELS)  # keywords reach the hook as well
    assert obj.is_built and obj.feature_dim == 5 and obj.projector is not None
    assert torch.isfinite(out.loss) and out.logits.shape == (6, 3)
    assert not obj._forward_pre_hooks  # the hook goes once the heads exist


def test_feature_dim_builds_the_heads_at_once() -> None:
    obj = CoreTuning(num_classes=4, feature_dim=12, eta=0.5)
    assert obj.is_built and obj.classifier.weight.shape == (4, 12)
    reference = objectives.create("core", 12, 4, eta=0.5)
    assert [p.shape for p in obj.parameters()] == [p.shape for p in reference.parameters()]


def test_the_optimiser_made_after_the_dry_call_trains_the_heads() -> None:
    encoder = nn.Linear(10, 6)
    obj = CoreTuning(num_classes=3, proj_dim=4)
    with pytest.raises(RuntimeError, match=r"give feature_dim= when making it, or call it once"):
        obj.parameters().__next__()
    with pytest.raises(RuntimeError, match=r"builds its heads at its first call: call it once"):
        objectives.create("rifle", num_classes=3).on_train_epoch_start(1, 4)  # a hook that needs the heads
    x = torch.randn(6, 10)
    obj.predict(encoder(x))  # the dry call
    optimizer = torch.optim.SGD([*encoder.parameters(), *obj.parameters()], lr=0.5)
    before = {name: p.detach().clone() for name, p in obj.named_parameters()}
    assert "classifier.weight" in before and any(name.startswith("projector.") for name in before)
    obj.generator = torch.Generator().manual_seed(0)
    obj(encoder(x), LABELS).loss.backward()
    optimizer.step()
    changed = {name for name, p in obj.named_parameters() if not torch.equal(p, before[name])}
    assert changed == set(before)  # every head, the projector's included, is in the optimiser and stepped


def test_the_heads_take_the_objectives_dtype_and_the_features_device() -> None:
    obj = CETuning(num_classes=2).double()
    obj.predict(torch.randn(3, 4, dtype=torch.float64))
    assert obj.classifier.weight.dtype == torch.float64
    plain = CETuning(num_classes=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed precision: bf16 features, float32 heads
        logits = plain.predict(torch.randn(3, 4).to(torch.bfloat16))
    assert logits.dtype == torch.bfloat16
    assert plain.classifier.weight.dtype == torch.float32 and plain.classifier.weight.device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_heads_are_made_on_the_features_device() -> None:
    obj = CoreTuning(num_classes=3, proj_dim=4)
    obj.generator = torch.Generator().manual_seed(0)  # the miner draws on the CPU
    out = obj(torch.randn(6, 5, device="cuda"), LABELS.cuda())
    assert obj.classifier.weight.is_cuda and obj.projector.net[0].weight.is_cuda and out.loss.is_cuda


@pytest.mark.parametrize("name", sorted(objectives.available()))
def test_the_sizes_are_not_hyper_parameters_nor_cli_flags(name: str) -> None:
    cls, _ = objectives.get(name)
    assert not {"num_classes", "feature_dim"} & set(inspect.signature(cls).parameters)  # what jsonargparse reads
    assert objectives.create(name, 8, 3).hparams() == objectives.create(name).hparams()


def test_coretune_fit_refuses_a_num_classes_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["fit", "--objective", "core", "--objective.num_classes=3"])
    assert info.value.code == 2 and "Option 'num_classes' is not accepted" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"feature_dim": 8}, r"CoreTuning\(feature_dim=8\) needs num_classes= too"),
        ({"num_classes": 0}, r"num_classes must be an int >= 1, got 0"),
        ({"num_classes": 2.5}, r"num_classes must be an int >= 1, got 2.5"),
        ({"num_classes": 3, "feature_dim": 0}, r"feature_dim and num_classes must be >= 1, got 0 and 3"),
    ],
)
def test_bad_sizes_are_refused_at_construction(sizes: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CoreTuning(**sizes)


def test_a_first_call_without_b_by_d_features_is_refused() -> None:
    with pytest.raises(ValueError, match=r"expected \(B, d\) features, got shape \(2, 3, 4, 4\)"):
        CETuning(num_classes=2).predict(torch.randn(2, 3, 4, 4))


def test_building_a_lazy_objective_for_other_classes_is_refused() -> None:
    obj = CoreTuning(num_classes=3)
    with pytest.raises(ValueError, match=r"made with num_classes=3, but its heads are built for 5 classes"):
        obj.build(16, 5)
    obj.build(16, 3)  # the engine's path (FineTuner builds from the data): the same classes are fine
    assert obj.is_built and not obj._forward_pre_hooks and len(list(obj.parameters())) > 0


def test_an_objective_with_its_own_num_classes_argument_keeps_it() -> None:
    class Own(Objective):
        def __init__(self, num_classes: int = 1) -> None:
            super().__init__()
            self.own = num_classes

    class Inherits(CETuning):
        pass

    assert Own(num_classes=4).own == 4 and not Own(num_classes=4).is_built
    assert Inherits(num_classes=2, feature_dim=3).classifier.weight.shape == (2, 3)


def test_the_docs_python_examples_run(tiny_backbone: Factory) -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "objectives.md").read_text(encoding="utf-8")
    (section,) = re.findall(r"## Using an objective\n(.*?)\n## ", text, flags=re.S)
    made, lazy = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    backbone = tiny_backbone(16)
    namespace = {"torch": torch, "backbone": backbone, "x": torch.randn(6, 3, 8, 8), "y": LABELS}
    namespace |= {"feature_dim": 16, "num_classes": 3}
    exec(compile(made, "docs/objectives.md", "exec"), namespace)
    obj = namespace["obj"]
    assert isinstance(obj, objectives.L2SP) and obj.hparams() == {"alpha": 0.1, "beta": 0.01, "label_smoothing": 0.0}
    assert obj.classifier.weight.grad is not None
    exec(compile(lazy, "docs/objectives.md", "exec"), namespace)
    obj, optimizer = namespace["obj"], namespace["optimizer"]
    assert isinstance(obj, CoreTuning) and obj.feature_dim == 16
    optimised = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert {id(p) for p in obj.parameters()} <= optimised


def test_a_copy_of_a_lazy_objective_builds_its_own_heads_once() -> None:
    original = CoreTuning(num_classes=3, proj_dim=4)
    copy = deepcopy(original)
    copy.predict(torch.randn(6, 5))
    weight = copy.classifier.weight.detach().clone()
    copy.generator = torch.Generator().manual_seed(0)
    copy(torch.randn(6, 5), LABELS)  # built already: the call builds nothing again
    assert torch.equal(copy.classifier.weight, weight) and copy.feature_dim == 5
    assert not original.is_built
    original.predict(torch.randn(2, 7))
    assert original.feature_dim == 7


def test_the_engine_builds_a_lazy_objective_for_its_data_or_names_the_mismatch() -> None:
    from coretune.engine.module import FineTuner

    model = FineTuner(CoreTuning(num_classes=3), backbone="small_cnn")
    model.build(3)  # FineTuner sizes the heads from its data and backbone
    assert model.objective.is_built and model.objective.feature_dim == model.backbone.feature_dim
    with pytest.raises(ValueError, match=r"made with num_classes=3, but its heads are built for 4 classes"):
        FineTuner(CoreTuning(num_classes=3), backbone="small_cnn").build(4)


@pytest.mark.parametrize("name", sorted(objectives.available()))
def test_every_head_is_made_on_the_features_device(name: str) -> None:
    # the meta device stands in for a GPU: a head left on the CPU would show here, Bi-tuning's key head included
    obj = objectives.create(name, num_classes=3)
    logits = obj.predict(torch.randn(6, 16, device="meta"))
    assert logits.device.type == "meta"
    tensors = [*obj.parameters(), *obj.buffers()]
    tensors += [p for head in getattr(obj, "_key_projector", []) for p in head.parameters()]
    assert tensors and {t.device.type for t in tensors} == {"meta"}

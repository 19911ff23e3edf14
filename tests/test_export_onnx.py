"""`coretune export --onnx true`: model.onnx beside the other formats, and onnxruntime computes the PyTorch logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from coretune.cli import main
from coretune.engine import FineTuner

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last checkpoint of one epoch of `coretune fit` on a tiny tree, at 32 px."""
    from image_trees import make_image_tree

    base = tmp_path_factory.mktemp("onnx")
    tree, run_dir = make_image_tree(base / "data"), base / "run"
    main(
        [
            "fit",
            f"--data.root={tree}",
            "--data.image_size=32",
            "--data.batch_size=8",
            "--model.backbone=small_cnn",
            "--trainer.max_epochs=1",
            f"--run_dir={run_dir}",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
        ]
    )
    return run_dir / "checkpoints" / "last.ckpt"


def test_onnx_export_matches_the_pytorch_model(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "export"
    main(["export", f"--ckpt_path={checkpoint}", f"--output={out}", "--onnx=true"])
    names = ["model.safetensors", "config.json", "model.pt2", "model.torchscript.pt", "model.onnx"]
    assert capsys.readouterr().out.splitlines() == [str(out / name) for name in names]
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # the weights are inside model.onnx

    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (images_input,), (logits_output,) = session.get_inputs(), session.get_outputs()
    assert (images_input.name, logits_output.name) == ("images", "logits")
    assert isinstance(images_input.shape[0], str) and images_input.shape[1:] == [3, 32, 32]  # dynamic batch
    model = FineTuner.from_checkpoint(checkpoint).eval()
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for batch in (1, 3):
        with torch.no_grad():
            expected = model(images[:batch])
        (logits,) = session.run(None, {"images": images[:batch].numpy()})
        assert logits.shape == (batch, 3)
        torch.testing.assert_close(torch.from_numpy(logits), expected, atol=1e-4, rtol=1e-4)


def test_onnx_is_not_written_unless_asked(checkpoint: Path, tmp_path: Path) -> None:
    main(["export", f"--ckpt_path={checkpoint}", f"--output={tmp_path}", "--exported_program=false"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "model.torchscript.pt"]


def test_missing_onnx_packages_are_one_line_naming_the_extra(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # `import onnxscript` raises ImportError
    with pytest.raises(SystemExit) as info:
        main(["export", f"--ckpt_path={checkpoint}", f"--output={tmp_path / 'export'}", "--onnx=true"])
    assert info.value.code == (
        "coretune export: error: ONNX export needs the onnx extra (onnxscript is not installed): "
        "pip install 'coretune[onnx]'"
    )
    assert not (tmp_path / "export").exists()  # refused before anything is written

"""The package as a user installs it: a wheel built from the source, installed into a fresh virtual environment
with its core dependencies only (no extra), runs ``coretune --version``, a tiny ``coretune fit`` and imports the
losses; each command that needs an extra says which one, in one line, before any work.

The fresh environment gets no download: it sees the core dependencies' closure (the wheel's own ``Requires-Dist``,
followed through this environment's installed metadata) through a ``.pth`` file pointing at a folder of links to
exactly those distributions — a package the wheel forgot to declare, or an extra imported by the core, fails here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from coretune.cli import main

REPO = Path(__file__).resolve().parents[1]

#: The core, and nothing else (torchmetrics and huggingface_hub: lightning's and timm's own, which we import).
CORE = {
    "torch", "torchvision", "lightning", "jsonargparse", "timm", "safetensors", "rich", "pillow", "numpy", "pyyaml",
    "torchmetrics", "huggingface-hub",
}  # fmt: skip
EXTRAS = {
    "demo", "plots", "bench", "tune", "tune-postgres", "cluster", "onnx", "robust", "peft", "docs", "tensorboard",
    "mlflow", "wandb", "all", "dev",
}  # fmt: skip


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the source (the build writes nothing into the checkout) as the README's users
    build it, ``python -m build --wheel`` (without isolation: the build backend of this environment, no download)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out, source],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (built,) = out.glob("coretune-*.whl")
    return built


def _requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in message.get_all("Requires-Dist") or []]


def test_the_wheel_declares_a_lean_core_and_one_extra_per_job(wheel: Path) -> None:
    requires = _requires(wheel)
    core = {_name(r.name) for r in requires if r.marker is None}
    assert core == CORE
    extras = {m.group(1) for r in requires if r.marker and (m := re.search(r'extra == "([\w-]+)"', str(r.marker)))}
    assert extras == EXTRAS


def _closure(requirements: list[Requirement]) -> set[str]:
    """The installed distributions the core requirements pull in, followed through their own requirements (markers
    evaluated for this interpreter, extras of the core requirements included)."""
    seen: set[str] = set()
    todo = [(r, frozenset()) for r in requirements if r.marker is None]
    while todo:
        req, extras = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
            continue
        name = _name(req.name)
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # not needed here (a marker-free dependency of a platform we do not run)
        seen.add(name)
        todo += [(Requirement(r), frozenset(req.extras)) for r in dist.requires or []]
    return seen


@pytest.fixture(scope="module")
def core_env(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed and only the core's closure importable; its python."""
    env = tmp_path_factory.mktemp("core-env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env], check=True, timeout=120)
    python = env / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
        check=True, capture_output=True, text=True, timeout=300, env=_clean_env(),
    )  # fmt: skip
    links = tmp_path_factory.mktemp("core-site")
    for name in _closure(_requires(wheel)):
        dist = metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            target = Path(dist.locate_file(top))
            if target.exists() and not (links / top).exists() and not top.endswith(".pth"):
                (links / top).symlink_to(target)
    (site,) = (env / "lib").glob("python3*/site-packages")
    (site / "core-dependencies.pth").write_text(f"{links}\n")
    return python


def _clean_env() -> dict[str, str]:
    """This environment without what would show the fresh one other packages (``PYTHONPATH``, an active venv)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([python, *args], cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=300)


def test_the_core_install_lacks_every_extra(core_env: Path, tmp_path: Path) -> None:
    extras = ["sklearn", "scipy", "matplotlib", "optuna", "onnx", "torchattacks", "peft", "mlflow", "wandb"]
    extras += ["tensorboard"]
    code = f"import importlib.util as u; print([m for m in {[*extras, 'psutil', 'pytest']} if u.find_spec(m)])"
    done = _run(core_env, "-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_core_install_runs_version_losses_and_a_tiny_fit(core_env: Path, image_tree: Path, tmp_path: Path) -> None:
    from coretune import __version__

    coretune = core_env.parent / "coretune"
    done = _run(coretune, "--version", cwd=tmp_path)
    assert (done.returncode, done.stdout.strip()) == (0, f"coretune {__version__}"), done.stderr
    code = "import torch, coretune.losses as L; print(tuple(L.core_positive_mask(torch.tensor([0, 0, 1])).shape))"
    done = _run(core_env, "-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = _run(
        coretune, "fit", f"--data.root={image_tree}", "--model.backbone=small_cnn", "--data.image_size=16",
        "--data.batch_size=4", "--trainer.max_epochs=1", "--trainer.enable_progress_bar=false",
        f"--run_dir={tmp_path / 'run'}", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "results.json").is_file()
    assert not list((tmp_path / "run").glob("*.png"))
    assert "coretune: figures not drawn: matplotlib is not installed (pip install 'coretune[plots]')" in done.stderr


@pytest.mark.parametrize(
    ("blocked", "args", "what", "extra"),
    [
        ("sklearn", ["demo"], "coretune demo", "demo"),
        ("optuna", ["tune", "--", "--data.root", "x"], "coretune tune", "tune"),
        ("scipy", ["bench", "SPEC"], "coretune bench", "bench"),
        ("matplotlib", ["bench", "SPEC"], "coretune bench", "bench"),
        (
            "onnxruntime",
            ["export", "--ckpt_path", "CKPT", "--format", "onnx", "--output", "OUT"],
            "ONNX export",
            "onnx",
        ),
    ],
)
def test_a_command_that_needs_a_missing_extra_names_it_in_one_line(
    blocked: str, args: list[str], what: str, extra: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, blocked, None)  # import raises ImportError, as when it is not installed
    monkeypatch.chdir(tmp_path)
    spec, ckpt, out = tmp_path / "spec.yaml", tmp_path / "model.ckpt", tmp_path / "out"
    spec.write_text(f"output: {out}\nobjectives: [ce]\ndatasets:\n  d: ['--data.root={tmp_path}']\n")
    ckpt.write_bytes(b"")
    args = [{"SPEC": str(spec), "CKPT": str(ckpt), "OUT": str(out)}.get(a, a) for a in args]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    message = f"{what} needs {blocked}, which is not installed: pip install 'coretune[{extra}]'"
    assert exit_.value.code == f"coretune {args[0]}: error: {message}"
    assert not out.exists()


def test_the_losses_and_objectives_import_with_torch_and_numpy_alone(tmp_path: Path) -> None:
    """``import coretune.losses`` / ``coretune.objectives`` for a user's own training loop: no Lightning, timm,
    torchvision, jsonargparse, Pillow, rich, PyYAML, safetensors, torchmetrics or Hugging Face Hub."""
    others = ["lightning", "pytorch_lightning", "timm", "torchvision", "jsonargparse", "PIL", "rich", "yaml"]
    others += ["safetensors", "torchmetrics", "huggingface_hub"]
    code = (
        f"import sys\nfor m in {others}: sys.modules[m] = None\n"
        "import torch, coretune.losses, coretune.objectives\n"
        "loss = coretune.objectives.CoreTuning()\nprint(type(loss).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "CoreTuning"), done.stderr[-2000:]

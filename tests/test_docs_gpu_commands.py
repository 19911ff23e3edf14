"""The GPU commands of the docs (README's "On a GPU, on several", docs/scaling.md's one node, torchrun and SLURM)
stay commands that run: each is read from the page, its GPU-only values replaced through :data:`SUBSTITUTIONS`
(documented there), and parsed by ``coretune fit --print_config`` (every flag and value checked, nothing run);
the single-GPU one is also run on the CPU on a tiny tree, torchrun's own flags are parsed by torchrun's parser, and
the SLURM script's task counts are checked against its trainer flags, as the page says they must match."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from coretune.cli import main

REPO = Path(__file__).resolve().parent.parent

#: What replaces each GPU- or cluster-only word of a documented command before it is parsed here (keys are
#: whole words; a value of None drops the flag and its value). ``...`` (the options a user adds) stands for data.
SUBSTITUTIONS: dict[str, str | None] = {
    "DATA/inaturalist18": "{data}",
    "/shared/inaturalist18": "{data}",
    "$NODE_RANK": "0",
    "$MASTER:29500": "localhost:29500",
}
#: Flags whose documented values need hardware this test has not: replaced by ones that parse and run on a CPU.
ON_CPU = {
    "--trainer.accelerator": "cpu",
    "--trainer.devices": "1",
    "--trainer.num_nodes": "1",
    "--trainer.strategy": "auto",
}
TINY = ["--data.image_size=16", "--data.batch_size=8", "--model.backbone=small_cnn", "--trainer.max_epochs=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]  # fmt: skip


def section(path: Path, heading: str) -> str:
    """The text of ``path`` from the heading line that starts with ``heading`` to the next heading."""
    text = path.read_text()
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def readme_commands() -> list[str]:
    """The README section's inline commands: those that start with ``coretune`` or with a flag (options added to the
    previous command)."""
    spans = re.findall(r"`([^`]+)`", section(REPO / "README.md", "## On a GPU"))
    commands = [span for span in spans if span.startswith("coretune ")]
    flags = [span.replace("[", "").replace("]", "") for span in spans if span.startswith("--trainer.strategy")]
    assert commands and flags, "the README's GPU section lost its commands"
    return commands + [f"coretune fit ... {extra}" for extra in flags]


def scaling_blocks() -> dict[str, str]:
    """docs/scaling.md's bash blocks, each with its continuation lines joined, by the heading above it."""
    text = (REPO / "docs" / "scaling.md").read_text()
    blocks: dict[str, str] = {}
    heading = ""
    for part in re.split(r"(```bash\n.*?```)", text, flags=re.S):
        if part.startswith("```bash"):
            blocks[heading] = part.removeprefix("```bash\n").removesuffix("```").replace("\\\n", " ")
        elif titles := re.findall(r"^#+ (.+)$", part, flags=re.M):
            heading = titles[-1]
    return blocks


def fit_arguments(command: str, data: Path) -> list[str]:
    """The words after ``fit`` of one documented command, substituted for this machine."""
    for word, value in SUBSTITUTIONS.items():
        command = command.replace(word, value or "")
    words = shlex.split(re.sub(r"\s#.*$", "", command).replace("{data}", str(data)))
    words = words[words.index("fit") + 1 :]
    if "..." in words:
        words[words.index("...")] = f"--data.root={data}"
    out: list[str] = []
    skip = False
    for i, word in enumerate(words):
        if skip:
            skip = False
            continue
        flag = word.partition("=")[0]
        if flag in ON_CPU:
            skip = "=" not in word and i + 1 < len(words)
            if ON_CPU[flag] is not None:
                out.append(f"{flag}={ON_CPU[flag]}")
            continue
        out.append(REPO.joinpath(word).as_posix() if word.startswith("configs/") else word)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from image_trees import make_image_tree

    return make_image_tree(tmp_path_factory.mktemp("gpu_docs") / "data", per_class=4, val_per_class=2, size=16)


def documented_fits(data: Path) -> dict[str, list[str]]:
    commands = {f"README: {c}": c for c in readme_commands()}
    for heading, block in scaling_blocks().items():
        for line in block.splitlines():
            if re.search(r"(coretune|-m coretune\.cli) fit", line):
                commands[f"docs/scaling.md, {heading}: {line.strip()[:60]}"] = line
    assert len(commands) >= 6, sorted(commands)
    return {name: fit_arguments(command, data) for name, command in commands.items()}


def test_every_documented_gpu_command_parses_with_its_flags(data: Path, capsys: pytest.CaptureFixture) -> None:
    distinct = {tuple(arguments): name for name, arguments in documented_fits(data).items()}  # one parse each
    for arguments, name in distinct.items():
        with pytest.raises(SystemExit) as done:
            main(["fit", *arguments, f"--run_dir={data.parent / 'run'}", "--print_config"])
        assert done.value.code in (0, None), f"{name}: {capsys.readouterr().err[-2000:]}"
        assert "trainer:" in capsys.readouterr().out, name


def test_the_single_gpu_command_runs_on_the_cpu(data: Path, tmp_path: Path) -> None:
    (command,) = [c for c in readme_commands() if "--trainer.accelerator gpu" in c and "..." in c][:1]
    main(["fit", *fit_arguments(command, data), *TINY, f"--run_dir={tmp_path / 'run'}"])
    assert (tmp_path / "run" / "results.json").is_file()


def test_torchruns_flags_are_torchruns() -> None:
    from torch.distributed.run import get_args_parser

    (block,) = [b for h, b in scaling_blocks().items() if "torchrun" in h]
    line = next(line for line in block.splitlines() if line.startswith("torchrun"))
    for word, value in SUBSTITUTIONS.items():
        line = line.replace(word, value or "")
    words = shlex.split(line)[1:]
    parsed = get_args_parser().parse_args(words)
    assert parsed.module and parsed.training_script == "coretune.cli"
    trainer = dict(re.findall(r"--trainer\.(devices|num_nodes) (\d+)", line))
    assert parsed.nproc_per_node == trainer["devices"] and parsed.nnodes == trainer["num_nodes"]


def test_the_slurm_scripts_tasks_match_its_trainer_flags() -> None:
    (block,) = [b for h, b in scaling_blocks().items() if h.startswith("SLURM")]
    sbatch = dict(re.findall(r"#SBATCH --([\w-]+)=(\S+)", block))
    trainer = dict(re.findall(r"--trainer\.(devices|num_nodes) (\d+)", block))
    assert sbatch["ntasks-per-node"] == trainer["devices"] == sbatch["gpus-per-node"]
    assert sbatch["nodes"] == trainer["num_nodes"]
    assert re.search(r"^srun coretune fit ", block, flags=re.M)

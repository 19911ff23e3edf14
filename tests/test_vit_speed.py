"""benchmarks/vit_speed.py (issue 64): its ``--smoke`` run times every variant through the engine's step, with the
variant's settings in effect (layer-decay groups, EMA updates by the averaging callback, LoRA's frozen backbone),
and writes the JSON record and the Markdown table docs/benchmarks.md quotes; bad options are refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def vit_speed(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = load_benchmark("vit_speed", monkeypatch)
    threads = torch.get_num_threads()
    yield module
    torch.set_num_threads(threads)


def test_smoke_run_times_every_variant_with_its_settings_in_effect(vit_speed: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    # as the benchmark is run: its own process. (A smoke run at 8 px and batch 4 came out NaN in about 1 run of 8,
    # alone too: ResNet-18's BatchNorm over 4 values a channel at 1x1 maps; the smoke is now batch 16 at 32 px.)
    script = ROOT / "benchmarks" / "vit_speed.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--threads", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "vit_speed.json").read_text())
    rows = {(r["backbone"], r["variant"]): r for r in record["rows"]}
    expected = {(b, v) for b in vit_speed.BACKBONES for v in vit_speed.VARIANTS} - {("resnet18", "ce+lora")}
    assert set(rows) == expected
    assert "ViT" in record["skipped"]["resnet18 ce+lora"]
    rounds = record["warmup_rounds"] + record["timed_rounds"]
    assert (record["timed_rounds"], rounds) == (1, 2)  # 2 steps of each
    for (backbone, variant), row in rows.items():
        ce = rows[(backbone, "ce")]
        assert len(row["steps_ms"]) == 1 and row["ms_per_step"] > 0
        assert row["ratio_to_ce"] == pytest.approx(row["ms_per_step"] / ce["ms_per_step"])
        # each variant's option took effect on the step timed
        if variant == "ce+layer_decay":  # timm's groups: a few per layer, against CE's backbone + heads
            assert row["param_groups"] > 2 * ce["param_groups"]
        else:
            assert row["param_groups"] == ce["param_groups"] == 2
        if variant == "ce+ema":  # the averaging callback updated after every optimiser step
            assert row["ema_updates"] == rounds and row["ema_update_ms"] > 0
        else:
            assert row["ema_updates"] is None and row["ema_update_ms"] is None
        if variant == "ce+lora":  # the backbone frozen but for LoRA's A and B on each block's qkv
            assert row["trainable_tensors"] < ce["trainable_tensors"]
        if variant == "core":  # Core-tuning's projection head trains too
            assert row["trainable_tensors"] > ce["trainable_tensors"]
    assert rows[("vit_tiny", "ce")]["ratio_to_ce"] == 1.0
    table = (tmp_path / "vit_speed.md").read_text().splitlines()
    assert sum(line.startswith("| vit_tiny |") for line in table) == 5
    assert sum(line.startswith("| resnet18 |") for line in table) == 4


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--variants", "core"], "--variants must include ce"), (["--repeats", "0"], "--repeats must be >= 1")],
)
def test_bad_options_are_refused_in_one_line(
    vit_speed: ModuleType, argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        vit_speed.main(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err.splitlines()[-1]

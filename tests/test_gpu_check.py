"""benchmarks/gpu_check.py (issue 62): its ``--smoke`` run on CPU (the same code as on a GPU, tiny models), so the
check cannot rot before it next runs on a GPU; and its ratios, targets, budget and refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from benchmark_scripts import load_benchmark


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    yield load_benchmark("gpu_check", monkeypatch)  # with benchmarks/ on sys.path: its package, gpucheck
    for name in [n for n in sys.modules if n == "gpucheck" or n.startswith("gpucheck.")]:
        del sys.modules[name]


@pytest.mark.ddp  # its DDP row starts 2 gloo processes
def test_smoke_run_writes_every_measurement_as_json_and_a_markdown_table(gpu_check: ModuleType, tmp_path: Path) -> None:
    assert gpu_check.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["mode"] == "smoke"
    assert {"python", "torch", "cuda", "cudnn", "gpus", "cpu_cores", "lightning", "timm"} <= set(result["environment"])
    rows = result["measurements"]
    models = [spec.label for spec in gpu_check.SMOKE_MODELS]
    for model in models:  # every model: bare loop, CE and Core fits in bf16; fp16; compiled
        mine = {(r["runner"], r["objective"], r["precision"], r["compile"]) for r in rows if r["model"] == model}
        assert mine == {
            ("bare", None, "bf16-mixed", False),
            ("fit", "ce", "bf16-mixed", False),
            ("fit", "core", "bf16-mixed", False),
            ("bare", None, "16-mixed", False),
            ("fit", "ce", "16-mixed", False),
            ("bare", None, "bf16-mixed", True),
            ("fit", "ce", "bf16-mixed", True),
        }
    compiles = gpu_check.steps.fine_tuner_takes_compile()
    for row in rows:
        if row["runner"] == "fit" and row["compile"] and not compiles:  # before FineTuner(compile=...) exists
            assert row["status"] == "skipped: this coretune's FineTuner has no compile setting"
            continue
        assert row["status"] == "ok", row
        assert row["images_per_s"] > 0 and row["step_ms"] > 0 and row["peak_memory_gib"] is None  # no GPU
        if row["compile"]:
            assert row["compile_status"] == "compiled"
    assert result["loader"]["status"] == "ok" and result["loader"]["images_per_s"] > 0
    assert result["loader"]["num_workers"] == 0  # auto without CUDA
    assert result["ddp"]["status"] == "ok" and result["ddp"]["images_per_s"] > 0 and result["ddp"]["global_mining"]
    for model in models:
        ratios = result["ratios"][model]
        assert ratios["fit_ce_over_bare"] > 0 and ratios["core_time_over_ce"] > 0 and ratios["loader_over_model"] > 0
        assert ratios["fp16_over_bf16_fit_ce"] > 0 and ratios["compiled_over_eager_bare"] > 0
    assert len(result["targets"]) == 3 * len(models) and all(t["met"] is None for t in result["targets"])

    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown.startswith("# coretune GPU check (smoke)\n")
    assert "they measure nothing" in markdown
    header = "| model | run | objective | precision | compile | images/s | ms/step | peak GPU GiB | status |"
    table = markdown.split(header + "\n")[1].split("\n\n")[0].splitlines()
    assert table[0].startswith("|---") and len(table) == 1 + len(rows)
    assert sum("`coretune fit` | core | bf16-mixed" in line for line in table) == len(models)
    assert "Loader alone (16 px, batch 8, num_workers auto = 0" in markdown
    assert "DDP, 2 processes, Core-tuning with global mining: ok" in markdown
    assert markdown.count("| n/a (no GPU) |") == 3 * len(models)


def test_targets_are_judged_against_the_issues_bounds_on_a_gpu_only(gpu_check: ModuleType) -> None:
    report = gpu_check.report

    def row(runner: str, objective: str | None, rate: float, precision: str = "bf16-mixed") -> dict:
        return dict(model="m", runner=runner, objective=objective, precision=precision, compile=False,
                    images_per_s=rate, status="ok")  # fmt: skip

    rows = [
        row("bare", None, 1000.0),
        row("fit", "ce", 960.0),
        row("fit", "core", 900.0),
        row("fit", "ce", 1200, "16-mixed"),
    ]
    rows.append(row("bare", None, 5.0) | {"compile": True, "status": "error: RuntimeError: x"})  # failed: no ratio
    ratios = gpu_check.steps_ratios(rows, {"images_per_s": 1500.0}, "m")
    assert ratios["fit_ce_over_bare"] == 0.96
    assert ratios["core_time_over_ce"] == round(960 / 900, 3)  # 1.067: Core costs 6.7 % more per image
    assert ratios["fp16_over_bf16_fit_ce"] == 1.25 and ratios["compiled_over_eager_bare"] is None
    assert ratios["loader_over_model"] == 1.25  # against the fastest CE fit, the fp16 one
    verdicts = {v["check"].split(" ")[0]: v for v in report.verdicts({"m": ratios}, on_gpu=True)}
    assert [(v["value"], v["met"]) for v in verdicts.values()] == [(0.96, True), (1.067, False), (1.25, False)]
    assert all(v["met"] is None for v in report.verdicts({"m": ratios}, on_gpu=False))


def test_a_failed_row_is_recorded_and_rows_past_the_budget_are_skipped(gpu_check: ModuleType) -> None:
    check = gpu_check.Check(budget_s=60)

    def fails() -> dict:
        raise RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB")

    assert check.run("a", fails) == {"status": "error: RuntimeError: CUDA out of memory."}
    assert check.run("b", lambda: {"images_per_s": 1.0}) == {"images_per_s": 1.0, "status": "ok"}
    assert check.errors == 1
    spent = gpu_check.Check(budget_s=0)
    spent.start -= 1
    assert spent.run("c", lambda: {"images_per_s": 1.0}) == {"status": "skipped: time budget of 0 s spent"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="refuses only without a GPU")
def test_without_a_gpu_it_says_to_pass_smoke(gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        gpu_check.parse_args([])
    assert stopped.value.code == 2
    assert "no CUDA GPU here: run it on a GPU machine, or pass --smoke" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--smoke", "--steps", "0"])
    assert "--steps must be >= 1 (got 0)" in capsys.readouterr().err

"""``quiet_lightning``: Lightning output no user can act on is dropped, everything else stays."""

from __future__ import annotations

import logging
import warnings

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from coretune.engine import quiet_lightning


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_quiet_lightning_drops_the_cloud_logging_tip_only() -> None:
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    quiet_lightning()
    quiet_lightning()  # idempotent: one filter, not two
    assert sum(type(f).__name__ == "_DropCloudLoggingTip" for f in log.filters) == 1
    collect, level = _Collect(), log.level
    log.addHandler(collect)
    log.setLevel(logging.INFO)
    try:
        rank_zero_info(
            "💡 Tip: For seamless cloud logging, try installing [litlogger](https://pypi.org/project/litlogger/)"
        )
        rank_zero_info("GPU available: False, used: False")
    finally:
        log.removeHandler(collect)
        log.setLevel(level)
    assert collect.messages == ["GPU available: False, used: False"]


def test_quiet_lightning_keeps_other_warnings() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_lightning()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", DeprecationWarning, stacklevel=1)
        warnings.warn("LightningCLI's args parameter is intended to run from within Python", UserWarning, stacklevel=1)
        warnings.warn(
            "Precision bf16-mixed is not supported by the model summary.  Estimated model size in MB will not be "
            "accurate. Using 32 bits instead.",
            UserWarning,
            stacklevel=1,
        )
        warnings.warn("something the user should see", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something the user should see"]

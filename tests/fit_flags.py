"""Command-line flags shared by the tests that run ``coretune fit`` and ``coretune pretrain``."""

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
"""No progress bar or model summary in the tests' output."""

TINY_FIT = [
    "--model.backbone=small_cnn",
    "--data.image_size=16",
    "--data.batch_size=8",
    "--trainer.max_epochs=1",
    "--trainer.enable_model_summary=false",
]
"""A fit of one epoch of a small CNN on 16 px images: seconds on a CPU (add ``--data.root``)."""

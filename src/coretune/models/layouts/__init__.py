"""Checkpoint layouts: one module per convention a trainer saves its encoder in, each registered with
:func:`~coretune.models.checkpoints.register_layout`.

A *layout* extracts the backbone tensors from a loaded checkpoint (``extract(raw, encoder) -> Extraction | None``,
None where its entries or prefixes are absent); :func:`~coretune.models.checkpoints.load_pretrained` tries every
layout (or the one ``--model.weights_options.format`` names) and keeps the one that matches the most backbone keys.
Importing :mod:`coretune.models` imports this package, which registers them all in :data:`DETECTION_ORDER` (the
order of ``list_layouts()``, of the messages, and the tie-break between layouts that match equally well).

Add a checkpoint layout
-----------------------
Write one file here, ``mytrainer.py``, holding one function under the decorator, and name it in
:data:`DETECTION_ORDER`::

    from ..checkpoints import Extraction, extract_prefixed, register_layout

    @register_layout("mytrainer", "MyTrainer: state_dict with 'module.student.'; its head dropped")
    def mytrainer(raw, encoder) -> Extraction | None:
        return extract_prefixed(
            raw, ("state_dict",), ("module.student.", "student."), ("head",), encoder.body.state_dict().keys()
        )

:func:`~coretune.models.checkpoints.extract_prefixed` covers the common case (an entry, a prefix, heads to drop);
a layout that renames keys (``sequential``, ``simclrv2``) post-processes its result. Outside coretune, the same
decorator registers a layout from any module imported before loading (after the built-in ones in detection order).
"""

from __future__ import annotations

from importlib import import_module

DETECTION_ORDER = (
    "torchvision",
    "timm",
    "backbone",
    "moco",
    "moco_v3",
    "pycontrast",
    "simsiam",
    "simclr",
    "byol",
    "swav",
    "dino",
    "dinov2",
    "mae",
    "sequential",
    "simclrv2",
    "lightning",
)
"""The built-in layouts' modules, in auto-detection order (each registers the layout of its name)."""

for _module in DETECTION_ORDER:
    import_module(f"{__name__}.{_module}")

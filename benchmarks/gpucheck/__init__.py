"""The parts of ``benchmarks/gpu_check.py`` (issue 62), one module per kind of measurement:

- :mod:`.steps`: training images/s of one model, in a bare PyTorch loop and through ``coretune fit``'s engine
  (:class:`~coretune.engine.FineTuner` in the trainer :func:`~coretune.engine.make_trainer` builds), on the same
  synthetic batches held on the device, with the same precision, memory format and compilation;
- :mod:`.loading`: a generated JPEG folder, the training loader's images/s alone, and the 2-process DDP fit with
  global hard-pair mining (``coretune fit`` on that folder);
- :mod:`.report`: the environment, the ratios against the issue's targets, and the Markdown table.
"""

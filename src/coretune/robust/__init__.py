"""Robustness below the applications: PGD and its norms (:mod:`.attacks`, pure torch), adversarial training's
settings and batches (:mod:`.training`; :mod:`.batches`, the training-batch transform the engine installs). The
command that measures clean and robust accuracy with a library referee, ``coretune eval robust``, is the application
:mod:`coretune.apps.robustness`. This package imports nothing: import each module by its own name (attacks and
training sit below the engine, batches beside it)."""

"""The applications behind the commands that use a fine-tuned checkpoint or a backbone: ``coretune test`` and
``validate`` (:mod:`.scoring`), ``predict`` (:mod:`.predict`), ``export`` (:mod:`.export`), ``eval knn|linear``
(:mod:`.evaluation`), ``eval robust`` (:mod:`.robustness`) and ``demo`` (:mod:`.demo`); the options they share,
where a model runs (:mod:`.devices`: ``--trainer.accelerator/devices/precision``) and the older spellings of their
options (:mod:`.vocabulary`), and the post-hoc logit adjustment ``test``, ``predict`` and ``export`` take
(:mod:`.posthoc`).
Each is a library function first (``predict_folder``, ``export_checkpoint``, ``load_exported``, ``evaluate_encoder``
…); :mod:`coretune.cli` only parses and calls. This package imports nothing: import each module by its own name."""

"""The training engine: model, data, precision, trainer, checkpoints and metrics.

`run.py` builds a run (`build_run` -> the frozen `Run` of built_run.py) and `trainer.py` loops over it;
build.py builds its parts through the registries. Concepts with several modules are subpackages:
checkpoint/ (files, format, save and restore), parallel/ (process group, FSDP, DDP), eval/ (validation
and task scores), preflight/ (shape and memory checks, the start-up advisory) and data/.
"""

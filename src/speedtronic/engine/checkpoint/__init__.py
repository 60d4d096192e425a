"""A run's checkpoints, one concern per module:

files.py            checkpoint files on disk: atomic saves, the `latest` pointer, pruning, safe loading
layout.py           what a checkpoint holds (the format) and which one a run resumes (`find_resume`)
parts.py            a built run's parts to a checkpoint and back (capture, write, restore)
stateful.py         the small stateful parts that are not torch objects (counters, RNG, a position)
sharded.py          the model and optimizer as Distributed Checkpoint shards (fsdp runs)
resume_settings.py  on resume, the optimizer's hyperparameters come from the config, not the file
load_run.py         the way back from a checkpoint path: (config, plan, model, tokenizer)
"""

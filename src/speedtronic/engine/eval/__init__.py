"""Evaluation: validation loss and task scoring of a model (evaluate.py), the held-out batches it reads
(data.py), and the task evaluation the trainer runs during training (during_training.py)."""

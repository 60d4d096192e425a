"""Checks before a run trains: tensor-core-friendly shapes (shapes.py, `speedtronic shapes`), the
memory a run needs per strategy (memory_plan.py), and the start-up advisory the callers of `build_run`
(the CLI and the public API) run on a run built from its config (advice.py)."""

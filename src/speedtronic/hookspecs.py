"""Plugin hook specifications: the whole contract between Speedtronic and its plugins.

A plugin is a module (found through the `speedtronic` entry-point group) that implements any of
these hooks with `@speedtronic.hookimpl`. Each `register_*` hook receives a `register(name, factory,
**declared)` callback; the core's own model, optimizers and hooks are registered through the same
hooks (speedtronic/builtin/). What a registration may declare is listed in speedtronic/registry.py.

Factories are called later, with real objects, so a plugin module should import torch (or anything
heavy) inside its factories, never at import time: `speedtronic --help` loads every plugin.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("speedtronic")
hookimpl = pluggy.HookimplMarker("speedtronic")

# register(name, factory, **declared): models may declare config=, optimizers state_elements=.
Register = Callable[..., None]


@hookspec
def register_models(register: Register) -> None:
    """Register model factories: `register("name", factory)` or `register("name", factory, config=Cls)`.

    `Cls` is the model's typed config, a pydantic subclass of
    `speedtronic.config.models.BaseModelConfig`: the `model:` section of a run that selects the
    model is validated by it (its fields, defaults and validators; errors name `model.<field>`), and
    its methods give the engine what it asks of a model (shape fields, a memory estimate; see
    config/models.py). Without `config=` the section is the generic `ModelConfig` and the plugin's
    own settings arrive in `config.options`.

    `factory(config) -> torch.nn.Module`, called with the section as `Cls` (or `ModelConfig`). The
    engine fills in `config.vocab_size` and `config.max_seq_len` before calling. The module's
    forward may take `input_ids` (and optionally `labels`, `attention_mask`), the batch's keys as
    keywords, or one positional tensor; it may return a loss, logits, a mapping or an object with
    `loss`/`logits` (a Hugging Face ModelOutput), or a tuple starting with the loss — the contract
    is in speedtronic/engine/batches.py.

    Optional methods the engine uses when a model has them:
    `set_gradient_checkpointing(enabled: bool)` (for `gradient_checkpointing: true`),
    `flops_per_token(seq_len: int) -> float` (for MFU; default 6 × parameters), and
    `forward_cached(input_ids, cache) -> (last-position logits [B, vocab], cache)` (a KV cache for
    `speedtronic sample`: cache None starts a sequence at position 0, otherwise input_ids continue the
    cached one; the engine keeps the length within max_seq_len and re-prefills past it; the built-in
    transformer has one, see engine/decoding.py),
    `generate(input_ids, max_new_tokens, temperature=, top_k=, generator=)` (for `speedtronic sample`
    when the model has no `forward_cached` and no top-p or repetition penalty is asked; default: the
    shared loop, re-running the whole context per token), and for Hugging Face interop (speedtronic.interop)
    `fsdp_units() -> list[nn.Module]` (the modules `distributed.strategy: fsdp` shards one by one;
    default: the model's largest top-level `nn.ModuleList`, its blocks),
    `export_hf(folder, dtype) -> architecture name` (for `speedtronic export`) and
    `load_hf_weights(tensors, hf_config, folder)` (for `model.init_from`).
    """


@hookspec
def register_optimizers(register: Register) -> None:
    """Register optimizer factories: `register("name", factory)`, optionally declaring the state it
    keeps for the memory plan: `state_elements=k` (k float32 values per parameter) or
    `state_elements=fn(model) -> int` (default: 2 per parameter, as AdamW), and a typed config of its
    own: `config=Cls`, a subclass of `speedtronic.config.OptimizerConfig` with the optimizer's settings
    as fields, which then validates the `optimizer:` section (errors name `optimizer.<field>`).

    `factory(model: torch.nn.Module, config: speedtronic.config.OptimizerConfig) ->
    torch.optim.Optimizer` (the config is a Cls when one was registered). Selected by `optimizer.name`. With `optimizer.cautious: true` the engine
    wraps the result in `speedtronic.optim.cautious.Cautious`, unless the optimizer has the attribute
    `handles_cautious = True` (it implements the cautious mask itself). `speedtronic.optim.routing.
    route_parameters(model)` gives the built-in Muon/AdamW split for a hybrid of your own.
    """


@hookspec
def register_hooks(register: Register) -> None:
    """Register training-event hooks: `register("name", factory)`; selected by `logging.hooks`.

    `factory(config: speedtronic.config.Config) -> hook`. The trainer calls the hook's methods
    `on_train_start(payload)`, `on_step(payload)` (logging steps: loss = the interval's mean),
    `on_step_end(payload)` (every step, `{"step": N}` only), `on_eval(payload)`,
    `on_checkpoint(payload)` and `on_train_end(payload)` where they exist (payloads are dicts of
    JSON-able values), or a generic `on_event(event, payload)` for every event it has no
    `on_<event>` method for, then `close()`. A DiLoCo master builds the same hooks for the swarm
    (diloco/master/tracking.py, into its state directory) and calls `on_train_start`,
    `on_outer_step(payload)` once per outer step (`step` = the outer step; the global `val_loss`,
    counts, the round, `node/<id>/...`) and `on_train_end`.
    """


@hookspec
def register_buses(register: Register) -> None:
    """Register DiLoCo sync-bus backends by URL scheme: `register("gs", "my_plugin.bus:GcsBus")`.

    The value is a `speedtronic.diloco.bus.base.Bus` subclass or a "module:Class" string (imported
    only when a `--repo gs://…` URL is opened, so registering never imports a cloud SDK). The class's
    `from_url(url, config=, endpoint=, token=, **settings)` builds the bus; it must implement the
    whole protocol in base.py (documents, conditional publish, deltas, leases). The built-in schemes
    are `file`, `hub` and `s3`; a plugin may not take one of those.
    """


@hookspec
def register_delta_checks(register: Register) -> None:
    """Register DiLoCo master defences: `register("name", factory)`; every registered check runs.

    `factory() -> check`, called once per master. A check has a `name` (shown in the master's
    rejection log line, its status document and `hub status`) and `check(delta, context) -> Verdict`
    (`speedtronic.diloco.master.checks`: `Verdict.accept()`, `Verdict.weigh_zero(reason)` or
    `Verdict.reject(reason)`). `delta` is the decoded delta (`.ref`, `.node`, `.seq`, `.meta`,
    `.tensors`), `context` what the master knows (`.outer_step`, `.weights`, `.settings`, `.ledger`).
    Plugin checks run after the built-in ones, in registration order, on deltas that passed them.
    """


@hookspec
def register_commands(app: Any) -> None:
    """Add commands to the `speedtronic` Typer app: `@app.command()` or `app.add_typer(...)`."""


HOOK_NAMES = (
    "register_models",
    "register_optimizers",
    "register_hooks",
    "register_buses",
    "register_delta_checks",
    "register_commands",
)

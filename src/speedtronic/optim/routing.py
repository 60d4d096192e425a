"""Which parameters the hybrid optimizer gives to Muon and which to AdamW — by role, not by shape.

Muon is for the hidden matrices of a network. The input embedding and the output head are matrices
too, but they map between tokens and features (each row belongs to one token, most of which are
absent from a batch), so orthogonalising their updates hurts; they go to AdamW with the vectors.
The rules, first match wins, for each trainable parameter (frozen ones are left out; a parameter
shared by several modules, such as a tied embedding and head, is routed once):

1. an explicit role: ``_speedtronic_optimizer_role = "muon" | "adamw"`` on the parameter itself, or
   on the module that owns it (for a module, "muon" applies to its 2-D parameters only);
2. parameters of ``nn.Embedding``/``nn.EmbeddingBag`` modules → AdamW;
3. the output head → AdamW: what ``model.get_output_embeddings()`` returns (transformers models have
   it), else a ``nn.Linear`` whose output size equals the vocabulary size of an embedding;
4. the weight of a ``nn.Linear`` (or of transformers' ``Conv1D``, which is a Linear stored transposed,
   and is listed in ``Routes.transposed`` so Muon scales it by its true orientation) → Muon;
5. everything else (norm gains, biases, convolution kernels, other tensors) → AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

ROLES = ("muon", "adamw")
ROLE_ATTRIBUTE = "_speedtronic_optimizer_role"


@dataclass
class Routes:
    """The result: parallel (name, parameter) lists per route, and why each name went where it did."""

    muon: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    adamw: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    transposed: set[str] = field(default_factory=set)  # Muon matrices stored (in, out): Conv1D

    def names(self) -> dict[str, list[str]]:
        return {"muon": [n for n, _ in self.muon], "adamw": [n for n, _ in self.adamw]}

    def counts(self) -> dict[str, int]:
        """Number of scalar parameters each route owns."""
        return {
            "muon": sum(p.numel() for _, p in self.muon),
            "adamw": sum(p.numel() for _, p in self.adamw),
        }


def _explicit_role(owner: object, where: str) -> str | None:
    role = getattr(owner, ROLE_ATTRIBUTE, None)
    if role is not None and role not in ROLES:
        raise ValueError(f"{where}.{ROLE_ATTRIBUTE} is {role!r}; use 'muon' or 'adamw'")
    return role


def _is_linear(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D (GPT-2) is matched by name so transformers stays optional.
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _head_modules(model: nn.Module, vocab_sizes: set[int]) -> set[int]:
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, nn.Module):
            return {id(head)}
    return {
        id(m)
        for m in model.modules()
        if isinstance(m, nn.Linear) and vocab_sizes and m.out_features in vocab_sizes
    }


def route_parameters(model: nn.Module) -> Routes:
    """Split `model`'s trainable parameters between Muon and AdamW (rules in the module docstring)."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)]
    heads = _head_modules(model, {m.num_embeddings for m in embeddings})
    routes = Routes()
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if id(param) in seen or not param.requires_grad:
                seen.add(id(param))
                continue
            seen.add(id(param))
            route, reason = _route_one(name, param, module, heads)
            getattr(routes, route).append((name, param))
            routes.reasons[name] = reason
            if route == "muon" and type(module).__name__ == "Conv1D" and param_name == "weight":
                routes.transposed.add(name)
    return routes


def _route_one(name: str, param: nn.Parameter, module: nn.Module, heads: set[int]) -> tuple[str, str]:
    role = _explicit_role(param, name)
    if role == "muon" and param.ndim != 2:
        raise ValueError(f"{name} has shape {tuple(param.shape)}; Muon only optimises 2-D matrices")
    if role:
        return role, "parameter role"
    module_role = _explicit_role(module, name.rpartition(".")[0] or type(module).__name__)
    if module_role == "adamw" or (module_role == "muon" and param.ndim == 2):
        return module_role, "module role"
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return "adamw", "embedding"
    if id(module) in heads:
        return "adamw", "output head"
    if _is_linear(module) and param.ndim == 2:
        return "muon", "hidden matrix"
    return "adamw", "vector or other tensor"

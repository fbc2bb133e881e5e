"""The trainer's optimizer: torch's AdamW, made and stepped without loading torch._dynamo when nothing else has.

torch.optim wraps Optimizer.add_param_group, zero_grad, state_dict and load_state_dict in its lazy "disable dynamo"
decorator (torch/_compile.py), and Adam's step in a grad-mode wrapper that marks a torch.compile graph break
(torch/optim/optimizer.py ``_use_grad_for_differentiable``); the first call of either imports torch._dynamo: about
1 CPU s, the largest part of a training run's start when nothing else needs it (a run that precomputes loads it
anyway: transformers does). Outside torch.compile, which the trainer never uses, the first only calls the method
and the second sets the grad mode. So the methods get themselves as their cached "disabled" form (the attribute the
decorator looks up before importing), and the step runs Adam's own step in the grad mode the wrapper sets. Where torch's
code is not laid out so (another torch), plain torch.optim.AdamW is used. test_optimizer.py compares the weights
with torch's own AdamW.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable

import torch


def _adam_step():
    """Adam's own step, without the grad-mode wrapper (nor torch's profiling hook), or None where it is not so
    wrapped."""
    try:
        from torch.optim.optimizer import _use_grad_for_differentiable
    except ImportError:
        return None
    wrapper_code = _use_grad_for_differentiable(lambda: None).__code__
    method = current = vars(torch.optim.Adam).get("step")
    while current is not None and getattr(current, "__code__", None) is not wrapper_code:
        current = getattr(current, "__wrapped__", None)
    return inspect.unwrap(method) if current is not None else None


_ADAM_STEP = _adam_step()


class _AdamW(torch.optim.AdamW):
    def step(self, closure=None):  # what the grad-mode wrapper does outside torch.compile (differentiable=False)
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return _ADAM_STEP(self, closure)


def _call_optimizer_methods_directly() -> bool:
    try:
        from torch._compile import _disable_dynamo
    except ImportError:
        return False
    decorated = _disable_dynamo(lambda: None).__code__  # the code object of every method it wraps
    for method in vars(torch.optim.Optimizer).values():
        original = getattr(method, "__wrapped__", None)
        if getattr(method, "__code__", None) is decorated and original is not None:
            if not hasattr(original, "__dynamo_disable"):
                original.__dynamo_disable = original
    return True


def adamw(parameters: Iterable[torch.nn.Parameter] | Iterable[dict], *, lr: float,
          weight_decay: float) -> torch.optim.AdamW:
    if "torch._dynamo" not in sys.modules and _ADAM_STEP is not None and _call_optimizer_methods_directly():
        return _AdamW(parameters, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)  # loaded already: nothing to save

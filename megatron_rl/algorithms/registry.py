"""Name -> function registries for the swappable pieces of the algorithm.

Recipes name an advantage estimator and a policy loss; the trainer looks them
up here. Built-in entries register themselves where they are defined
(``advantages``, ``policy_loss``); importing ``megatron_rl.algorithms`` loads
them all. Third-party code adds its own with the same decorators.

    @register_policy_loss("my_loss")
    def my_loss(log_prob, old_log_prob, advantages, mask, **kwargs): ...

Contracts (checked by the callers' tests, not at registration):

* advantage estimator: ``(scores [B], group_ids, **options) -> advantages [B]``
* policy loss: ``(log_prob [B,T], old_log_prob [B,T], advantages [B] or [B,T],
  mask [B,T], **options) -> (loss 0-dim, metrics dict[str, 0-dim tensor])``
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

AdvantageEstimator = Callable[..., torch.Tensor]
PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Registry[F: Callable[..., Any]]:
    """A flat mapping from unique names to functions of one kind."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator that registers a function under ``name`` and returns it unchanged.

        Raises:
            ValueError: if ``name`` is empty or already taken.
        """
        if not name:
            raise ValueError(f"{self._kind} name must be a non-empty string; got {name!r}")

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self._kind} {name!r} is already registered (by {self._entries[name].__qualname__})")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as ``name``.

        Raises:
            ValueError: if no such name is registered; the message lists the known names.
        """
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self._kind} {name!r}; registered: {self.names()}") from None

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._entries))


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register an advantage estimator under ``name``."""
    return ADVANTAGE_ESTIMATORS.register(name)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The advantage estimator registered as ``name`` (ValueError listing the known names if none)."""
    return ADVANTAGE_ESTIMATORS.get(name)


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register a policy loss under ``name``."""
    return POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name`` (ValueError listing the known names if none)."""
    return POLICY_LOSSES.get(name)

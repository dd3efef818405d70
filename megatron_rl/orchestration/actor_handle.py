"""Typed calls to a Ray actor: an :class:`ActorHandle` of class ``T`` is called with ``T``'s method itself.

Ray's own handle (``ray.actor.ActorHandle``) types every method ``Never``, so calls through it go unchecked.
``host.call(EngineHost.start, spec)`` names the method itself, as
:meth:`~megatron_rl.orchestration.worker_group.RankWorkerGroup.call` does a rank's: an editor follows it to the
method, and the type checker holds the arguments to the method's signature and types the result's ``ObjectRef``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate

import ray
from ray.actor import ActorClass, ActorProxy


class ActorHandle[T]:
    """One Ray actor whose class is ``T`` (made by :meth:`start`)."""

    def __init__(self, handle: ActorProxy[T]) -> None:
        # Any: Ray resolves an actor's methods at run time (ray.actor.ActorHandle types them Never).
        self._handle: Any = handle

    @classmethod
    def start(cls, remote_class: ActorClass[T], **options: Any) -> ActorHandle[T]:
        """A new actor of ``remote_class`` (``ray.remote(T)``), created with Ray's actor ``options``
        (resources, scheduling strategy, runtime environment); returns while Ray schedules it."""
        return cls(remote_class.options(**options).remote())

    def call[**P, R](
        self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> ray.ObjectRef[R]:
        """Run ``method`` (a method of ``T``) on the actor with these arguments; its result's reference, at once.

        The call's errors come from ``ray.get`` of the reference (the method's own exception as Ray raises it,
        ``RayActorError`` when the actor is gone). AttributeError when the actor has no method of that name.
        """
        ref: ray.ObjectRef[R] = getattr(self._handle, method.__name__).remote(*args, **kwargs)
        return ref

    def kill(self) -> None:
        """End the actor at once (``ray.kill``): a call running on it fails with ``RayActorError``."""
        ray.kill(self._handle)

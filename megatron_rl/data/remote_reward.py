"""A reward scored by a server over HTTP (``data.reward: remote``), in slime's ``--rm-url`` shapes.

The wire format is slime's (``slime/rollout/rm_hub/__init__.py``, ``remote_rm``), so a slime reward server
works unchanged:

- request: ``POST`` to ``data.remote_reward.url`` of the JSON object ``{"prompt": str, "response": str,
  "label": str, "metadata": object}``: the prompt and the response as the model saw and wrote them (decoded
  with special tokens kept), the row's ground truth, and the row's ``extra_info`` (slime's ``Sample.metadata``);
- answer (any 2xx status): a JSON number, the score, correct when ``>= correct_threshold``, with no answer;
  or a JSON object holding the score under ``score_key`` and, our extension, optionally ``"correct"`` (a
  bool, overriding the threshold) and ``"answer"`` (a string or null: the response's final answer in the
  reward's normal form, what majority voting counts). Anything else is an error naming what came back.

Guarantees of :class:`RemoteReward`, a reward function (``fn(response, ground_truth, extra_info)``, plus an
optional ``prompt``):

- it returns a :class:`~megatron_rl.data.rewards.RewardOutput` with a finite score, or raises
  :class:`RemoteRewardError`, whose message names ``data.remote_reward.url``, what failed and how many tries;
- a connection error, a timeout and a 5xx or 429 answer are tried again, ``retries`` times, waiting
  :meth:`~megatron_rl.config.schema.RemoteRewardConfig.backoff_ceiling_s` times a random factor in [0.5, 1]
  before each retry; any other status and an answer that is no score raise at once (another try would get
  the same);
- its requests go over one kept-alive connection (one per reward worker process). A kept-alive connection
  the server closed since (servers close idle ones) is found closed before it is reused, or fails before
  any answer arrives; either way the request goes once more over a new connection, not counted as a try.
  Any other failure drops the connection.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import select
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from megatron_rl.data.rewards import RewardOutput

if TYPE_CHECKING:
    from megatron_rl.config.schema import RemoteRewardConfig

RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
"""Answers worth another try: the server is overloaded or failed on its side."""
_HEAD = 300
"""Characters of an unexpected answer quoted in an error."""


class RemoteRewardError(RuntimeError):
    """The reward server gave no score; the message names ``data.remote_reward.url``, why and how many tries."""


def reward_request(prompt: str, response: str, label: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """slime's request object, with ``metadata`` (the row's extra_info) added: exactly these four keys."""
    return {"prompt": prompt, "response": response, "label": label, "metadata": dict(metadata)}


def _head(value: object) -> str:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else json.dumps(value)
    return repr(text[:_HEAD] + ("..." if len(text) > _HEAD else ""))


def _finite_score(value: object, what: str, answer: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is not a number: the answer was {_head(answer)}")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"{what} is not finite ({score}): the answer was {_head(answer)}")
    return score


def parse_reward_answer(answer: object, score_key: str, correct_threshold: float) -> RewardOutput:
    """The :class:`RewardOutput` of a decoded JSON answer (the module docstring's shapes).

    Raises ValueError naming what came back for anything else: a bool, a string, a list, an object without
    ``score_key``, a score that is not a finite number, a ``"correct"`` that is not a bool or an ``"answer"``
    that is neither a string nor null.
    """
    if isinstance(answer, dict):
        if score_key not in answer:
            raise ValueError(
                f"the answer object has no {score_key!r} (data.remote_reward.score_key): it was {_head(answer)}"
            )
        score = _finite_score(answer[score_key], f"the answer's {score_key!r}", answer)
        correct = answer.get("correct", score >= correct_threshold)
        if not isinstance(correct, bool):
            raise ValueError(f"the answer's 'correct' is not a bool: it was {_head(answer)}")
        final = answer.get("answer")
        if final is not None and not isinstance(final, str):
            raise ValueError(f"the answer's 'answer' is neither a string nor null: it was {_head(answer)}")
        return RewardOutput(score, correct, final)
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        score = _finite_score(answer, "the score", answer)
        return RewardOutput(score, score >= correct_threshold)
    raise ValueError(f"the answer is neither a JSON number nor an object: it was {_head(answer)}")


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle kept-alive socket has something to read: the server closed it (or broke the protocol)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class _Retry(Exception):
    """A try that failed in a way another try may not: unreachable, timed out, or a 5xx/429 answer."""


class RemoteReward:
    """The reward function of ``data.reward: remote``: scores one response per call at ``config.url``.

    Picklable (by its config; the connection is not carried), so it passes the reward contract's checks and
    can be sent to a worker process. Not thread-safe: one instance per thread (the reward workers are processes).
    """

    def __init__(self, config: RemoteRewardConfig) -> None:
        self.config = config
        parts = urlsplit(config.url)  # the schema checked it: http(s), a host, a numeric port if any
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname or "", parts.port
        self._target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._connection: http.client.HTTPConnection | None = None
        self._random = random.Random()

    def __reduce__(self) -> tuple[type[RemoteReward], tuple[RemoteRewardConfig]]:
        return RemoteReward, (self.config,)

    def __call__(
        self, response: str, ground_truth: str, extra_info: Mapping[str, Any], prompt: str = ""
    ) -> RewardOutput:
        """The server's score of ``response`` to ``prompt``; RemoteRewardError when it gives none (module doc)."""
        try:
            body = json.dumps(reward_request(prompt, response, ground_truth, extra_info)).encode()
        except (TypeError, ValueError) as exc:
            raise RemoteRewardError(f"{self._where()}: the row's extra_info cannot be sent as JSON: {exc}") from exc
        for retry in range(self.config.retries):
            try:
                return self._try(body)
            except _Retry:
                time.sleep(self._random.uniform(0.5, 1.0) * self.config.backoff_ceiling_s(retry))
        try:
            return self._try(body)
        except _Retry as failure:
            raise RemoteRewardError(
                f"{self._where()}: {failure} (tried {self.config.retries + 1} times); check that the reward server "
                "is up and answers at that URL"
            ) from failure.__cause__

    def _try(self, body: bytes) -> RewardOutput:
        """One try: the score, _Retry for a failure another try may mend, RemoteRewardError for any other."""
        try:
            status, raw = self._exchange(body)
        except (OSError, http.client.HTTPException) as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}") from exc
        if status in RETRIED_STATUSES:
            raise _Retry(f"HTTP {status} {_head(raw)}")
        if not 200 <= status < 300:
            raise RemoteRewardError(f"{self._where()}: answered HTTP {status} {_head(raw)}")
        try:
            answer = json.loads(raw)
        except ValueError as exc:
            raise RemoteRewardError(f"{self._where()}: the answer is not JSON: {_head(raw)}") from exc
        try:
            return parse_reward_answer(answer, self.config.score_key, self.config.correct_threshold)
        except ValueError as exc:
            raise RemoteRewardError(f"{self._where()}: {exc}") from exc

    def _where(self) -> str:
        return f"reward server data.remote_reward.url={self.config.url}"

    def _exchange(self, body: bytes) -> tuple[int, bytes]:
        """(status, body) of one POST; resent once over a new connection when a kept-alive one failed unanswered."""
        may_resend = True
        while True:
            connection, reused = self._open()
            try:
                connection.request("POST", self._target, body=body, headers={"Content-Type": "application/json"})
                answer = connection.getresponse()
                raw = answer.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if not (reused and may_resend):
                    raise
                may_resend = False
                continue
            except BaseException:
                self.close()
                raise
            if answer.will_close:
                self.close()
            return answer.status, raw

    def _open(self) -> tuple[http.client.HTTPConnection, bool]:
        """The kept-alive connection (a new one if none, or if the server closed it) and whether it served before."""
        if (
            self._connection is not None
            and self._connection.sock is not None
            and _closed_by_peer(self._connection.sock)
        ):
            self.close()
        reused = self._connection is not None and self._connection.sock is not None
        if self._connection is None:
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._connection = kind(self._host, self._port, timeout=self.config.timeout_s)
        return self._connection, reused

    def close(self) -> None:
        """Close the kept-alive connection, if any; the next call opens a new one."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None

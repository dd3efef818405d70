"""Requests that probe an engine's ``--api-key`` handling (SGLang's middleware in front of every route):
the table every engine we compare must answer alike, and a way to send one exactly as written."""

from __future__ import annotations

import http.client

API_KEY = "run-key-4f1c"


def raw_request(
    port: int, method: str, path: str, authorization: str | None, body: bytes | None
) -> tuple[int, str, bytes]:
    """(status, content type, body) of one request, sent as is."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"} | ({"Authorization": authorization} if authorization else {})
    connection.request(method, path, body=body, headers=headers)
    response = connection.getresponse()
    answer = response.status, response.getheader("Content-Type") or "", response.read()
    connection.close()
    return answer


GENERATE_BODY = b'{"input_ids": [5, 17, 42], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}'
KEY_CASES = [  # (method, path, Authorization header, body)
    ("GET", "/health", None, None),
    ("GET", "/health", "Bearer wrong", None),
    ("GET", "/healthz", None, None),
    ("POST", "/generate", None, GENERATE_BODY),
    ("POST", "/generate", "Bearer wrong", GENERATE_BODY),
    ("POST", "/generate", f"Basic {API_KEY}", GENERATE_BODY),
    ("POST", "/generate", "Bearer", GENERATE_BODY),
    ("POST", "/generate", f"Bearer  {API_KEY}", GENERATE_BODY),
    ("POST", "/generate", f"Bearer {API_KEY}x", GENERATE_BODY),
    ("POST", "/generate", f"Bearer {API_KEY}", GENERATE_BODY),
    ("POST", "/generate", f"bearer {API_KEY}", GENERATE_BODY),
    ("POST", "/generate", None, b"{not json"),
    ("POST", "/update_weights_from_distributed", None, b"{}"),
    ("POST", "/init_weights_update_group", "Bearer wrong", b"{}"),
    ("POST", "/update_weights_from_tensor", None, b"{}"),
    ("POST", "/begin_weight_update", "Bearer wrong", b"{}"),
    ("POST", "/release_memory_occupation", None, b"{}"),
    ("POST", "/resume_memory_occupation", "Bearer wrong", b"{}"),
    ("POST", "/pause_generation", None, b"{}"),
    ("POST", "/flush_cache", None, None),
    ("POST", "/flush_cache", f"Bearer {API_KEY}", None),
    ("GET", "/model_info", None, None),
    ("POST", "/abort_request", "Bearer wrong", b"{}"),
    ("GET", "/no_such_endpoint", None, None),
    ("GET", "/no_such_endpoint", f"Bearer {API_KEY}", None),
]

"""A GRPO reward module that asks its scoring server for a handshake when imported, and the server never
answers (tests/test_watchdog.py: a hang during start-up)."""

from __future__ import annotations

import os
import socket

with socket.create_connection(("127.0.0.1", int(os.environ["STUCK_REWARD_PORT"]))) as _server:
    _server.recv(64)  # the server accepts (its backlog does) but never replies


def reward(response: str, sample: dict) -> float:
    return 0.0

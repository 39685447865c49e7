"""A GRPO reward that asks a scoring server which never answers (tests/test_watchdog.py): on the ranks listed
in STUCK_REWARD_RANKS, once STUCK_REWARD_AFTER responses have been scored (0 each), it connects to
STUCK_REWARD_PORT and waits for a reply; elsewhere it scores 0."""

from __future__ import annotations

import os
import socket

scored = 0


def stuck_reward(response: str, sample: dict) -> float:
    global scored
    scored += 1
    if os.environ.get("RANK", "0") not in os.environ["STUCK_REWARD_RANKS"].split(","):
        return 0.0
    if scored <= int(os.environ.get("STUCK_REWARD_AFTER", "0")):
        return 0.0
    with socket.create_connection(("127.0.0.1", int(os.environ["STUCK_REWARD_PORT"]))) as server:
        server.sendall(response.encode() or b"?")
        return float(server.recv(64) or 0.0)  # the server accepts (the backlog does) but never replies

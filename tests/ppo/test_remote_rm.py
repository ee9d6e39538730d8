"""--remote_rm_url: OpenRLHF's remote reward model protocol against a small HTTP server started here on
127.0.0.1: request and response shape, retries, the errors when the server is down, and a PPO job (launch/ppo.py's
body in this process, one rank, the megatron generator, GRPO) whose only reward is the server's."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from ppo_common import TINY_GRPO, ppo_args


class _Server:
    """Answers ``{"rewards": [len(query) % 7 / 7, ...]}``; the first ``fail`` requests get HTTP 503."""

    def __init__(self, fail: int = 0):
        self.requests: list[dict] = []
        self.fail = fail
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                if outer.fail > 0:
                    outer.fail -= 1
                    self.send_response(503)
                    self.end_headers()
                    return
                data = json.dumps({"rewards": [len(q) % 7 / 7 for q in body["query"]]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


def test_request_and_response_shape_and_retries(server):
    from rlhf.rewards.sources import call_remote_rm

    server.fail = 2  # two 503s, then an answer
    got = call_remote_rm(server.url, ["ab", "abcdefgh"], ["a", "abc"], ["x", None], backoff=0.01)
    assert torch.allclose(got, torch.tensor([2 / 7, 1 / 7]))
    assert len(server.requests) == 3
    assert server.requests[-1] == {"query": ["ab", "abcdefgh"], "prompts": ["a", "abc"], "labels": ["x", None]}


def test_server_down_is_a_clear_error(server):
    from rlhf.rewards.sources import call_remote_rm, check_remote_rm

    url = server.url
    server.close()
    with pytest.raises(ValueError, match=r"--remote_rm_url http://127.0.0.1:\d+/get_reward: cannot connect .*start "
                                         r"the reward server first"):
        check_remote_rm(url)
    with pytest.raises(ValueError, match=r"no answer after 2 attempts .*is the reward server running"):
        call_remote_rm(url, ["q"], ["p"], retries=2, backoff=0.01)
    with pytest.raises(ValueError, match="must be an http"):
        check_remote_rm("127.0.0.1:8000")


def test_ppo_with_only_a_remote_reward(ppo_setup, server, tmp_path, monkeypatch):
    from helpers import free_port
    from rlhf.observability.metrics import read_metrics_jsonl
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "o"
    argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--remote_rm_url": server.url,
                                            "--rollout_backend": "megatron", "--max_samples": "8"})
    assert main(argv) == 0
    assert len(server.requests) == 2  # one per step (one rank holds every sample)
    for req in server.requests:
        assert len(req["query"]) == 8 and all(q.startswith(p) for q, p in zip(req["query"], req["prompts"]))
    rows = read_metrics_jsonl(str(out / "metrics.jsonl"), "ppo")
    want = [sum(len(q) % 7 / 7 for q in r["query"]) / 8 for r in server.requests]
    assert [rows[k]["reward"] for k in sorted(rows)] == pytest.approx(want, abs=1e-6)
    assert (out / "config.json").exists()

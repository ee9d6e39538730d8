"""SandboxFusion's ``run_code`` API (bytedance/SandboxFusion, docs/api "Run Code": POST /run_code): a client that
runs the sandbox's requests on such a service (``--code_sandbox_url``), and a server of the same API (Python only)
that runs them in this machine's sandbox, for a job whose workers share one service, and for the tests (no
SandboxFusion service can be started here: its runtimes come as container images).

Request, as verl's ``call_sandbox_api`` sends it (verl/utils/reward_score/sandbox_fusion/utils.py at 1dda039b):
``{"code", "language": "python", "stdin", "run_timeout", "compile_timeout", "memory_limit_MB", "files": {},
"fetch_files": []}``. Response: ``{"status": "Success" | "Failed" | "SandboxError", "message", "compile_result",
"run_result": {"status": "Finished" | "Error" | "TimeLimitExceeded", "execution_time", "return_code", "stdout",
"stderr"}, "files"}``.

    python -m rlhf.sandbox.fusion --port 8080     # serve; then --code_sandbox_url http://host:8080/run_code
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

from rlhf.sandbox.core import SandboxConfig, SandboxResult, run_program


class FusionClient:
    """``run(program, stdin, cfg) -> SandboxResult`` on a SandboxFusion service."""

    def __init__(self, url: str, retries: int = 3, extra_timeout_s: float = 30.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--code_sandbox_url must be an http(s) URL of run_code, got {url!r}")
        self.url, self.retries, self.extra = url, retries, extra_timeout_s

    def run(self, program: str, stdin: str = "", cfg: SandboxConfig | None = None) -> SandboxResult:
        cfg = cfg or SandboxConfig()
        body = json.dumps({"code": program, "language": "python", "stdin": stdin, "run_timeout": cfg.timeout_s,
                           "compile_timeout": cfg.timeout_s, "memory_limit_MB": cfg.memory_mb, "files": {},
                           "fetch_files": []}).encode()
        t0 = time.monotonic()
        last = ""
        for attempt in range(self.retries):
            req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json",
                                                                        "Accept": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=cfg.timeout_s * 2 + self.extra) as r:
                    return _from_fusion(json.loads(r.read()), cfg, time.monotonic() - t0, self.url)
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
                if e.code not in (429, 502, 503, 504):
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.5 * (attempt + 1))
        return SandboxResult("error", None, "", "", seconds=time.monotonic() - t0,
                             isolation=[f"SandboxFusion {self.url}"], reason=f"the service did not answer: {last}")


def _cut(text: str, limit: int) -> tuple[str, int]:
    data = (text or "").encode()
    return data[:limit].decode(errors="replace"), max(len(data) - limit, 0)


def _from_fusion(resp: dict, cfg: SandboxConfig, seconds: float, url: str) -> SandboxResult:
    run = resp.get("run_result") or {}
    out, oc = _cut(run.get("stdout") or "", cfg.max_output_bytes)
    err, ec = _cut(run.get("stderr") or "", cfg.max_output_bytes)
    code = run.get("return_code")
    if resp.get("status") == "SandboxError":
        status = "error"
    elif run.get("status") == "TimeLimitExceeded":
        status = "timeout"
    elif code == 0 and run.get("status") == "Finished":
        status = "ok"
    elif "MemoryError" in err[-2000:]:
        status = "memory"
    else:
        status = "error"
    return SandboxResult(status, code, out, err, oc, ec, round(seconds, 4), [f"SandboxFusion {url}"],
                         resp.get("message", "") if status != "ok" else "")


def to_fusion(r: SandboxResult) -> dict:
    """A local result in SandboxFusion's response shape (the server's answer)."""
    if r.status == "refused":
        return {"status": "SandboxError", "message": r.reason, "compile_result": None, "run_result": None,
                "files": {}}
    run_status = "TimeLimitExceeded" if r.status == "timeout" else "Finished" if r.exit_code == 0 else "Error"
    return {"status": "Success" if r.status == "ok" else "Failed", "message": r.reason, "compile_result": None,
            "run_result": {"status": run_status, "execution_time": r.seconds, "return_code": r.exit_code,
                           "stdout": r.stdout, "stderr": r.stderr}, "files": {}}


def make_server(host: str = "127.0.0.1", port: int = 0, allow_weaker: bool = False):
    """A ThreadingHTTPServer answering POST /run_code (language python) with this machine's sandbox."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != "/run_code":
                self.send_error(404, "only POST /run_code")
                return
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if req.get("language", "python") != "python":
                    raise ValueError(f"language {req.get('language')!r}: this server runs python only")
                cfg = SandboxConfig(timeout_s=float(req.get("run_timeout", 10)),
                                    memory_mb=int(req.get("memory_limit_MB", 512)), allow_weaker=allow_weaker)
                resp = to_fusion(run_program(req["code"], req.get("stdin") or "", cfg))
            except (ValueError, KeyError, TypeError) as e:
                resp = {"status": "SandboxError", "message": f"bad request: {e}", "compile_result": None,
                        "run_result": None, "files": {}}
            data = json.dumps(resp).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):  # quiet
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="serve SandboxFusion's run_code API with this machine's sandbox")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--allow_weaker", action="store_true")
    args = p.parse_args(argv)
    srv = make_server(args.host, args.port, args.allow_weaker)
    print(f"serving run_code on http://{args.host}:{srv.server_address[1]}/run_code", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SandboxFusion's ``run_code`` API (bytedance/SandboxFusion, docs/api "Run Code": POST /run_code): a client that
runs the sandbox's requests on such a service (``--code_sandbox_url``), and a server of the same API (Python only)
that runs them in this machine's sandbox, for a job whose workers share one service, and for the tests (no
SandboxFusion service can be started here: its runtimes come as container images).

Request, as verl's ``call_sandbox_api`` sends it (verl/utils/reward_score/sandbox_fusion/utils.py at 1dda039b) and
SandboxFusion's ``RunCodeRequest`` reads it (sandbox/server/sandbox_api.py at 469de084): ``{"code", "language":
"python", "stdin", "run_timeout", "compile_timeout", "memory_limit_MB", "files": {}, "fetch_files": []}``.
Response: ``{"status": "Success" | "Failed" | "SandboxError", "message", "compile_result", "run_result":
{"status": "Finished" | "Error" | "TimeLimitExceeded", "execution_time", "return_code", "stdout", "stderr"},
"files"}``; a run's ``Error`` is the service's own failure, a program's failure is ``Failed`` with a ``Finished``
run (``parse_run_status``). The server validates every field and bounds the body's size, the timeout and the
memory (``ServerLimits``; a bad request is answered 400 naming the field).

    python -m rlhf.sandbox.fusion --port 8080     # serve; then --code_sandbox_url http://host:8080/run_code
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from rlhf.config.part import Part, flag
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
    """SandboxFusion's answer as a result, read as its own server means it (``sandbox/server/sandbox_api.py``,
    ``parse_run_status``, at 469de084): ``SandboxError`` is the service's failure (the program did not run:
    ``refused``); a run ``TimeLimitExceeded`` a timeout; a run ``Finished`` with return code 0 ``ok``, with another
    code ``error`` (its code kept; a signal as -N, asyncio's way). The service tells no memory verdict apart, so
    none is made here (never from what the program printed)."""
    run = resp.get("run_result") or {}
    out, oc = _cut(run.get("stdout") or "", cfg.max_output_bytes)
    err, ec = _cut(run.get("stderr") or "", cfg.max_output_bytes)
    code = run.get("return_code")
    iso = [f"SandboxFusion {url}"]
    if resp.get("status") == "SandboxError" or run.get("status") == "Error" or not run:
        return SandboxResult("refused", None, "", "", seconds=round(seconds, 4), isolation=iso,
                             reason="the service could not run it: " + "; ".join(
                                 x for x in (resp.get("message"), run.get("stderr")) if x)[:2000])
    if run.get("status") == "TimeLimitExceeded":
        status, reason = "timeout", f"the service's run_timeout of {cfg.timeout_s:g} s"
    elif run.get("status") == "Finished" and code == 0:
        status, reason = "ok", ""
    else:
        status, reason = "error", ""
    return SandboxResult(status, code, out, err, oc, ec, round(seconds, 4), iso, reason)


def to_fusion(r: SandboxResult) -> dict:
    """A local result in SandboxFusion's response shape (the server's answer), as its ``parse_run_status`` builds
    it: the program's own failure is a ``Failed`` response with a ``Finished`` run and its return code."""
    if r.status == "refused":
        return {"status": "SandboxError", "message": r.reason, "compile_result": None,
                "run_result": {"status": "Error", "execution_time": None, "return_code": None, "stdout": None,
                               "stderr": r.reason}, "files": {}}
    timeout = r.status == "timeout"
    return {"status": "Success" if r.status == "ok" else "Failed", "message": "", "compile_result": None,
            "run_result": {"status": "TimeLimitExceeded" if timeout else "Finished", "execution_time": r.seconds,
                           "return_code": None if timeout else (r.exit_code if r.exit_code is not None else -9),
                           "stdout": r.stdout, "stderr": r.stderr}, "files": {}}


REQUEST_FIELDS = {"code": str, "language": str, "stdin": (str, type(None)), "run_timeout": (int, float),
                  "compile_timeout": (int, float), "memory_limit_MB": int, "files": dict, "fetch_files": list}
"""The fields of SandboxFusion's ``RunCodeRequest`` (sandbox/server/sandbox_api.py at 469de084) and their types"""


@dataclass(frozen=True)
class ServerLimits(Part):
    """What the server accepts; a request past any of them is answered 400 (413 for its size) naming the field."""

    allow_weaker: bool = flag(action="store_true", default=False)
    """(--allow_weaker) serve where the sandbox has fewer layers than it wants (``rlhf.sandbox``)"""
    max_request_mb: int = flag(type=int, default=16, help="the largest request body accepted")
    """(--max_request_mb)"""
    max_timeout_s: float = flag(type=float, default=60.0, help="the largest run_timeout accepted")
    """(--max_timeout_s)"""
    max_memory_mb: int = flag(type=int, default=4096, help="the largest memory_limit_MB accepted")
    """(--max_memory_mb)"""


def parse_request(body: bytes, limits: ServerLimits) -> tuple[str, str, SandboxConfig, dict]:
    """(code, stdin, the run's limits, files) from a run_code request body; ValueError naming the bad field."""
    try:
        req = json.loads(body)
    except ValueError as e:
        raise ValueError(f"the body is not JSON: {e}") from None
    if not isinstance(req, dict):
        raise ValueError("the body must be a JSON object (SandboxFusion's RunCodeRequest)")
    unknown = sorted(set(req) - set(REQUEST_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)} (RunCodeRequest has {', '.join(REQUEST_FIELDS)})")
    for k, types in REQUEST_FIELDS.items():
        if k in req and (not isinstance(req[k], types) or isinstance(req[k], bool)):
            raise ValueError(f"{k}: expected {getattr(types, '__name__', types)}, got {type(req[k]).__name__}")
    if "code" not in req or "language" not in req:
        raise ValueError("code and language are required")
    if req["language"] != "python":
        raise ValueError(f"language {req['language']!r}: this server runs python only")
    run_timeout = float(req.get("run_timeout", 10))
    if not 0 < run_timeout <= limits.max_timeout_s:
        raise ValueError(f"run_timeout {run_timeout:g}: must be in (0, {limits.max_timeout_s:g}] s here")
    if "compile_timeout" in req and not 0 <= req["compile_timeout"] <= limits.max_timeout_s:  # python: unused
        raise ValueError(f"compile_timeout {req['compile_timeout']}: must be in [0, {limits.max_timeout_s:g}] s")
    memory = int(req.get("memory_limit_MB", -1))
    if memory == -1:  # SandboxFusion's "no limit": this server's own bound
        memory = min(512, limits.max_memory_mb)
    if not 16 <= memory <= limits.max_memory_mb:
        raise ValueError(f"memory_limit_MB {memory}: must be -1 or in [16, {limits.max_memory_mb}] here")
    if req.get("fetch_files"):
        raise ValueError("fetch_files: not served here (the working folder is discarded after the run)")
    files = {}
    for name, content in (req.get("files") or {}).items():
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", "..", "main.py"):
            raise ValueError(f"files: {name!r}: a plain file name other than main.py is expected here")
        try:
            files[name] = base64.b64decode(content or "", validate=True).decode()
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"files[{name!r}]: base64 of UTF-8 text expected ({e})") from None
    cfg = SandboxConfig(timeout_s=run_timeout, memory_mb=memory, allow_weaker=limits.allow_weaker)
    return req["code"], req.get("stdin") or "", cfg, files


def make_server(host: str = "127.0.0.1", port: int = 0, allow_weaker: bool = False,
                limits: ServerLimits | None = None):
    """A ThreadingHTTPServer answering POST /run_code (language python) with this machine's sandbox."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    limits = limits or ServerLimits(allow_weaker=allow_weaker)

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, resp: dict) -> None:
            data = json.dumps(resp).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _bad(self, code: int, message: str) -> None:
            self._answer(code, {"status": "SandboxError", "message": f"bad request: {message}",
                                "compile_result": None, "run_result": None, "files": {}})

        def do_POST(self):  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != "/run_code":
                self.send_error(404, "only POST /run_code")
                return
            try:
                size = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._bad(411, "Content-Length is required")
                return
            if not 0 < size <= limits.max_request_mb << 20:
                self._bad(413, f"the body is {size} bytes; at most {limits.max_request_mb} MB here")
                return
            try:
                code, stdin, cfg, files = parse_request(self.rfile.read(size), limits)
            except ValueError as e:
                self._bad(400, str(e))
                return
            self._answer(200, to_fusion(run_program(code, stdin, cfg, files)))

        def log_message(self, *a):  # quiet
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="serve SandboxFusion's run_code API with this machine's sandbox")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    ServerLimits.add_args(p)
    args = p.parse_args(argv)
    limits = ServerLimits.from_args(args)
    srv = make_server(args.host, args.port, limits=limits)
    print(f"serving run_code on http://{args.host}:{srv.server_address[1]}/run_code", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

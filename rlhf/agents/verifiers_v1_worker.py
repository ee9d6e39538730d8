"""The process that runs verifiers 0.4.0 (``verifiers.v1``) episodes for rlhf.agents.verifiers_v1. It imports the
0.4.0 release from its own directory (``<venv>/verifiers-v1``, put first on its path by the parent), so the job
keeps 0.3.1's ``verifiers.legacy`` beside it. JSON lines on stdin: ``{"id", "env", "prompt", "label", "model",
"base_url", "sampling"}``; on stdout: ``{"id", "reward", "metrics", "error"}``. Each environment config is loaded
once (``load_environment(EnvConfig)``) and held inside ``Env.serving()`` for the worker's life.

Harness programs are PEP 723 scripts that verifiers runs through ``uv sync --script``, which fetches their packages
from an index. Here the subprocess runtime runs them with the job's interpreter instead: every requirement must be
installed (a missing one fails the episode by name); one installed at another version is logged once and run."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
from importlib import metadata

log = logging.getLogger("rlhf.agents.verifiers_v1")
API_KEY_VAR = "RLHF_ENDPOINT_API_KEY"
_warned: set[str] = set()


def script_requirements(script: str) -> list[str]:
    """The ``dependencies`` of a PEP 723 ``# /// script`` block."""
    m = re.search(r"^# /// script\s*$(.*?)^# ///\s*$", script, re.M | re.S)
    if not m:
        return []
    body = "\n".join(line[2:] if line.startswith("# ") else line[1:] for line in m.group(1).splitlines())
    import tomllib

    return list(tomllib.loads(body).get("dependencies", []))


def check_requirements(reqs: list[str]) -> None:
    """Every requirement installed in the job's environment; a version outside its specifier is logged once."""
    from packaging.requirements import Requirement

    for text in reqs:
        req = Requirement(text)
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            raise RuntimeError(f"verifiers harness script needs {text!r}, which the job's environment lacks "
                               f"(scripts run with the job's interpreter, not uv)") from None
        if req.specifier and not req.specifier.contains(have, prereleases=True) and text not in _warned:
            _warned.add(text)
            log.warning("verifiers harness script asks for %s; it runs with the job's %s %s", text, req.name, have)


def publish_script(directory: str, data: bytes) -> str:
    """``data`` at its content-addressed path in ``directory``, written once and renamed into place, so an episode
    running the script never reads it half-written while another publishes it."""
    import hashlib
    import uuid

    path = os.path.join(directory, f"{hashlib.sha256(data).hexdigest()}.py")
    if not os.path.exists(path):
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return path


def install_job_interpreter() -> None:
    """Replace ``SubprocessRuntime.prepare_uv_script`` (uv sync + an index) by the job's interpreter."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    async def prepare_uv_script(self, script, env=None, *, activate=True):
        data = script.encode() if isinstance(script, str) else script
        check_requirements(script_requirements(data.decode()))
        return [sys.executable, publish_script(self.scripts_dir, data)]

    SubprocessRuntime.prepare_uv_script = prepare_uv_script
    log.info("verifiers harness scripts run with the job's interpreter (%s), not uv", sys.executable)


def env_config(spec: dict):
    """``EnvConfig`` of ``{"taskset": id, "taskset_args": {...}, "harness": id}``, every role local (subprocess)."""
    from verifiers.v1.utils.loaders import resolve_env_config

    agent = {"runtime": {"type": "subprocess"}}
    if spec.get("harness"):
        agent["harness"] = {"id": spec["harness"]}
    return resolve_env_config({"taskset": {"id": spec["taskset"], **spec.get("taskset_args", {})}, "agent": agent})


def task_of(env, prompt, label):
    """The taskset's task type filled with the job's prompt and label: a dict label gives the data's fields, any
    other label its ``answer`` field (which the data type must have)."""
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()
    fields = dict(label) if isinstance(label, dict) else {}
    if not isinstance(label, dict) and label is not None:
        if "answer" not in data_cls.model_fields:
            raise ValueError(f"{data_cls.__name__} has no 'answer' field for the job's label; give a dict label")
        fields["answer"] = str(label)
    return task_cls(data_cls(prompt=prompt, **fields), env.taskset.config.task)


class Worker:
    def __init__(self):
        self.envs: dict[str, object] = {}
        self.loading: dict[str, asyncio.Lock] = {}
        self.stack = None

    async def env(self, spec: dict):
        key = json.dumps(spec, sort_keys=True)
        async with self.loading.setdefault(key, asyncio.Lock()):  # the step's first episodes arrive together
            return await self._load(key, spec)

    async def _load(self, key: str, spec: dict):
        if key not in self.envs:
            from verifiers.v1.utils.loaders import load_environment

            env = load_environment(env_config(spec))
            for harness in env._harnesses.values():
                if harness.EXECUTES_CODE:
                    raise ValueError(f"verifiers harness {harness.config.id!r} runs the model's commands, and its "
                                     "local runtime is the host: not carried (rlhf.agents' SWE task runs them in "
                                     "rlhf.sandbox); use a tool-less or MCP-tool harness such as 'null'")
            await self.stack.enter_async_context(env.serving())
            self.envs[key] = env
            log.info("verifiers %s environment %s: taskset %s, harness %s", _version(), type(env).__name__,
                     spec["taskset"], env._harnesses and next(iter(env._harnesses.values())).config.id)
        return self.envs[key]

    async def episode(self, req: dict) -> dict:
        import verifiers.v1 as vf

        env = await self.env(req["env"])
        task = task_of(env, req["prompt"], req.get("label"))
        ctx = vf.ModelContext(model=req["model"], client=vf.EvalClientConfig(base_url=req["base_url"],
                                                                            api_key_var=API_KEY_VAR),
                              sampling=vf.SamplingConfig(**req.get("sampling", {})))
        ep = await env.run_episode(task, ctx)
        errors = [f"{e.type}: {e.message}" for e in ep.errors]
        metrics = {}
        for tr in ep.traces:
            errors += [f"{e.type}: {e.message}" for e in tr.errors]
            metrics.update({name: float(v) for name, v in tr.metrics.items() if v is not None})
        reward = sum(float(tr.reward) for tr in ep.traces)
        return {"reward": reward, "metrics": metrics, "error": "; ".join(errors) or None}


def _version() -> str:
    return metadata.version("verifiers")


async def serve(requests, out) -> None:
    import contextlib

    install_job_interpreter()
    worker = Worker()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), requests)
    lock = asyncio.Lock()
    tasks: dict[int, asyncio.Task] = {}

    async def answer(req):
        try:
            res = await worker.episode(req)
        except Exception as e:  # noqa: BLE001 - the episode's failure goes back to its session
            res = {"reward": 0.0, "metrics": {}, "error": f"{type(e).__name__}: {e}"}
        async with lock:
            out.write(json.dumps({"id": req["id"], **res}) + "\n")
            out.flush()

    async with contextlib.AsyncExitStack() as stack:
        worker.stack = stack
        pending = set()
        while line := await reader.readline():
            req = json.loads(line)
            if "cancel" in req:
                if req["cancel"] in tasks:
                    tasks[req["cancel"]].cancel()
                continue
            t = tasks[req["id"]] = asyncio.ensure_future(answer(req))
            pending.add(t)
            t.add_done_callback(lambda t, i=req["id"]: (pending.discard(t), tasks.pop(i, None)))
        for t in list(pending):
            t.cancel()


def main() -> None:
    logging.basicConfig(level=os.environ.get("RLHF_VERIFIERS_LOG", "WARNING"), stream=sys.stderr,
                        format="[verifiers-v1 worker] %(levelname)s %(name)s: %(message)s")
    log.setLevel(min(log.getEffectiveLevel(), logging.INFO))
    # the protocol has its own descriptors: what anything else prints goes to stderr, and the programs verifiers
    # starts (which inherit stdin) read /dev/null, never the requests
    requests, proto = os.fdopen(os.dup(0), "rb", buffering=0), os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    asyncio.run(serve(requests, proto))


if __name__ == "__main__":
    main()

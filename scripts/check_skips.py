#!/usr/bin/env python3
"""Holds one part of a CI run to the list of skips it may have: every skipped, xfailed or xpassed test of the run
(written by tests/support/skip_log.py to the file ``KVP2P_SKIP_LOG`` names) must be listed in
tests/expected_skips.toml for that vLLM and run part, with a reason pytest's reason contains; every listed one must
have happened. Anything else fails, naming the test id and both reasons:

* an unexpected skip (not listed, or listed with another reason): a test that did not run, which no one decided;
* a missing skip (listed, but the test ran): the list no longer says what CI does, so it says nothing;
* a log that is absent, unfinished or unreadable: never read as "no skips".

scripts/test.sh runs it after each part of the full run (no arguments; what .ci/run runs):
``check_skips.py --vllm 0.32 --run pure LOG``. Exit 0 when the run matches the list, 1 when it does not, 2 on a
usage error or a malformed list. Standard library only (Python >= 3.11 for tomllib).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = ROOT / "tests" / "expected_skips.toml"
#: The parts of a full CI run (scripts/test.sh): vLLM series -> run parts (tests/conftest.py's KVP2P_TESTS).
RUNS = {"0.32": ("pure", "contract"), "0.23": ("older",)}
EVENTS = ("skipped", "xfailed")  # what may be listed; an xpassed test is never expected


class ListError(ValueError):
    """The expected-skip list is malformed."""


@dataclass(frozen=True)
class Expected:
    vllm: str
    run: str
    event: str
    reason: str  # a part of pytest's reason
    why: str  # why this skip is right on that vLLM: read by people, never matched
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Observed:
    event: str  # "skipped", "xfailed" or "xpassed"
    test: str  # pytest's node id
    reason: str


@dataclass(frozen=True)
class Verdict:
    matched: tuple[Observed, ...]
    unexpected: tuple[tuple[Observed, Expected | None], ...]  # with the entry that lists the test for another reason
    missing: tuple[tuple[Expected, str], ...]
    log_problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not (self.unexpected or self.missing or self.log_problems)


def parse_expected(data: dict) -> list[Expected]:
    entries = data.get("skip")
    if not isinstance(entries, list) or not entries:
        raise ListError("no [[skip]] entries")
    out, seen = [], {}
    for i, raw in enumerate(entries):
        where = f"[[skip]] #{i + 1}"
        unknown = set(raw) - {"vllm", "run", "event", "reason", "why", "tests"}
        if unknown:
            raise ListError(f"{where}: unknown keys {sorted(unknown)}")
        missing = [key for key in ("vllm", "run", "reason", "why", "tests") if not raw.get(key)]
        if missing:
            raise ListError(f"{where}: {', '.join(missing)} must be given and non-empty")
        entry = Expected(vllm=raw["vllm"], run=raw["run"], event=raw.get("event", "skipped"), reason=raw["reason"],
                         why=raw["why"], tests=tuple(raw["tests"]))
        if entry.run not in RUNS.get(entry.vllm, ()):
            raise ListError(f"{where}: vLLM {entry.vllm!r} has no run part {entry.run!r} (known: {RUNS})")
        if entry.event not in EVENTS:
            raise ListError(f"{where}: event {entry.event!r} is not one of {EVENTS}")
        for test in entry.tests:
            key = (entry.vllm, entry.run, test)
            if key in seen:
                raise ListError(f"{where}: {test} is listed twice for vLLM {entry.vllm} {entry.run} "
                                f"(also in #{seen[key]})")
            seen[key] = i + 1
        out.append(entry)
    return out


def load_expected(path: Path = EXPECTED) -> list[Expected]:
    return parse_expected(tomllib.loads(path.read_text(encoding="utf-8")))


def parse_log(lines: Iterable[str], run: str | None = None) -> tuple[list[Observed], list[str]]:
    """The skips a log records, and what is wrong with the log itself (no start, no finish, a bad line, a run part
    other than ``run``: the start line says which KVP2P_TESTS the run had)."""
    observed, problems, started, finished = [], [], False, False
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            event = record["event"]
        except (ValueError, KeyError, TypeError):
            problems.append(f"line {n} is not a skip-log record: {line.strip()[:200]}")
            continue
        if event == "start":
            started = True
            if run is not None and record.get("tests") != run:
                problems.append(f"the log is of a KVP2P_TESTS={record.get('tests')!r} run, not of {run!r}")
        elif event == "finish":
            finished = True
        elif event in ("skipped", "xfailed", "xpassed"):
            observed.append(Observed(event, record["test"], record.get("reason", "")))
        else:
            problems.append(f"line {n}: unknown event {event!r}")
    if not started:
        problems.append("the log has no start line: pytest never ran with tests/support/skip_log.py")
    elif not finished:
        problems.append("the log has no finish line: the run stopped part-way, its skips are not all known")
    return observed, problems


def compare(expected: Sequence[Expected], observed: Sequence[Observed], vllm: str, run: str,
            log_problems: Sequence[str] = ()) -> Verdict:
    mine = [e for e in expected if e.vllm == vllm and e.run == run]
    listed = {(e.event, test): e for e in mine for test in e.tests}
    matched, unexpected, happened = [], [], set()
    for seen in observed:
        entry = listed.get((seen.event, seen.test))
        if entry is not None and entry.reason in seen.reason:
            matched.append(seen)
            happened.add((seen.event, seen.test))
        else:
            unexpected.append((seen, entry))
    missing = [(e, test) for e in mine for test in e.tests if (e.event, test) not in happened]
    return Verdict(tuple(matched), tuple(unexpected), tuple(missing), tuple(log_problems))


def report(verdict: Verdict, vllm: str, run: str, list_path: Path = EXPECTED) -> str:
    head = f"[check-skips] vLLM {vllm} {run}"
    if verdict.ok:
        return f"{head}: {len(verdict.matched)} skip(s), all as listed in {list_path.name}"
    lines = [f"{head}: the run does not match {list_path} -- "
             f"{len(verdict.unexpected)} unexpected, {len(verdict.missing)} missing, "
             f"{len(verdict.log_problems)} log problem(s)"]
    lines += [f"  LOG: {problem}" for problem in verdict.log_problems]
    for seen, entry in verdict.unexpected:
        if seen.event == "xpassed":
            lines.append(f"  UNEXPECTED xpassed {seen.test}: marked xfail ({seen.reason}) but passed: drop the mark")
        elif entry is None:
            lines.append(f"  UNEXPECTED {seen.event} {seen.test}\n      reason: {seen.reason}\n"
                         "      not on the list: make it run here, or list it for this vLLM and run with why")
        else:
            lines.append(f"  UNEXPECTED {seen.event} {seen.test}\n      reason: {seen.reason}\n"
                         f"      listed for another reason: {entry.reason!r}")
    for entry, test in verdict.missing:
        lines.append(f"  MISSING {entry.event} {test}\n      listed reason: {entry.reason}\n"
                     "      listed, but it did not happen (the test ran, or was not collected): update the list")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", required=True, choices=sorted(RUNS))
    parser.add_argument("--run", required=True)
    parser.add_argument("--expected", type=Path, default=EXPECTED)
    parser.add_argument("log", type=Path, help="the file KVP2P_SKIP_LOG named for that run part")
    args = parser.parse_args(argv)
    if args.run not in RUNS[args.vllm]:
        parser.error(f"vLLM {args.vllm} has the run parts {RUNS[args.vllm]}, not {args.run!r}")
    try:
        expected = load_expected(args.expected)
    except (OSError, tomllib.TOMLDecodeError, ListError) as exc:
        print(f"[check-skips] {args.expected}: {exc}", file=sys.stderr)
        return 2
    if not args.log.is_file():
        observed, problems = [], [f"no skip log at {args.log}: the run wrote none, so its skips are unknown"]
    else:
        observed, problems = parse_log(args.log.read_text(encoding="utf-8").splitlines(), args.run)
    verdict = compare(expected, observed, args.vllm, args.run, problems)
    print(report(verdict, args.vllm, args.run, args.expected), file=sys.stdout if verdict.ok else sys.stderr)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())

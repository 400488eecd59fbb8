"""The messages the docs quote, found by the docs' own convention, and the two ways a test holds one to the code.

The convention (docs/troubleshooting.md, "Where to look"): a quoted message is the code's text in backticks, or one
line of an indented block (a log line), with ``<name>`` where the code fills in a value and ``...`` / ``…`` /
``[...]`` / ``(...)`` where the doc leaves text out. :func:`quotes_in` finds them: every block line but those of a
block of commands, and every backtick span that reads as a message (:func:`is_message`: four words or more, two of
them words of prose; not a command, a call, a literal or a formula).

A quote is held to the code in one of two ways (tests/unit/test_quoted_messages*.py):

* **rendered**: a test runs the code with the input that triggers the message and matches the quote against what
  it said (:func:`quote_pattern`: placeholders and gaps match any text, the rest exactly);
* **the code's format string** (:class:`CodeText`): a log line of a running engine, which a pure test cannot make
  (its worker, its pull thread, its Mooncake engine), is matched against the string literals and f-strings of
  ``vllm_kvp2p/``: every run of the quote's own text (between its placeholders, gaps and numbers, which are values)
  must be made of our literal text, pieces joining only where the code substitutes a value. A word changed on
  either side, or a message nobody wrote, does not match.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = (*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md")

#: Text a quote leaves out or names by a placeholder.
GAP = re.compile(r"<[^<>\n]+>|\[\.\.\.\]|\(\.\.\.\)|\.\.\.|…")
#: Where the code fills in a value in a literal: %-style and {}-style fields (f-strings are split by ast).
FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[sdifrgxe]|\{[^{}]*\}")
#: What a doc writes after a log line, three spaces or more from it: ``(WARNING)``, ``(platform/npu.py)``.
ANNOTATION = re.compile(r"\s{3,}\((?:[^()]|\([^()]*\))*\)\s*$")
COMMANDS = frozenset({
    "python", "python3", "pip", "bash", "git", "vllm", "vllm-kvp2p", "vllm-kvp2p-proxy", "vllm-kvp2p-serve", "ray",
    "kubectl", "hccn_tool", "nc", "flock", "curl", "export", "cd", "docker", "sudo", "ip", "tc", "make", "cmake",
    "openssl", "npu-smi", "ls", "cat", "grep", "source", "apt-get",
})


def spaces(text: str) -> str:
    return " ".join(text.split())


def quote_pattern(quote: str) -> re.Pattern[str]:
    """The quote as a regular expression: placeholders and gaps match any text, the rest itself."""
    pieces, last = [], 0
    for gap in GAP.finditer(quote):
        pieces.append(re.escape(quote[last:gap.start()]))
        literal = gap.group()
        pieces.append(r"\[.*?\]" if literal == "[...]" else r"\(.*?\)" if literal == "(...)" else ".*?")
        last = gap.end()
    pieces.append(re.escape(quote[last:]))
    return re.compile("".join(pieces), re.DOTALL)


def _tokens(text: str) -> list[str]:
    return GAP.sub("X", text).split()


def is_command(text: str) -> bool:
    tokens = _tokens(text)
    while tokens and re.match(r"[A-Z][A-Z0-9_]*=", tokens[0]):  # VAR=value before a command
        tokens = tokens[1:]
    if not tokens:
        return True
    first = tokens[0]
    return (first in COMMANDS or first.startswith(("-", "$", "./", "/", ".venv", "V/")) or first.endswith(".sh")
            or sum(t.startswith("--") for t in tokens) >= 2)


#: What only a formula holds (our messages write "x" and "-").
FORMULA = re.compile("[×≈−]")


def is_message(text: str) -> bool:
    """A backtick span that reads as a message rather than a name, a command, code or a formula."""
    if FORMULA.search(text) or re.match(r"[{\[(\"']|[\w.]+\(", text) or is_command(text):
        return False
    tokens = _tokens(text)
    prose = [t for t in tokens if re.fullmatch(r"[(\"']?[A-Za-z][a-z]+[,.;:)'\"]*", t)]
    return len(tokens) >= 4 and len(prose) >= 2


@dataclass(frozen=True)
class DocQuote:
    doc: str  # "troubleshooting.md", "README.md"
    line: int
    text: str  # white space joined, a block line without its annotation

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def quotes_in(path: Path) -> list[DocQuote]:
    """The quoted messages of one doc, in order: indented block lines (but blocks of commands) and message spans."""
    found: list[DocQuote] = []
    prose: list[str] = []  # the doc with fences and indented blocks blanked, for the spans
    fenced, block, block_indent, text_indent, blank = False, [], 0, 0, True

    def end_block() -> None:
        if block and not is_command(block[0].text):
            found.extend(q for q in block if not FORMULA.search(q.text))
        block.clear()

    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped, indent = line.strip(), len(line) - len(line.lstrip(" "))
        if stripped.startswith("```"):
            fenced = not fenced
        if fenced or stripped.startswith("```"):
            prose.append("")
            continue
        if block and (not stripped or indent >= block_indent):
            if stripped:
                block.append(DocQuote(path.name, number, spaces(ANNOTATION.sub("", line))))
            prose.append("")
            blank = not stripped
            continue
        end_block()
        if stripped and blank and indent >= text_indent + 4:  # a code block inside the text it follows
            block_indent = indent
            block.append(DocQuote(path.name, number, spaces(ANNOTATION.sub("", line))))
            prose.append("")
            blank = False
            continue
        if stripped:
            item = re.match(r"\s*(?:[*+-]|\d+\.)\s+", line)
            text_indent = len(item.group()) if item else indent
        prose.append(line)
        blank = not stripped
    end_block()
    body = "\n".join(prose)
    for span in re.finditer(r"(?<!`)(`+)(?!`)((?:(?!\n\s*\n).)+?)(?<!`)\1(?!`)", body, re.DOTALL):
        text = spaces(span.group(2))
        if is_message(text):
            found.append(DocQuote(path.name, body.count("\n", 0, span.start()) + 1, text))
    return found


def all_quotes() -> list[DocQuote]:
    return [quote for doc in DOCS for quote in quotes_in(doc)]


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


#: How a piece of the code's text begins and ends: a string's own start or end, or a value filled in there.
STRING_START, AFTER_VALUE, STRING_END, BEFORE_VALUE = "\x02", "\x03", "\x04", "\x05"
BOUNDS = STRING_START + AFTER_VALUE + STRING_END + BEFORE_VALUE


def _pieces(text: str) -> list[str]:
    """A literal's text cut where the code fills in a value, each piece marked with how it begins and ends."""
    parts = FIELD.split(text)
    return [(STRING_START if i == 0 else AFTER_VALUE) + re.sub(r"\s+", " ", part)
            + (STRING_END if i == len(parts) - 1 else BEFORE_VALUE) for i, part in enumerate(parts)]


class CodeText:
    """The literal text of vllm_kvp2p's string constants and f-strings, cut where the code fills in a value, and
    its class names (a message may name one: ``ReadBatch``). Docstrings are prose, not messages: left out."""

    def __init__(self, package: Path = ROOT / "vllm_kvp2p") -> None:
        self.package = package

    @cached_property
    def _joined(self) -> str:
        pieces: list[str] = []
        for source in sorted(self.package.rglob("*.py")):
            tree = ast.parse(source.read_text(), str(source))
            skip = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    pieces.append(STRING_START + node.name + STRING_END)
                elif isinstance(node, ast.JoinedStr):
                    text = "".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{}"
                                   for v in node.values)
                    pieces.extend(_pieces(text))
                    skip.update(id(v) for v in node.values)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                    pieces.extend(_pieces(node.value))
        # No search for a run of text crosses a boundary mark. Each literal again with its values left empty: a
        # message whose value is "" (``{said}`` with nothing to say) reads as its two pieces joined.
        marked = "".join(pieces)
        return marked + marked.replace(BEFORE_VALUE + AFTER_VALUE, "")

    def _covered(self, run: str, after_value: bool) -> bool:
        """``run`` is the text of one piece (a value left empty joins its two pieces), or reads as a message
        composed of several: the end of a piece, then at a value another string (a nested message) or, once a run,
        a whole string the doc wrote out (a constant, a class name: words) followed by the rest of the piece's
        string, and at last the start of a piece. " KV layers" (the end of one message) and ", D has " (the middle
        of another) do not make "KV layers, D has", nor do the values "KV" and "layers" with a " " piece between.
        ``after_value``: the doc wrote a value just before the run (a placeholder, a number), so the run may begin
        as the piece after a value."""
        joined = self._joined
        if run in joined:
            return True
        n = len(run)
        # Joins between words only (a value is a word or more): where run[i - 1] and run[i] are not both letters.
        joins = [0 < i < n and not (run[i - 1].isalnum() and run[i].isalnum()) for i in range(n + 1)]
        # What may begin at position i: "string" (a value's place: a string begins, nested or appended, or a value
        # is written out) or "after" (the piece after a value), each with whether the run wrote out its value.
        states: list[set[tuple[str, bool]]] = [set() for _ in range(n + 1)]
        if after_value:
            states[0] |= {("after", False), ("string", False)}
        for i in range(1, n):
            if joins[i] and re.search("[A-Za-z]", run[:i]):
                if run[:i] + BEFORE_VALUE in joined:
                    states[i].add(("string", False))
                if run[:i] + STRING_END in joined:  # a string ended: another begins, or its enclosing one goes on
                    states[i] |= {("string", False), ("after", False)}
        for i in range(n):
            for kind, wrote in list(states[i]):
                begin = STRING_START if kind == "string" else AFTER_VALUE
                if begin + run[i:] in joined:
                    return True  # the rest starts a nested message, or is the piece after the value
                for j in range(i + 1, n):
                    if not joins[j]:
                        continue
                    piece = run[i:j]
                    words = bool(re.search("[A-Za-z]", piece))
                    if kind == "string" and not wrote and words and all(
                            STRING_START + part + STRING_END in joined for part in piece.split(".")):
                        states[j].add(("after", True))  # the value, written out (``Class.method``: both names)
                    if begin == STRING_START and not words:
                        continue  # a string's own first piece carries words (a lone ", " would join anything)
                    if begin + piece + BEFORE_VALUE in joined:
                        states[j].add(("string", wrote))
                    if begin + piece + STRING_END in joined:
                        states[j] |= {("string", wrote), ("after", wrote)}
        return False

    def matches(self, quote: str) -> bool:
        """Every run of the quote's own text, between its placeholders, gaps, numbers and quoted values
        (``'0.0.0.0'``, a repr), is our literal text."""
        values = re.sub(r"'[^'\s]*'|\"[^\"\s]*\"|\d+", "<value>", quote)
        runs = GAP.split(values)
        return all(self._covered(run, after_value=k > 0) for k, run in enumerate(runs) if re.search("[A-Za-z]", run))


@lru_cache(maxsize=1)
def code_text() -> CodeText:
    return CodeText()


@dataclass(frozen=True)
class Quoted:
    """A quote a test renders: the doc, the quote as the doc has it, and the code that says it."""

    doc: str  # "troubleshooting.md", "README.md"
    quote: str
    render: Callable[..., str]  # takes the pytest fixtures it names (monkeypatch, tmp_path, capsys) as keywords
    after: str = ""  # the message is the quote's text after this prefix (a caller's log prefix: the code's text too)
    part: bool = False  # the doc quotes a part of the message (its text around the quote is not the doc's)

    @property
    def id(self) -> str:
        return f"{self.doc}: {self.quote[:60]}"


def doc_path(doc: str) -> Path:
    return ROOT / doc if doc == "README.md" else ROOT / "docs" / doc


def check_quoted(case: Quoted, fixtures: dict[str, object]) -> None:
    """The quote is still in its doc, and the code, run, says it."""
    doc = spaces(doc_path(case.doc).read_text())
    quote = spaces(case.quote)
    assert quote in doc, f"docs/{case.doc} no longer quotes {quote!r}: update the quote here with the doc"
    wanted = case.render.__code__.co_varnames[:case.render.__code__.co_argcount]
    message = spaces(case.render(**{name: fixtures[name] for name in wanted}))
    assert message, "the code produced no message"
    template = quote
    if case.after:
        assert quote.startswith(case.after), (quote, case.after)
        assert code_text().matches(case.after), f"{case.after!r}: not the code's text (the prefix a caller logs)"
        template = quote[len(case.after):]
    pattern = quote_pattern(template)
    assert (pattern.search(message) if case.part else pattern.fullmatch(message)), (
        f"docs/{case.doc} quotes {template!r}, the code says {message!r}")

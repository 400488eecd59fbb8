"""README.md's build lines hold to pyproject.toml (issue 47, item 5): a ``pip install ... --no-build-isolation`` of
this package builds with what is installed, so the README installs every [build-system] requirement, pinned as
there, before it (with setuptools 69.3.1 and no ``wheel`` that line fails: ``invalid command 'bdist_wheel'``; with a
setuptools below the pin the sdist gets another name); and the files it installs from dist/ are the names the build
makes (PEP 625 for the sdist, from pyproject's name and version). That the lines run as written in a fresh venv was
shown by running them (the issue's closing note); this keeps them from drifting from pyproject afterwards. Pure.
"""

from __future__ import annotations

import re

import tomllib

from tests.unit.ci_scripts import ROOT, mutated, shell_commands
from tests.unit.test_sdist import sdist_file_name

README = ROOT / "README.md"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def build_line_problems(readme: str, pyproject: dict) -> list[str]:
    """Why the README's bash blocks would build this package without isolation before installing a build requirement,
    or install from dist/ a file the build does not make (empty: they do neither)."""
    requires = pyproject["build-system"]["requires"]
    problems, builds = [], 0
    for block in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL):
        installed: set[str] = set()
        for words in shell_commands(block):
            if words[:2] != ["pip", "install"]:
                continue
            if "--no-build-isolation" in words:
                builds += 1
                problems += [f"`{' '.join(words)}` comes before any `pip install {r}` (pyproject.toml's [build-system])"
                             for r in requires if r not in installed]
            installed |= set(words[2:])
    if not builds:
        problems.append("no `pip install ... --no-build-isolation` in README.md's bash blocks")
    sdist = sdist_file_name(pyproject)
    wheel_prefix = sdist.removesuffix(".tar.gz") + "-"
    for path in re.findall(r"dist/\S+?\.(?:whl|tar\.gz)", readme):
        if path != f"dist/{sdist}" and not (path.startswith(f"dist/{wheel_prefix}") and path.endswith(".whl")):
            problems.append(f"README.md installs {path}; the build makes dist/{sdist} and dist/{wheel_prefix}*.whl")
    return problems


def test_readme_installs_the_build_requirements_before_building_without_isolation() -> None:
    assert build_line_problems(README.read_text(), PYPROJECT) == []


def test_the_check_fails_on_the_readme_s_old_lines() -> None:
    text = README.read_text()
    old_line = "pip install torch==2.13.0 pybind11 'cmake>=3.22' ninja\n"
    new_line = next(line for line in text.splitlines(keepends=True) if line.startswith("pip install torch=="))
    problems = build_line_problems(mutated(text, new_line, old_line), PYPROJECT)
    assert any("pip install setuptools>=69.3.1,!=69.4.0" in p for p in problems), problems
    assert any("pip install wheel" in p for p in problems), problems
    renamed = build_line_problems(text.replace("dist/vllm_kvp2p-0.1.0.tar.gz", "dist/vllm-kvp2p-0.1.0.tar.gz"),
                                  PYPROJECT)
    assert any("installs dist/vllm-kvp2p-0.1.0.tar.gz" in p for p in renamed), renamed
    bumped = {**PYPROJECT, "project": {**PYPROJECT["project"], "version": "0.2.0"}}
    assert any("dist/vllm_kvp2p-0.2.0.tar.gz" in p for p in build_line_problems(text, bumped))

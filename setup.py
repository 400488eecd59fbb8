"""Build logic only (metadata lives in pyproject.toml): the C++ extensions, built by one CMake run.

  vllm_kvp2p._C      descriptor builder (plain pybind11); always built
  vllm_kvp2p._arena  KV arena CPU allocator (links torch's libc10); built when torch is importable at build time,
                     e.g. `pip install -e . --no-build-isolation` in an environment that has torch. Otherwise CMake
                     says once that it is skipped and the rest installs as usual.

Environment:
  VLLM_KVP2P_SKIP_EXT=1       do not build the extensions (the package then uses its pure-Python paths)
  CMAKE_BUILD_PARALLEL_LEVEL  parallel compile jobs (default: number of CPUs)
  CMAKE_BUILD_TYPE            Release (default), Debug, RelWithDebInfo, ...
  CMAKE_ARGS                  extra configure arguments, e.g. "-DKVP2P_BUILD_NPU=ON" or "-DKVP2P_BUILD_ARENA=OFF"
  CMAKE_GENERATOR             CMake's own variable, honoured by cmake itself
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

ROOT = Path(__file__).resolve().parent
SKIP_EXT = os.environ.get("VLLM_KVP2P_SKIP_EXT", "").strip().lower() in ("1", "true", "yes", "on")


class CMakeExtension(Extension):
    """An extension whose whole build is delegated to CMakeLists.txt in ``sourcedir``."""

    def __init__(self, name: str, sourcedir: Path = ROOT) -> None:
        # Listing the CMake inputs as "sources" only makes sdists carry them; setuptools never compiles them.
        sources = ["CMakeLists.txt"] + sorted(
            p.relative_to(sourcedir).as_posix()
            for p in (sourcedir / "csrc").rglob("*")
            if p.is_file() and p.suffix in (".cpp", ".cc", ".h", ".hpp")
        )
        super().__init__(name, sources=sources)
        self.sourcedir = sourcedir


def _cmake_executable() -> str:
    """The cmake from the `cmake` wheel (build requirement) if installed, else the one on PATH."""
    try:
        import cmake  # type: ignore[import-not-found]

        candidate = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if candidate.is_file():
            return str(candidate)
    except (ImportError, AttributeError):
        pass
    found = shutil.which("cmake")
    if found is None:
        raise CompileError("cmake not found: pip install 'cmake>=3.22' (or set VLLM_KVP2P_SKIP_EXT=1)")
    return found


def _pybind11_cmake_dir() -> str:
    try:
        import pybind11
    except ImportError as exc:
        raise CompileError("pybind11 not found: pip install pybind11 (or set VLLM_KVP2P_SKIP_EXT=1)") from exc
    return pybind11.get_cmake_dir()


def _read_cache(build_dir: Path) -> dict[str, str]:
    """The entries of build_dir/CMakeCache.txt, name -> value ({} when there is none)."""
    cache = build_dir / "CMakeCache.txt"
    entries: dict[str, str] = {}
    if cache.is_file():
        for line in cache.read_text(errors="replace").splitlines():
            key, sep, value = line.partition("=")
            if sep and ":" in key and not key.startswith(("//", "#")):
                entries[key.split(":", 1)[0]] = value
    return entries


def _drop_stale_cache(build_dir: Path, source_dir: Path, cmake: str) -> None:
    """Forget a CMake cache made by another cmake binary (e.g. from a deleted pip build env), generator or tree."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return
    entries = _read_cache(build_dir)
    cached = entries.get("CMAKE_COMMAND", "")
    stale = not cached or not Path(cached).exists() or Path(cached).resolve() != Path(cmake).resolve()
    generator = os.environ.get("CMAKE_GENERATOR")
    if generator and entries.get("CMAKE_GENERATOR") != generator:
        stale = True
    if Path(entries.get("CMAKE_HOME_DIRECTORY", "")).resolve() != source_dir.resolve():
        stale = True
    if stale:
        cache.unlink()
        shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)


class CMakeBuild(build_ext):
    """One CMake configure and one build for all CMakeExtensions (they share CMakeLists.txt), then one copy each.

    CMake decides which modules this machine can build (it lists them in the cache entry KVP2P_PYTHON_MODULES,
    e.g. no _arena without torch); extensions it did not configure are dropped from this build, so setuptools
    neither expects nor copies them.
    """

    def build_extensions(self) -> None:
        cmake_exts = [e for e in self.extensions if isinstance(e, CMakeExtension)]
        if cmake_exts:
            try:
                built = self._build_cmake(cmake_exts)
            except (subprocess.CalledProcessError, OSError) as exc:
                raise CompileError(
                    f"building the C++ extensions failed ({exc}); see the CMake output above. "
                    "Set VLLM_KVP2P_SKIP_EXT=1 to install without them (the pure-Python fallback is then used)."
                ) from exc
            self._cmake_outputs = built
            self.extensions = [e for e in self.extensions if not isinstance(e, CMakeExtension) or e.name in built]
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        built = self._cmake_outputs[ext.name]
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)
        shutil.copymode(built, target)
        print(f"vllm_kvp2p: {built} -> {target}", flush=True)

    def _build_cmake(self, exts: list[CMakeExtension]) -> dict[str, Path]:
        """Configure and build; returns {extension name: built module file} for the modules CMake configured."""
        sourcedirs = {e.sourcedir for e in exts}
        if len(sourcedirs) != 1:
            raise CompileError(f"all CMake extensions must share one source tree, got {sorted(map(str, sourcedirs))}")
        sourcedir = sourcedirs.pop()
        cmake = _cmake_executable()
        build_dir = Path(self.build_temp).resolve() / "cmake"
        out_dir = build_dir / "out"
        build_dir.mkdir(parents=True, exist_ok=True)
        _drop_stale_cache(build_dir, sourcedir, cmake)
        shutil.rmtree(out_dir, ignore_errors=True)

        config = os.environ.get("CMAKE_BUILD_TYPE") or ("Debug" if self.debug else "Release")
        configure = [
            cmake,
            "-S",
            str(sourcedir),
            "-B",
            str(build_dir),
            f"-DCMAKE_BUILD_TYPE={config}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={_pybind11_cmake_dir()}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            *shlex.split(os.environ.get("CMAKE_ARGS", "")),
        ]
        print("vllm_kvp2p:", shlex.join(configure), flush=True)
        try:
            subprocess.run(configure, check=True)
        except subprocess.CalledProcessError:
            # A failed configure may cache a bad choice (e.g. a compiler from CMAKE_ARGS): start clean next time.
            (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
            shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
            raise

        configured = set(filter(None, _read_cache(build_dir).get("KVP2P_PYTHON_MODULES", "_C").split(";")))
        wanted = {e.name: e.name.rsplit(".", 1)[-1] for e in exts}
        # A module CMake did not configure was skipped with CMake's own message (e.g. _arena without torch).
        targets = [module for module in wanted.values() if module in configured]
        if not targets:
            return {}

        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        build = [cmake, "--build", str(build_dir), "--config", config, "--parallel", jobs, "--target", *targets]
        print("vllm_kvp2p:", shlex.join(build), flush=True)
        subprocess.run(build, check=True)

        result: dict[str, Path] = {}
        for name, module in wanted.items():
            if module not in targets:
                continue
            built = sorted(p for p in out_dir.rglob(f"{module}.*") if p.suffix in (".so", ".pyd", ".dylib"))
            if len(built) != 1:
                raise CompileError(f"expected one built {module} module under {out_dir}, found {built}")
            result[name] = built[0]
        return result


if SKIP_EXT:
    print("vllm_kvp2p: VLLM_KVP2P_SKIP_EXT is set: not building the C++ extensions", flush=True)

setup(
    ext_modules=[] if SKIP_EXT else [CMakeExtension("vllm_kvp2p._C"), CMakeExtension("vllm_kvp2p._arena")],
    cmdclass={"build_ext": CMakeBuild},
)

"""Build-only checks of the Ascend arena backend (csrc/npu/npu_arena.cpp): it cannot run without an NPU.

With CANN installed the file is compiled against the real ``acl/acl.h``; everywhere it is compiled against the
few ACL declarations it uses, written here with the signatures CANN documents, so a typo or a broken include in
the NPU code fails CI even on machines without CANN.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.ci_mode import lacks

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "csrc" / "npu" / "npu_arena.cpp"
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")

ACL_DECLARATIONS = """
#pragma once
#include <cstddef>
typedef int aclError;
typedef void* aclrtStream;
typedef enum aclrtMemMallocPolicy { ACL_MEM_MALLOC_HUGE_FIRST, ACL_MEM_MALLOC_HUGE_ONLY, ACL_MEM_MALLOC_NORMAL_ONLY }
    aclrtMemMallocPolicy;
static const int ACL_SUCCESS = 0;
extern "C" aclError aclrtMalloc(void** devPtr, size_t size, aclrtMemMallocPolicy policy);
extern "C" aclError aclrtFree(void* devPtr);
"""


def _cann_include() -> Path | None:
    roots = [os.environ.get("KVP2P_CANN_ROOT"), os.environ.get("ASCEND_TOOLKIT_HOME"),
             os.environ.get("ASCEND_HOME_PATH"), "/usr/local/Ascend/ascend-toolkit/latest"]
    for root in filter(None, roots):
        if (Path(root) / "include" / "acl" / "acl.h").is_file():
            return Path(root) / "include"
    return None


def _syntax_check(include: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CXX, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", f"-I{REPO / 'csrc'}", f"-I{include}",
         str(SOURCE)],
        capture_output=True, text=True, timeout=120,
    )


def _require_compiler() -> None:
    """A skip where there is no C++ compiler; a failure in CI mode, whose set-up builds vllm_kvp2p._C with it."""
    if CXX is None:
        lacks("no C++ compiler")


def test_npu_arena_compiles_against_the_acl_declarations_it_uses(tmp_path: Path) -> None:
    _require_compiler()
    (tmp_path / "acl").mkdir()
    (tmp_path / "acl" / "acl.h").write_text(ACL_DECLARATIONS)
    proc = _syntax_check(tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_the_check_fails_when_an_acl_function_is_missing(tmp_path: Path) -> None:
    _require_compiler()
    (tmp_path / "acl").mkdir()
    (tmp_path / "acl" / "acl.h").write_text(ACL_DECLARATIONS.replace("aclrtFree", "aclrtFreeRenamed"))
    proc = _syntax_check(tmp_path)
    assert proc.returncode != 0 and "aclrtFree" in proc.stderr


@pytest.mark.skipif(CXX is None or _cann_include() is None,
                    reason="CANN toolkit not installed (no acl/acl.h under ASCEND_TOOLKIT_HOME, ASCEND_HOME_PATH, "
                           "KVP2P_CANN_ROOT or /usr/local/Ascend/ascend-toolkit/latest)")
def test_npu_arena_compiles_against_the_installed_cann() -> None:
    include = _cann_include()
    assert include is not None
    proc = _syntax_check(include)
    assert proc.returncode == 0, proc.stderr


def test_npu_platform_without_the_backend_says_why() -> None:
    from vllm_kvp2p import _C
    from vllm_kvp2p.platform import npu_arena
    from vllm_kvp2p.platform.npu import NpuPlatform

    if getattr(_C, "HAS_NPU", False):
        pytest.skip("this build has the NPU backend")
    reason = npu_arena.unavailable_reason()
    assert reason is not None and "built without the NPU arena" in reason
    assert NpuPlatform().kv_arena(64 << 20) is None

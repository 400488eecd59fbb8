"""The proxy's own tokenizer (``--tokenizer``): the engines' tokenizer files, vLLM's completion encoding, bounded.

That these tokens are the ones a real engine hashes is shown against vLLM's ``/tokenize`` in tests/e2e_routing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvp2p.proxy.cli import build_parser, main
from vllm_kvp2p.proxy.local_tokenizer import MAX_PROMPT_CHARS, LocalTokenizer, TokenizerSettingsError
from vllm_kvp2p.testing.tiny_model import BOS_ID, write_tokenizer_files


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(directory, vocab=512, max_pos=1024)
    return directory


@pytest.fixture(scope="module")
def local(tokenizer_dir: Path) -> LocalTokenizer:
    return LocalTokenizer(str(tokenizer_dir))


def test_completion_prompts_encode_as_vllm_does(tokenizer_dir: Path, local: LocalTokenizer) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for text in ("The cat sat on the mat.", "  leading spaces\nand a new line", "ünïcødé ✓ and emoji 🙂", "x"):
        tokens = local.tokens({"model": "m", "prompt": text})
        assert tokens == reference(text, add_special_tokens=True).input_ids and tokens[0] == BOS_ID
        assert local.tokens({"prompt": text, "add_special_tokens": False}) == tokens[1:]


@pytest.mark.parametrize("body", [
    {"prompt": 7}, {"prompt": ["a"]}, {"prompt": None}, {}, {"messages": [{"role": "user", "content": "hi"}]},
    {"prompt": "ok", "add_special_tokens": "yes"}, {"prompt": "ok", "add_special_tokens": 1},
    {"prompt": "a" * (MAX_PROMPT_CHARS + 1)},
], ids=["int", "list", "none", "empty", "chat", "str-flag", "int-flag", "too-long"])
def test_what_it_does_not_tokenize(local: LocalTokenizer, body: dict[str, object]) -> None:
    """Chat requests (the engine's template decides), odd types and prompts past the bound: left to /tokenize or
    routed by load, never an exception in the request path."""
    assert local.tokens(body) is None


def test_a_tokenizer_that_cannot_load_names_the_setting(tmp_path: Path) -> None:
    for where in (str(tmp_path / "missing"), str(tmp_path)):  # absolute paths: never a hub download
        with pytest.raises(TokenizerSettingsError, match="--tokenizer"):
            LocalTokenizer(where)


def test_cli_refuses_a_tokenizer_it_cannot_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--prefill-kv-events", "tcp://127.0.0.1:9"]
    assert build_parser().parse_args(args).tokenizer is None
    with pytest.raises(SystemExit) as exc:
        main([*args, "--tokenizer", str(tmp_path / "missing")])
    assert exc.value.code == 2 and "--tokenizer" in capsys.readouterr().err

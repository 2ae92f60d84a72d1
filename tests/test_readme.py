"""The README's code runs as pasted, and the README points nowhere outside the repository."""
from __future__ import annotations

import os
import re

import pytest
import torch

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def _blocks(language: str) -> list[str]:
    text = open(README, encoding="utf-8").read()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


GPT_OSS_PATH = "/path/to/gpt-oss-20b"  # the gpt-oss example's checkpoint; the test writes a small one there


def test_the_python_blocks_run_as_pasted(no_triton_interpret, capsys):
    """On the CPU (the emulation, as a new user without TRITON_INTERPRET gets) or on the GPU where there is one."""
    blocks = [b for b in _blocks("python") if GPT_OSS_PATH not in b]
    assert blocks, "the README has a Use example"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert out.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert "w4a16" in capsys.readouterr().out


def test_the_install_and_test_commands_are_there():
    commands = "\n".join(_blocks("bash"))
    assert "python3 -m venv .venv" in commands and "pip install ." in commands
    assert 'pip install ".[test]" && python -m pytest -q' in commands  # what .ci/run calls


def test_no_reference_outside_the_repository():
    text = open(README, encoding="utf-8").read()
    assert "../" not in text
    for path in re.findall(r"`((?:docs|scripts|mxmoe|tests)/[\w./-]+)`", text):
        assert os.path.exists(os.path.join(os.path.dirname(README), path)), path


def test_the_gpt_oss_block_runs_as_pasted(no_triton_interpret, tmp_path):
    """The gpt-oss example as pasted, its checkpoint path replaced by a small random gpt-oss checkpoint in the format of
    openai/gpt-oss-* (tests/test_transformers.py writes it)."""
    pytest.importorskip("transformers")
    from test_transformers import write_checkpoint

    blocks = [b for b in _blocks("python") if GPT_OSS_PATH in b]
    assert len(blocks) == 1, "the README has one gpt-oss example"
    write_checkpoint(str(tmp_path))
    namespace: dict = {}
    exec(compile(blocks[0].replace(GPT_OSS_PATH, str(tmp_path)), "README.md", "exec"), namespace)
    assert namespace["out"].shape == namespace["x"].shape and bool(torch.isfinite(namespace["out"].float()).all())
    assert namespace["experts"].activation.name == "swigluoai"
    assert type(namespace["model"].model.layers[0].mlp.experts).__name__ == "GptOssMxmoeExperts"
    assert namespace["tokens"].shape == (1, 11)

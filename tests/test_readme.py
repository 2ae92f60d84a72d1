"""The README's code runs as pasted, and the README points nowhere outside the repository."""
from __future__ import annotations

import os
import re

import torch

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def _blocks(language: str) -> list[str]:
    text = open(README, encoding="utf-8").read()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_the_python_blocks_run_as_pasted(no_triton_interpret, capsys):
    """On the CPU (the emulation, as a new user without TRITON_INTERPRET gets) or on the GPU where there is one."""
    blocks = _blocks("python")
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

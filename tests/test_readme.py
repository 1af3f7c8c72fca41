"""The README's Python example runs and prints what its comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_prints_what_it_says():
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    code = block.group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    printed = out.getvalue().splitlines()
    claimed = [
        line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(")
    ]
    assert printed[0] == claimed[0]
    assert printed[1] == claimed[1]
    assert printed[2].startswith("{'blocks': 90, 'capacity_blocks': 200000")

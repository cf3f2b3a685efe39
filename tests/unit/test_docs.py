"""Every ```python block in docs/*.md and README.md runs (blocks of one page share a namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"])
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists()], ids=lambda p: p.name)
def test_doc_examples_run(page: Path) -> None:
    namespace: dict = {"__name__": f"doc_{page.stem}"}
    for i, block in enumerate(BLOCK.findall(page.read_text())):
        if block.lstrip().startswith("# doc: skip"):
            continue
        # dont_inherit: a page runs as its reader runs it, not under this module's
        # `from __future__ import annotations` (which breaks dataclasses defined there)
        code = compile(block, f"{page.name}[block {i}]", "exec", dont_inherit=True)
        exec(code, namespace)

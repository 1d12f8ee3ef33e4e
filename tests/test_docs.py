"""Every fenced ``python`` and ``bash`` block of README.md and docs/*.md runs as pasted.

The blocks of one page run in order in one empty directory, as a reader would paste them (a
training script reads the plan an earlier block saved). How each block runs:

- a python block whose first line names ``torchrun ... --nproc-per-node N`` runs on N gloo ranks
  of the session's rank pool (``tests/rank_pool.py``). The pool's ranks already joined a process
  group, so the block's ``init_process_group`` and ``destroy_process_group`` calls are no-ops there;
  everything else runs as torchrun would run it. Such pages are marked ``multiproc``;
- any other python block runs in this process (``__name__ == "__main__"``);
- a bash block runs in ``bash -e`` with this interpreter's ``bin/`` first on ``PATH``;
- a block preceded by ``<!-- docs-test: skip REASON -->`` is not run; only README's two top
  commands are (each runs the whole set-up, and ``scripts/test.sh`` runs this very file).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"(?P<skip><!-- docs-test: skip (?P<reason>[^>]*?) -->\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.M | re.S)
_TORCHRUN = re.compile(r"torchrun\b.*--nproc-per-node[ =](\d+)")
_BASH_TIMEOUT_S = 300


@dataclass(frozen=True, slots=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    skip_reason: str | None

    @property
    def num_ranks(self) -> int:
        """Ranks a python block needs: N from a first line naming ``torchrun --nproc-per-node N``."""
        first = self.code.split("\n", 1)[0]
        match = _TORCHRUN.search(first) if self.lang == "python" else None
        return int(match.group(1)) if match else 1

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        if match.group("lang") not in ("python", "bash"):
            continue
        line = text.count("\n", 0, match.start("lang")) + 1
        found.append(Block(str(page.relative_to(ROOT)), line, match.group("lang"), match.group("code"), match.group("reason")))
    return found


def _page_param(page: Path):
    blocks = blocks_of(page)
    marks = [pytest.mark.multiproc] if any(b.num_ranks > 1 and not b.skip_reason for b in blocks) else []
    return pytest.param(page, marks=marks, id=str(page.relative_to(ROOT)))


def test_only_the_two_top_commands_are_skipped():
    skipped = [b.code.strip() for page in PAGES for b in blocks_of(page) if b.skip_reason]
    assert skipped == ["bash scripts/demo.sh", "bash scripts/test.sh"], skipped


def test_every_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("page", [_page_param(p) for p in PAGES])
def test_code_blocks_run(page: Path, tmp_path, monkeypatch, rank_pool):
    monkeypatch.chdir(tmp_path)
    for block in blocks_of(page):
        if block.skip_reason:
            continue
        if block.lang == "bash":
            _run_bash(block, tmp_path)
        elif block.num_ranks > 1:
            rank_pool(block.num_ranks).run(_run_on_rank, block.code, block.name, str(tmp_path))
        else:
            _run_python(block.code, block.name)


def _run_python(code: str, name: str) -> None:
    exec(compile(code, name, "exec"), {"__name__": "__main__"})


def _run_bash(block: Block, cwd: Path) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", "-e", "-c", block.code], cwd=cwd, env=env, capture_output=True, text=True, timeout=_BASH_TIMEOUT_S
    )
    if done.returncode != 0:
        pytest.fail(
            f"{block.name}: bash block exited {done.returncode}\n{block.code}\n"
            f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
        )


def _run_on_rank(rank: int, world_size: int, code: str, name: str, cwd: str) -> None:
    """One rank of a torchrun block: the pool's process group stands in for the block's own."""
    import torch.distributed as dist

    saved = (dist.init_process_group, dist.destroy_process_group, os.getcwd())
    dist.init_process_group = lambda *args, **kwargs: None
    dist.destroy_process_group = lambda *args, **kwargs: None
    os.chdir(cwd)
    try:
        _run_python(code, name)
    finally:
        dist.init_process_group, dist.destroy_process_group = saved[0], saved[1]
        os.chdir(saved[2])

"""A DDP script changes by one line: ``examples/nanogpt/train.py`` (nanoGPT's habits: per-rank
seeds, the optimizer built before the wrap, ``model.module``, evaluation and checkpoints on the
master rank alone, ``require_backward_grad_sync``, a resume) with its wrap line switched between
DDP and ``autopar.compile`` runs on 2 gloo ranks (and autopar's on 4), and its losses equal one eager process on the
same global batches (float64, 1e-6 relative; they agree to about 1e-15)."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "nanogpt" / "train.py"


def _run_script(argv: list[str]) -> list[str]:
    """The script's ``eval``/``iter`` lines, run in this process as ``python train.py *argv``."""
    out = io.StringIO()
    saved_argv, saved_dtype = sys.argv, torch.get_default_dtype()  # the script sets float64
    sys.argv = [str(SCRIPT), *argv]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        sys.argv = saved_argv
        torch.set_default_dtype(saved_dtype)
    return [line for line in out.getvalue().splitlines() if line.startswith(("eval", "iter"))]


def _on_rank(rank: int, world: int, out_dir: str, wrap: str, resume: bool) -> list[str]:
    return _run_script(["--wrap", wrap, "--out-dir", out_dir, "--max-iters", "4"] + (["--resume"] if resume else []))


@pytest.mark.multiproc
def test_the_ddp_script_with_autopar_equals_ddp_and_eager(rank_pool, tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    eager = _run_script(["--out-dir", str(tmp_path / "eager"), "--max-iters", "4"])
    pool = rank_pool(2)
    runs = {wrap: pool.run(_on_rank, str(tmp_path / wrap), wrap, False, timeout_s=240)[0] for wrap in ("autopar", "ddp")}
    # the master saved at iterations 0 and 2; a resume from iteration 2 gives iterations 2 and 3 again
    resumed = pool.run(_on_rank, str(tmp_path / "autopar"), "autopar", True, timeout_s=240)[0]
    runs["autopar on 4 ranks"] = rank_pool(4).run(_on_rank, str(tmp_path / "four"), "autopar", False, timeout_s=300)[0]
    want = dict(_pairs(eager))
    assert len(want) == 8, eager
    for name, lines in [*runs.items(), ("autopar resumed", resumed)]:
        got = dict(_pairs(lines))
        assert got, f"{name} printed no losses: {lines}"
        for key, value in got.items():
            assert abs(value - want[key]) <= 1e-6 * abs(want[key]), f"{name} {key}: {value!r}, eager {want[key]!r}"
    assert set(dict(_pairs(resumed))) == {"eval 2 train", "eval 2 val", "iter 2", "iter 3"}


def _pairs(lines: list[str]) -> list[tuple[str, float]]:
    """("iter N", loss) and ("eval N train"/"val", loss) of the script's lines."""
    out = []
    for line in lines:
        words = line.replace(":", "").replace(",", "").split()
        if words[0] == "iter":
            out.append((f"iter {words[1]}", float(words[3])))
        else:
            out += [(f"eval {words[1]} train", float(words[3])), (f"eval {words[1]} val", float(words[5]))]
    return out

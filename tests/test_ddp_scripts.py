"""A DDP script changes by one line. ``examples/nanogpt/train.py`` (nanoGPT's habits: per-rank
seeds, the optimizer built before the wrap, ``model.module``, evaluation and checkpoints on the
master rank alone, ``require_backward_grad_sync``, a resume) and ``examples/ddp_classifier/train.py``
(the ImageNet example's: a ``DistributedSampler``, the loss and accuracy taken from the model's
outputs on the rank's own rows, validation on every rank) with their wrap line switched between
DDP and ``autopar.compile`` run on 2 gloo ranks (and nanoGPT's autopar on 4), and their losses
equal one eager process on the same global batches (float64, 1e-6 relative; they agree to about
1e-15)."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPT = EXAMPLES / "nanogpt" / "train.py"
CLASSIFIER = EXAMPLES / "ddp_classifier" / "train.py"


def _run_script(argv: list[str], script: Path = SCRIPT) -> list[str]:
    """The script's ``eval``/``iter`` (``train``/``val``) lines, run in this process as ``python train.py *argv``."""
    out = io.StringIO()
    saved_argv, saved_dtype = sys.argv, torch.get_default_dtype()  # the script sets float64
    sys.argv = [str(script), *argv]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved_argv
        torch.set_default_dtype(saved_dtype)
    return [line for line in out.getvalue().splitlines() if line.startswith(("eval", "iter", "train", "val"))]


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


def _classifier_on_rank(rank: int, world: int, wrap: str) -> list[str]:
    return _run_script(["--wrap", wrap], CLASSIFIER)


@pytest.mark.multiproc
def test_the_imagenet_style_script_with_autopar_equals_ddp_and_eager(rank_pool, monkeypatch):
    """The script takes its loss and accuracy from the outputs on its own rows, as DDP's model returns
    them: autopar's outputs under ``batch="per_rank"`` are the rank's rows (they were the global
    batch's, and ``criterion(output, target)`` stopped at a shape mismatch)."""
    monkeypatch.delenv("RANK", raising=False)
    eager = _run_script(["--ranks", "2"], CLASSIFIER)
    assert len(eager) == 10, eager  # 2 epochs of 4 steps and a validation
    pool = rank_pool(2)
    for wrap in ("autopar", "ddp"):
        got = pool.run(_classifier_on_rank, wrap, timeout_s=240)[0]
        assert [line.split(":")[0] for line in got] == [line.split(":")[0] for line in eager], got
        for line, want in zip(got, eager):
            for value, reference in zip(_numbers(line), _numbers(want)):
                assert abs(value - reference) <= 1e-6 * abs(reference) + 1e-12, f"{wrap}: {line!r}, eager {want!r}"


def _numbers(line: str) -> list[float]:
    """The loss and the accuracy of a ``train E.S: loss L acc A`` or ``val E: ...`` line."""
    words = line.split()
    return [float(words[3]), float(words[5])]

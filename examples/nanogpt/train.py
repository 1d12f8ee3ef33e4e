"""A DDP training script in the shape of karpathy/nanoGPT's ``train.py`` (written for autopar's
tests, not copied), whose wrap line is DDP's or autopar's: everything else is the same script.

    torchrun --standalone --nproc-per-node 2 examples/nanogpt/train.py --wrap autopar
    torchrun --standalone --nproc-per-node 2 examples/nanogpt/train.py --wrap ddp
    python examples/nanogpt/train.py                  # one process, no wrap: the eager reference

nanoGPT's habits, each a thing a drop-in must survive: ``seed_offset = rank`` (ranks build
different initial weights), the optimizer built by ``model.configure_optimizers`` before the wrap,
``raw_model = model.module``, ``raw_model.estimate_mfu``, ``estimate_loss()`` on the master rank
only, gradient accumulation with ``require_backward_grad_sync``, gradient clipping, a cosine
learning-rate schedule, and a checkpoint saved with ``torch.save(raw_model.state_dict())`` and
resumed (``--resume``). Data are synthetic: every batch is a slice of one global batch drawn from
(split, step, micro-step), so one process on the whole global batch is the reference. Prints one
``iter N: loss L`` line per step (float64, exact digits) and the evaluation's losses.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import GPT, GPTConfig  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--wrap", choices=("ddp", "autopar"), default="autopar")
parser.add_argument("--out-dir", default="out-nanogpt")
parser.add_argument("--max-iters", type=int, default=4)
parser.add_argument("--eval-interval", type=int, default=2)
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

# -- config, as nanoGPT's globals -----------------------------------------------------------------
global_batch_size = 8  # rows per micro-step over all ranks
block_size = 32
gradient_accumulation_steps = 2
eval_iters = 2
learning_rate, min_lr, warmup_iters = 1e-3, 1e-4, 2
weight_decay, beta1, beta2, grad_clip = 0.1, 0.9, 0.95, 1.0
model_args = dict(block_size=block_size, vocab_size=128, n_layer=2, n_head=2, n_embd=32, bias=True)
torch.set_default_dtype(torch.float64)  # exact comparisons between the wraps and eager

# -- distributed set-up ---------------------------------------------------------------------------
ddp = int(os.environ.get("RANK", -1)) != -1
owns_group = ddp and not dist.is_initialized()  # a test's ranks may have joined one already
if ddp:
    if owns_group:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    ddp_rank, ddp_world_size = dist.get_rank(), dist.get_world_size()
    master_process = ddp_rank == 0
    seed_offset = ddp_rank  # each rank builds other initial weights: the wrap must make them agree
else:
    ddp_rank, ddp_world_size, master_process, seed_offset = 0, 1, True, 0
batch_size = global_batch_size // ddp_world_size
os.makedirs(args.out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)


def get_batch(split: str, step: int, micro_step: int, whole: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of (split, step, micro-step), or all of them."""
    generator = torch.Generator().manual_seed(("train", "val").index(split) * 1_000_003 + step * 101 + micro_step)
    data = torch.randint(0, model_args["vocab_size"], (global_batch_size, block_size + 1), generator=generator)
    rows = data if whole else data[ddp_rank * batch_size : (ddp_rank + 1) * batch_size]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


# -- model, optimizer (before the wrap, as nanoGPT), resume ---------------------------------------
iter_num = 0
model = GPT(GPTConfig(**model_args))
ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
checkpoint = None
if args.resume:
    checkpoint = torch.load(ckpt_path, weights_only=False)
    model.load_state_dict(checkpoint["model"])
    iter_num = checkpoint["iter_num"]
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), "cpu")
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint["optimizer"])
checkpoint = None
X, Y = get_batch("train", iter_num, 0)
if ddp:
    if args.wrap == "ddp":
        model = DDP(model)
    else:
        import autopar

        model = autopar.compile(
            model,
            (ddp_world_size,),
            example_inputs=(X.repeat(ddp_world_size, 1), Y.repeat(ddp_world_size, 1)),
            data=autopar.DataOptions(batch="per_rank"),
        )
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            x, y = get_batch(split, 10_000 + k, 0, whole=True)  # the master evaluates the global batch
            _, loss = model(x, y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / max(1, args.max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


# -- training loop --------------------------------------------------------------------------------
t0 = time.time()
while iter_num < args.max_iters:
    for group in optimizer.param_groups:
        group["lr"] = get_lr(iter_num)
    if iter_num % args.eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"eval {iter_num}: train {losses['train']!r} val {losses['val']!r}", flush=True)
        checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
        torch.save(checkpoint, ckpt_path)
    total = 0.0
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        X, Y = get_batch("train", iter_num, micro_step)
        _, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if ddp:  # each rank's loss is its rows'; the global batch's is their mean, as one process computes it
        summed = torch.tensor([total])
        dist.all_reduce(summed)
        total = summed.item() / ddp_world_size
    dt = time.time() - t0
    t0 = time.time()
    if master_process:
        mfu = raw_model.estimate_mfu(batch_size * gradient_accumulation_steps, dt)
        print(f"iter {iter_num}: loss {total!r}, mfu {mfu * 100:.6f}%", flush=True)
    iter_num += 1

if owns_group:
    dist.destroy_process_group()

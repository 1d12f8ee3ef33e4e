"""A DDP training script in the shape of PyTorch's ImageNet example (written for autopar's tests,
not copied), whose wrap line is DDP's or autopar's: everything else is the same script.

    torchrun --standalone --nproc-per-node 2 examples/ddp_classifier/train.py --wrap autopar
    torchrun --standalone --nproc-per-node 2 examples/ddp_classifier/train.py --wrap ddp
    python examples/ddp_classifier/train.py --ranks 2   # one process, no wrap: the eager reference

Its habits, each a thing a drop-in must survive: a ``DistributedSampler`` deals each rank its own
rows (``set_epoch`` each epoch), the script takes the loss and the accuracy from the model's
outputs, ``criterion(model(images), target)`` and ``output.argmax(1) == target``, on the rank's own
rows; SGD with momentum and weight decay built after the wrap, a step learning-rate schedule, and a
validation pass in eval mode under ``torch.no_grad()`` on every rank's share of the validation set,
whose sums the ranks all-reduce. ``--ranks N`` gives the one-process run the global batches of N
ranks (each step's rows of every rank's sampler, in rank order). Prints one ``train E.S`` line per
step and one ``val E`` line per epoch, with the global batch's loss and accuracy (float64, exact
digits).
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--wrap", choices=("ddp", "autopar"), default="autopar")
parser.add_argument("--ranks", type=int, default=1, help="one process: the global batches of this many ranks")
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

batch_size, classes, features = 4, 5, 24  # rows per rank and step
torch.set_default_dtype(torch.float64)  # exact comparisons between the wraps and eager

distributed = int(os.environ.get("RANK", -1)) != -1
owns_group = distributed and not dist.is_initialized()  # a test's ranks may have joined one already
if owns_group:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, args.ranks)


def dataset(rows: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(rows, features, generator=generator), torch.randint(0, classes, (rows,), generator=generator)
    )


def loaders(data: TensorDataset, shuffle: bool) -> list[DataLoader]:
    """This rank's loader, or (one process) every rank's, whose batches it joins."""
    ranks = [rank] if distributed else range(world)
    return [DataLoader(data, batch_size, sampler=DistributedSampler(data, world, r, shuffle=shuffle, seed=0)) for r in ranks]


def batches(each: list[DataLoader], epoch: int):
    for loader in each:
        loader.sampler.set_epoch(epoch)
    for parts in zip(*each):
        yield torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def summed_over_ranks(*sums: float) -> list[float]:
    totals = torch.tensor(sums)
    if distributed:
        dist.all_reduce(totals)
    return totals.tolist()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, classes))
train, val = loaders(dataset(32, 1), shuffle=True), loaders(dataset(16, 2), shuffle=False)
if distributed:
    if args.wrap == "ddp":
        model = DDP(model)
    else:
        import autopar

        example = torch.randn(batch_size * world, features)  # the global batch
        model = autopar.compile(model, (world,), example_inputs=(example,), data=autopar.DataOptions(batch="per_rank"))
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

for epoch in range(args.epochs):
    model.train()
    for step, (images, target) in enumerate(batches(train, epoch)):
        output = model(images)
        loss = criterion(output, target)
        correct = (output.argmax(1) == target).sum().item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        summed_loss, summed_correct, rows = summed_over_ranks(loss.item() * len(target), correct, len(target))
        if rank == 0:
            print(f"train {epoch}.{step}: loss {summed_loss / rows!r} acc {summed_correct / rows!r}", flush=True)
    scheduler.step()
    model.eval()
    with torch.no_grad():
        total_loss = total_correct = total_rows = 0.0
        for images, target in batches(val, epoch):
            output = model(images)
            total_loss += criterion(output, target).item() * len(target)
            total_correct += (output.argmax(1) == target).sum().item()
            total_rows += len(target)
    summed_loss, summed_correct, rows = summed_over_ranks(total_loss, total_correct, total_rows)
    if rank == 0:
        print(f"val {epoch}: loss {summed_loss / rows!r} acc {summed_correct / rows!r}", flush=True)

if owns_group:
    dist.destroy_process_group()

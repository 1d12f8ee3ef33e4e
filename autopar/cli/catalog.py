"""The names ``autopar plan --help`` lists, known without importing torch (start-up speed).

The zoo and the cost model import torch, so their lists are copied here;
tests/cli/test_main.py checks that the copies equal them."""

from __future__ import annotations

from pathlib import Path

# autopar.zoo.models.MODEL_NAMES
MODEL_NAMES = ("mlp", "gpt", "attention", "mlp_block", "cnn", "llama", "moe")
# autopar.zoo.shapes.PRESETS: published shapes, built on the meta device
MODEL_PRESETS = ("gpt2", "gpt2-xl", "llama-2-7b", "llama-2-70b", "llama-3-8b", "mixtral-8x7b")
# autopar.cost.cluster.DEFAULT_PRESET
DEFAULT_CLUSTER = "h100-80g"


def cluster_presets() -> list[str]:
    """autopar.cost.cluster.preset_names(): the JSON files beside the cost model."""
    return sorted(path.stem for path in (Path(__file__).parents[1] / "cost" / "presets").glob("*.json"))

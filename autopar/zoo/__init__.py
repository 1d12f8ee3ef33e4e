"""Reference models (``models``) and published model shapes (``shapes``), used by the tests, the CLI
and the benchmarks. Plain ``nn.Module``s: nothing here depends on the compiler."""

from autopar.zoo.models import GPT, MLP, Llama, SmallCNN, build_model, example_batch

__all__ = ["GPT", "MLP", "Llama", "SmallCNN", "build_model", "example_batch"]

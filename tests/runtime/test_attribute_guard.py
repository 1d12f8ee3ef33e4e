"""A plain attribute the traced forward read, set after ``compile``, is refused at the next call
(``trace.reads``, ``runtime.attribute_guard``): the graph holds the value it was traced with."""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.errors import ConfigError, ModelError
from autopar.trace import trace


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.inner.gain = 1.0  # read through the submodule
        self.scale, self.use_extra, self.unread = 1.0, False, 3
        self.last_rows = 0
        self.mask = torch.ones(4)  # a plain tensor attribute: the graph holds this very tensor

    def forward(self, x):
        self.last_rows = x.shape[0]  # set by forward itself: the graph's value is the one left
        y = self.inner(x) * self.scale * self.inner.gain * self.last_rows * self.mask
        if self.use_extra:
            y = y + 1
        return y.sum()


def test_the_trace_records_the_scalar_attributes_forward_reads():
    model, x = Scaled(), torch.randn(2, 4)
    reads = trace(model, (x,)).reads
    assert [(fqn, name) for fqn, name, _ in reads] == [("", "mask"), ("", "scale"), ("", "use_extra"), ("inner", "gain")]
    assert reads[0][2] is model.mask and reads[1][2] == 1.0  # not last_rows, which forward sets itself
    assert type(model) is Scaled and type(model.inner) is torch.nn.Linear  # the classes are the model's again


@pytest.mark.parametrize("where", ["pm", "pm.module", "model", "pm.module.inner", "model.inner"])
def test_setting_a_read_attribute_after_compile_is_refused_until_it_is_set_back(world_of_one, where):
    model, x = Scaled(), torch.randn(2, 4)
    pm = autopar.compile(model, (1,), example_inputs=(x,), cluster="cpu")
    want = pm(x)
    target = {"pm": pm, "pm.module": pm.module, "model": model, "pm.module.inner": pm.module.inner, "model.inner": model.inner}[
        where
    ]
    name = "gain" if where.endswith("inner") else "scale"
    target.unread = 4  # not read by forward: nothing to refuse
    target.last_rows = 7  # set by forward before it reads it: nothing either
    torch.testing.assert_close(pm(x), want)
    setattr(target, name, 2.0)
    with pytest.raises(
        ConfigError, match=rf"^{where}\.{name} is 2\.0, but the compiled graph holds 1\.0.*Compile the model again"
    ):
        pm(x)
    setattr(target, name, 1.0)
    torch.testing.assert_close(pm(x), want)
    pm.module.use_extra = True
    with pytest.raises(ConfigError, match=r"pm\.module\.use_extra is True"):
        pm(x)


def test_a_tensor_attribute_changed_in_place_reaches_the_graph_and_one_assigned_is_refused(world_of_one):
    model, x = Scaled(), torch.randn(2, 4)
    pm = autopar.compile(model, (1,), example_inputs=(x,), cluster="cpu")
    want = pm(x)
    pm.module.mask.mul_(2.0)  # the graph's own tensor
    torch.testing.assert_close(pm(x), 2 * want)
    pm.module.mask = torch.full((4,), 2.0)  # another tensor: eager reads it, the graph would not
    with pytest.raises(ConfigError, match=r"^pm\.module\.mask is another tensor than the one the compiled graph holds.*copy_"):
        pm(x)


def test_a_hugging_face_model_runs_unrefused_until_an_attention_scaling_changes(world_of_one):
    from tests.zoo import hf_models

    model, kwargs = hf_models.llama(batch_size=2)
    pm = autopar.compile(model, (1,), example_kwargs=kwargs, cluster="cpu")
    for _ in range(2):
        pm(**kwargs).loss.backward()
    pm.eval()
    with torch.no_grad():
        pm(**kwargs)  # the eval graph's reads join the guard
    pm.train()
    pm.module.model.layers[1].self_attn.scaling = 0.5
    with pytest.raises(ConfigError, match=r"pm\.module\.model\.layers\.1\.self_attn\.scaling is 0\.5"):
        pm(**kwargs)


class Counting(torch.nn.Module):
    """Reads a counter, then sets it: state each call leaves to the next."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x).sum() * (2.0 if self.calls > 2 else 1.0)


class BufferCounting(torch.nn.Module):
    """The same counter, held in a buffer updated in place, as the refusal asks."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls.add_(1)
        return self.inner(x).sum() * torch.where(self.calls > 2, 2.0, 1.0)


def test_a_forward_that_carries_state_to_the_next_call_is_refused_and_a_buffer_runs(world_of_one):
    """The graph holds the counter's value when traced and never sets it: every call computed
    as the first, where eager's third call doubled, without a word. In a buffer, it runs as eager."""
    x = torch.randn(2, 4)
    assert trace(Counting(), (x,)).carried == (("", "calls"),)
    with pytest.raises(ModelError, match=r"forward reads and then sets 'calls'.*self\.calls\.add_\(1\)"):
        autopar.compile(Counting(), mesh=(1,), example_inputs=(x,))
    torch.manual_seed(0)
    model = BufferCounting()
    eager = copy.deepcopy(model)
    pm = autopar.compile(model, mesh=(1,), example_inputs=(x,))
    for _ in range(4):
        assert pm(x).item() == pytest.approx(eager(x).item(), rel=1e-6)
    assert pm.module.calls.item() == eager.calls.item() == 4
    assert trace(Scaled(), (x,)).carried == ()  # set before read: no state between calls


def test_compile_says_which_attributes_forward_sets_and_a_call_leaves_alone(world_of_one, caplog):
    x = torch.randn(2, 4)
    assert trace(Scaled(), (x,)).sets == (("", "last_rows"),)
    with caplog.at_level("WARNING", logger="autopar"):
        pm = autopar.compile(Scaled(), mesh=(1,), example_inputs=(x,))
    assert "the model's forward sets 'last_rows', which a call of the compiled module does not" in caplog.text
    pm(x[:1])  # eager would leave 1 there
    assert pm.module.last_rows == 0
    # a buffer set anew in forward is a mutation the graph writes back: not named
    assert trace(EmaBuffer(), (x,)).sets == ()


class EmaBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        y = self.inner(x)
        self.ema = 0.5 * self.ema + 0.5 * y.detach().mean(0)
        return (y - self.ema).pow(2).sum()

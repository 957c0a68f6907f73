"""torch.compile beyond static shapes: packed-batch training whose sequence lengths change every
step compiles at most twice (``fullgraph=True``, ``dynamic=None`` and ``True``), directly and
through transformers; ``max_seqlen`` may be an int, a 0-d tensor or ``.item()`` of one; a tensor ``window_size`` stays
in the graph.
Compiled runs use the ``aot_eager`` backend: dynamo's guards, AOT autograd and the ops' fakes are
what decide recompilation, and inductor's CPU code generation would only add minutes (the
inductor path itself is tested in tests/test_ops.py). See docs/compile.md."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from helpers import make_varlen_qkv, submodule

STEPS = 10
MAX_COMPILES = 2


@pytest.fixture
def fresh_dynamo():
    """A reset dynamo (cache and counters) before and after the test."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def compilations() -> int:
    """Graphs dynamo compiled since the last reset: with ``fullgraph=True``, one per
    (re)compilation (a restarted analysis inside one compilation counts once)."""
    return counters["stats"]["unique_graphs"]


@pytest.fixture
def seen_by_backend(flash_attn, monkeypatch):
    """``(max_seqlen_q, max_seqlen_k, window_left, window_right)`` of every forward the CPU
    backend runs: what a compiled graph hands the kernels at run time."""
    cpu = submodule(flash_attn, "_cpu")
    seen = []
    forward = cpu.forward

    def recording(*args, params, **kwargs):
        seen.append((params.max_seqlen_q, params.max_seqlen_k, params.window_left,
                     params.window_right))
        return forward(*args, params=params, **kwargs)

    monkeypatch.setattr(cpu, "forward", recording)
    return seen


def _lengths(step: int) -> list[int]:
    """Three sequences whose longest changes every step (always >= 2: dynamo specialises the
    values 0 and 1)."""
    return [3 + (5 * step) % 17, 2 + step, 4 + (3 * step) % 5]


def _max_seqlen_arg(kind: str, value: int):
    return {"int": value, "tensor": torch.tensor(value, dtype=torch.int32), "item": None}[kind]


@pytest.mark.parametrize("kind, dynamic", [("int", None), ("int", True), ("tensor", True),
                                           ("item", None)],
                         ids=["int-dynamic_none", "int-dynamic_true", "tensor-dynamic_true",
                              "item-dynamic_none"])
def test_varlen_changing_max_seqlen_compiles_at_most_twice(flash_attn, fresh_dynamo,
                                                           seen_by_backend, kind, dynamic):
    def step(q, k, v, cu_seqlens, max_seqlen):
        if max_seqlen is None:  # the max read from the data, as transformers does
            max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
        out = flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen,
                                                max_seqlen, causal=True, softcap=5.0)
        return out.float().square().sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    expected = []
    with torch._dynamo.config.patch(capture_scalar_outputs=kind == "item"):
        for i in range(STEPS):
            torch.manual_seed(i)
            lengths = _lengths(i)
            q, k, v, cu, _, longest, _ = make_varlen_qkv(lengths, lengths, 4, 2, 16,
                                                         requires_grad=True)
            loss = compiled(q, k, v, cu, _max_seqlen_arg(kind, longest))
            grads = torch.autograd.grad(loss, (q, k, v))
            eager_loss = step(q, k, v, cu, longest)
            torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0)
            for ours, eager in zip(grads, torch.autograd.grad(eager_loss, (q, k, v))):
                torch.testing.assert_close(ours, eager, rtol=0, atol=0)
            expected.append((longest, longest, -1, 0))
    assert compilations() <= MAX_COMPILES, counters["stats"]
    assert seen_by_backend[0::2] == expected  # compiled and eager calls alternate


@pytest.mark.parametrize("capture", [False, True], ids=["default", "capture_scalar_outputs"])
def test_tensor_window_stays_in_the_graph(flash_attn, fresh_dynamo, seen_by_backend, capture):
    """A tensor ``window_size`` is read with ``.tolist()``: inside the graph, as symbolic ints
    (new values, no recompilation, no graph break)."""
    def attend(q, k, v, window):
        return flash_attn.flash_attn_func(q, k, v, window_size=window)

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 16, dtype=torch.float16) for _ in range(3))
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(capture_scalar_outputs=capture):
        for left, right in ((3, 1), (5, 0), (0, 7), (-1, 2)):
            window = torch.tensor([left, right])
            assert torch.equal(compiled(q, k, v, window), attend(q, k, v, (left, right)))
    assert compilations() == 1 and not counters["graph_break"]
    assert [s[2:] for s in seen_by_backend[0::2]] == [(3, 1), (5, 0), (0, 7), (-1, 2)]


def test_tensor_softmax_scale_is_one_graph_break(flash_attn, fresh_dynamo):
    """A float read from a tensor cannot enter the ops as a symbol: the read happens outside the
    graph (one graph break; ``fullgraph=True`` refuses it)."""
    def attend(q, k, v, scale):
        return flash_attn.flash_attn_func(q, k, v, softmax_scale=scale).float() * 2

    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 9, 2, 16, dtype=torch.float16) for _ in range(3))
    out = torch.compile(attend, backend="aot_eager")(q, k, v, torch.tensor(0.3))
    assert torch.equal(out, attend(q, k, v, 0.3))
    (reason,) = counters["graph_break"]  # one break, seen by each frame on the stack
    assert "_host_float" in reason


def test_opcheck_on_packed_padded_views(flash_attn):
    """The op as the packed, padded entry points call it: views of one zero-padded packed
    tensor (head dim 59 -> 64), so every stride but the last is the packed tensor's."""
    ops = submodule(flash_attn, "_custom_ops")
    torch.manual_seed(2)
    qkv = torch.nn.functional.pad(torch.randn(2, 7, 3, 2, 59, dtype=torch.float16), (0, 5))
    q, k, v = (t.requires_grad_(True) for t in qkv.unbind(2))
    params = (59 ** -0.5, True, -1, 0, 0.0, 0.0, 0, False, 7, 7)
    torch.library.opcheck(ops.fwd, (q, k, v, None, None, None, None) + params,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor", "test_aot_dispatch_dynamic"))


# -- through transformers ------------------------------------------------------------------

# A repository id of its own: transformers caches the functions of an implementation by name,
# and tests/test_transformers.py loads the published kernel under another one.
LOCAL_REPO = "flash-attn-hub-local/flash-attn"


@pytest.fixture
def tiny_gqa_llama(flash_attn, monkeypatch):
    """A 2-layer GQA Llama (hidden 64, 4 query / 2 kv heads) whose attention is this build,
    loaded by transformers through kernels' ``LOCAL_KERNELS`` override."""
    pytest.importorskip("transformers")
    from flash_attn_hub.verify import tiny_llama

    root = flash_attn.__file__.rsplit("/build/", 1)[0]
    monkeypatch.setenv("LOCAL_KERNELS", f"{LOCAL_REPO}={root}")
    model = tiny_llama().to(torch.bfloat16).train()
    model.set_attn_implementation(f"{LOCAL_REPO}@v3")
    return model


def _packed_batches(count: int):
    """Batches of four sequences packed into one row, as TRL's padding-free collator and
    transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` produce them:
    ``input_ids``, ``labels``, ``position_ids``, int32 ``cu_seq_lens_q/k`` and int
    ``max_length_q/k``. Every batch has a new total length and a new longest sequence."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True,
                                          return_position_ids=True)
    generator = torch.Generator().manual_seed(0)
    for step in range(count):
        lengths = [5 + (7 * step) % 13, 3 + step, 9, 2 + (4 * step) % 7]
        yield collator([{"input_ids": torch.randint(0, 128, (n,), generator=generator).tolist()}
                        for n in lengths]), max(lengths)


@pytest.mark.parametrize("dynamic", [None, True], ids=["dynamic_none", "dynamic_true"])
def test_transformers_packed_training_compiles_at_most_twice(tiny_gqa_llama, fresh_dynamo,
                                                             seen_by_backend, dynamic):
    model = tiny_gqa_llama
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    steps = 5
    longest = []
    for batch, max_length in _packed_batches(steps):
        loss = compiled(**batch, use_cache=False).loss
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        longest.append(max_length)
    assert compilations() <= MAX_COMPILES, counters["stats"]
    layers = model.config.num_hidden_layers
    assert [s[0] for s in seen_by_backend] == [m for m in longest for _ in range(layers)]
    # The compiled step computes what eager computes (same kernels).
    batch, _ = next(_packed_batches(1))
    with torch.no_grad():
        torch.testing.assert_close(compiled(**batch, use_cache=False).loss,
                                   model(**batch, use_cache=False).loss, rtol=1e-3, atol=1e-3)

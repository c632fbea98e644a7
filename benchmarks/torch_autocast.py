"""The torch.autocast column: how much activation memory PyTorch's own mixed
precision saves on the architectures the JAX benchmarks measure, against its float32 run.

Models, written in plain PyTorch with the shapes of their JAX counterparts:

- ``GPT small (demo)`` and ``GPT 4L d128``: the pre-norm GPT of ``autocast._src.demo.models``
  (learned token and position embeddings, 4 heads, causal mask by ``where``, tanh GELU,
  float32 log-softmax and mean next-token NLL); ``mixed_precision.py``'s "GPT small" (the
  demo's d=64, 2 layers, batch 16 of 32 tokens, with vocab 64) and its "GPT" (vocab 256,
  d=128, 4 layers, batch 8 of 64 tokens);
- ``CNN BatchNorm`` and ``CNN GroupNorm``: ``model_families.CNN``, three blocks of a 3x3
  "same" convolution, BatchNorm in training mode (or GroupNorm with 8 groups) and relu,
  a 2x2 average pool, a spatial mean and a dense head to 10 classes; batch 8 of 3x32x32.

Each loss runs once in float32 and once under ``torch.autocast("cpu", dtype=torch.bfloat16)``
inside ``torch.autograd.graph.saved_tensors_hooks``. What is counted: the bytes of every
storage autograd saves for backward, each storage once however many times or through however
many views it is saved (a view keeps its whole storage alive), leaving out the storages of the
parameters and of the inputs: the counterpart of the JAX side's activation bytes, the
residuals ``jax.vjp`` keeps less the arguments it keeps unchanged. The bfloat16 copies that
autocast makes of the weights and of the input images are counted: they are buffers the
forward pass creates and backward holds, as amp's casts of weights are on the JAX side.
Which ops run in bfloat16 is PyTorch's choice, not ours: the models are written in float32
and autocast decides (the residual stream, for one, stays float32 by type promotion).

Run: ``.venv/bin/python benchmarks/torch_autocast.py`` (needs the ``bench-torch`` extra)
"""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

Params = dict[str, Any]
Loss = Callable[..., "torch.Tensor"]

GPT_HEADS = 4


def available() -> bool:
    """Whether PyTorch can be imported here."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# ---- parameters ----------------------------------------------------------------------------


def _param(t: torch.Tensor) -> torch.Tensor:
    return t.requires_grad_(True)


def _dense(n_in: int, n_out: int) -> Params:
    import torch

    # (out, in), the layout F.linear takes: the form a PyTorch user writes, which autocast
    # casts as one op, bias included
    w = torch.randn(n_out, n_in) / math.sqrt(n_in)
    return {"w": _param(w), "b": _param(torch.zeros(n_out))}


def _norm(d: int) -> Params:
    import torch

    return {"g": _param(torch.ones(d)), "b": _param(torch.zeros(d))}


def init_gpt(*, vocab: int, d: int, layers: int, seq: int) -> Params:
    """Parameters of the shapes ``autocast._src.demo.models.init_gpt`` gives."""
    import torch

    def block() -> Params:
        return {
            "ln1": _norm(d),
            "qkv": _dense(d, 3 * d),
            "proj": _dense(d, d),
            "ln2": _norm(d),
            "up": _dense(d, 4 * d),
            "down": _dense(4 * d, d),
        }

    return {
        "embed": _param(torch.randn(vocab, d) * 0.02),
        "pos": _param(torch.randn(seq, d) * 0.02),
        "blocks": [block() for _ in range(layers)],
        "ln_f": _norm(d),
        "head": _dense(d, vocab),
    }


def init_cnn(
    norm: str, widths: tuple[int, ...] = (32, 64, 64), channels: int = 3, classes: int = 10
) -> Params:
    """Parameters of ``model_families.CNN``: conv kernels (out, in, 3, 3) with biases, one
    norm's scale and offset per block, a dense head."""
    import torch

    convs, n_in = [], channels
    for width in widths:
        convs.append(
            {
                "w": _param(torch.randn(width, n_in, 3, 3) / math.sqrt(9 * n_in)),
                "b": _param(torch.zeros(width)),
                "norm": _norm(width),
            }
        )
        n_in = width
    return {"norm": norm, "convs": convs, "head": _dense(n_in, classes)}


# ---- losses --------------------------------------------------------------------------------


def _layer_norm(p: Params, x: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.layer_norm(x, x.shape[-1:], p["g"], p["b"], eps=1e-5)


def _linear(p: Params, x: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.linear(x, p["w"], p["b"])


def _block(p: Params, x: torch.Tensor, heads: int, attention: str = "naive") -> torch.Tensor:
    import torch
    import torch.nn.functional as F

    b, t, d = x.shape
    q, k, v = _linear(p["qkv"], _layer_norm(p["ln1"], x)).split(d, dim=-1)
    q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
    if attention == "sdpa":  # PyTorch's fused attention (flash or memory-efficient kernels)
        heads_first = [z.transpose(1, 2) for z in (q, k, v)]
        att = (
            F.scaled_dot_product_attention(*heads_first, is_causal=True)
            .transpose(1, 2)
            .reshape(b, t, d)
        )
    else:
        scores = torch.einsum("bqhc,bkhc->bhqk", q, k) / math.sqrt(d // heads)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
        probs = torch.softmax(torch.where(mask, scores, -1e9), dim=-1)
        att = torch.einsum("bhqk,bkhc->bqhc", probs, v).reshape(b, t, d)
    x = x + _linear(p["proj"], att)
    h = F.gelu(_linear(p["up"], _layer_norm(p["ln2"], x)), approximate="tanh")
    return x + _linear(p["down"], h)


def gpt_loss(
    params: Params, tokens: torch.Tensor, heads: int = GPT_HEADS, attention: str = "naive"
) -> torch.Tensor:
    """Next-token NLL of the pre-norm GPT, as ``autocast._src.demo.models.gpt_loss`` computes it;
    ``attention="sdpa"`` runs PyTorch's fused attention instead of the written-out one."""
    import torch

    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs] + params["pos"][: inputs.shape[1]]
    for p in params["blocks"]:
        x = _block(p, x, heads, attention)
    logits = _linear(params["head"], _layer_norm(params["ln_f"], x)).float()
    logp = torch.log_softmax(logits, dim=-1)
    return -logp.gather(-1, targets[..., None]).mean()


def cnn_loss(params: Params, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``model_families.CNN`` on NCHW images."""
    import torch.nn.functional as F

    x = images
    for conv in params["convs"]:
        x = F.conv2d(x, conv["w"], conv["b"], padding="same")
        g, b = conv["norm"]["g"], conv["norm"]["b"]
        if params["norm"] == "batch":
            # batch statistics, no running averages: Flax's use_running_average=False
            x = F.batch_norm(x, None, None, g, b, training=True, eps=1e-5)
        else:
            x = F.group_norm(x, 8, g, b, eps=1e-6)  # Flax GroupNorm's epsilon
        x = F.relu(x)
    x = F.avg_pool2d(x, 2, 2)
    logits = _linear(params["head"], x.mean(dim=(2, 3)))
    return F.cross_entropy(logits.float(), labels)


def models() -> list[tuple[str, Loss, Params, tuple[torch.Tensor, ...]]]:
    """(name, loss, parameters, inputs) of each model, seeded."""
    import torch

    torch.manual_seed(0)
    out: list[tuple[str, Loss, Params, tuple[torch.Tensor, ...]]] = []
    for name, vocab, d, layers, seq, batch in (
        ("GPT small (demo)", 64, 64, 2, 32, 16),
        ("GPT 4L d128", 256, 128, 4, 64, 8),
    ):
        params = init_gpt(vocab=vocab, d=d, layers=layers, seq=seq)
        out.append((name, gpt_loss, params, (torch.randint(0, vocab, (batch, seq + 1)),)))
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    for name, norm in (("CNN BatchNorm", "batch"), ("CNN GroupNorm", "group")):
        out.append((name, cnn_loss, init_cnn(norm), (images, labels)))
    return out


# ---- measuring -----------------------------------------------------------------------------


def _tensors(tree: Any) -> list[torch.Tensor]:
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def saved_bytes(
    loss_fn: Loss, params: Params, inputs: tuple[torch.Tensor, ...], autocast: bool
) -> int:
    """Bytes of the storages autograd saves for backward in one forward pass of
    ``loss_fn(params, *inputs)``, each once, those of parameters and inputs left out; under
    ``torch.autocast`` with bfloat16 when ``autocast``. Runs backward too, so a graph the
    hooks broke would fail here rather than count wrong."""
    import torch

    kept_anyway = {t.untyped_storage().data_ptr() for t in _tensors(params) + list(inputs)}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in kept_anyway:
            storages[ptr] = storage.nbytes()
        # handing back the tensor itself keeps it alive until backward, so no address is
        # freed and reused by another saved tensor while counting
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(params, *inputs)
    loss.backward()
    for p in _tensors(params):
        if p.grad is None or p.grad.dtype != torch.float32:
            raise RuntimeError(f"{loss_fn.__name__}: a parameter got no float32 gradient")
        p.grad = None
    return sum(storages.values())


def main() -> dict[str, dict]:
    """Prints the table; returns model -> float32 and autocast saved bytes and their ratio."""
    import torch

    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, cpu; autocast dtype bfloat16")
    print(f"{'model':17} {'f32 saved MB':>12} {'autocast MB':>11} {'ratio':>6}")
    results: dict[str, dict] = {}
    for name, loss_fn, params, inputs in models():
        f32 = saved_bytes(loss_fn, params, inputs, autocast=False)
        mixed = saved_bytes(loss_fn, params, inputs, autocast=True)
        results[name] = {"float32_bytes": f32, "autocast_bytes": mixed, "ratio": mixed / f32}
        print(f"{name:17} {f32 / 2**20:12.2f} {mixed / 2**20:11.2f} {mixed / f32:6.2f}")
    return results


if __name__ == "__main__":
    if not available():
        print("torch not installed: pip install -e '.[bench-torch]'")
        sys.exit(0)
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.1f} s)")

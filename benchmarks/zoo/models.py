"""The zoo's models and their batches, at two sizes: ``"cpu"`` (scaled down so a step on one
core takes tens of milliseconds) and ``"cuda"`` (the published shapes: ResNet-18, GPT-2 small).

Each :class:`Workload` builds its model, makes a batch and computes the loss, so every
contender (bare model, torch DDP, DDPWrapper) runs exactly the same step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fastddp.train.models import FlattenMLP

from .video import ClipReader, write_clips


# ----------------------------------------------------------------------------- ResNet-18
class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                      nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """ResNet-18's layout (four stages of two basic blocks, BatchNorm) for 32x32 images."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        widths = [width, width * 2, width * 4, width * 8]
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        blocks, c_in = [], width
        for i, c in enumerate(widths):
            blocks += [BasicBlock(c_in, c, 1 if i == 0 else 2), BasicBlock(c, c, 1)]
            c_in = c
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


# ----------------------------------------------------------------------------- GPT-2
class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2's layout: learned positions, pre-norm blocks, output head tied to the embedding."""

    def __init__(self, vocab: int, ctx: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


# ----------------------------------------------------------------------------- speech
class SpeechCTC(nn.Module):
    """Two strided Conv2d layers subsample (time and frequency by 4), a bidirectional LSTM
    runs over time, a linear layer gives per-frame log-probabilities for CTC."""

    def __init__(self, mels: int, hidden: int, layers: int, vocab: int, channels: int = 32) -> None:
        super().__init__()
        self.sub = nn.Sequential(nn.Conv2d(1, channels, 3, 2, 1), nn.ReLU(),
                                 nn.Conv2d(channels, channels, 3, 2, 1), nn.ReLU())
        self.proj = nn.Linear(channels * math.ceil(mels / 4), hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, bidirectional=True,
                            batch_first=True)
        self.out = nn.Linear(2 * hidden, vocab)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:  # (B, T, mels)
        x = self.sub(feats.unsqueeze(1))  # (B, C, T/4, mels/4)
        b, c, t, f = x.shape
        x, _ = self.lstm(self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f)))
        return self.out(x).log_softmax(-1)


# ----------------------------------------------------------------------------- 3D-CNN
class Video3DCNN(nn.Module):
    """Conv3d/BatchNorm/ReLU stages with pooling over a clip, global pool, linear head."""

    def __init__(self, width: int, classes: int = 10) -> None:
        super().__init__()
        layers, c_in = [], 3
        for c in (width, width * 2, width * 4):
            layers += [nn.Conv3d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm3d(c),
                       nn.ReLU(), nn.MaxPool3d((1, 2, 2) if c_in == 3 else 2)]
            c_in = c
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3, 4)))


# ----------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """One zoo entry: ``build()`` makes the model, ``batch(step)`` the step's inputs on the
    device, ``loss(model, batch)`` the scalar to back-propagate."""

    build: Callable[[], nn.Module]
    batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    fp16: bool = True  # False where torch has no float16 kernel on this device


def _classify(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def _language(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def _ctc(model: nn.Module, batch: tuple) -> torch.Tensor:
    feats, feat_lens, targets, target_lens = batch
    log_probs = model(feats).float().transpose(0, 1)  # (T', B, vocab)
    out_lens = torch.div(feat_lens + 3, 4, rounding_mode="floor").clamp(max=log_probs.shape[0])
    return F.ctc_loss(log_probs, targets, out_lens, target_lens, zero_infinity=True)


def _speech_batch(dev: torch.device, b: int, frames: int, mels: int, vocab: int):
    """Variable-length utterances, padded: each step draws new lengths (fixed seed per step)."""
    def make(step: int) -> tuple:
        g = torch.Generator().manual_seed(step)
        feat_lens = torch.randint(frames // 2, frames + 1, (b,), generator=g)
        feats = torch.randn(b, int(feat_lens.max()), mels, generator=g)
        target_lens = torch.div(feat_lens, 8, rounding_mode="floor")
        targets = torch.randint(1, vocab, (int(target_lens.sum()),), generator=g)
        return feats.to(dev), feat_lens, targets, target_lens
    return make


SIZES: dict[str, dict[str, dict[str, int]]] = {
    "cpu": {"resnet18": {"width": 16, "batch": 8}, "gpt2": {"vocab": 4096, "ctx": 64, "dim": 128,
            "layers": 4, "heads": 4, "batch": 8}, "speech": {"mels": 80, "hidden": 128, "layers": 2,
            "vocab": 32, "frames": 160, "batch": 4}, "video3d": {"width": 16, "frames": 8,
            "size": 32, "batch": 8}, "har": {"batch": 64}},
    "cuda": {"resnet18": {"width": 64, "batch": 128}, "gpt2": {"vocab": 50304, "ctx": 512,
             "dim": 768, "layers": 12, "heads": 12, "batch": 8}, "speech": {"mels": 80,
             "hidden": 512, "layers": 3, "vocab": 32, "frames": 800, "batch": 32},
             "video3d": {"width": 32, "frames": 16, "size": 112, "batch": 16},
             "har": {"batch": 256}},
}
NAMES = tuple(SIZES["cpu"])
# A 50 M-parameter MLP (201 MB of fp32 parameters): the size at which a second copy of the
# gradients shows in peak memory. fp32 only, on either device.
LARGE_MLP = {"width": 4096, "layers": 3, "classes": 10, "batch": 16}


def workload(name: str, device: torch.device, scratch: Path, smoke: bool = False) -> Workload:
    """The zoo entry ``name`` at the size for ``device.type`` (tiny batches with ``smoke``)."""
    if name == "mlp50m":
        return _large_mlp(device)
    s = dict(SIZES[device.type][name])
    if smoke:
        s["batch"] = 2
    b = s["batch"]
    g = torch.Generator().manual_seed(0)
    if name == "resnet18":
        x, y = torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)
        return Workload(lambda: ResNet18(s["width"]), lambda step: (x.to(device), y.to(device)),
                        _classify)
    if name == "gpt2":
        idx = torch.randint(0, s["vocab"], (b, s["ctx"] + 1), generator=g).to(device)
        return Workload(lambda: GPT(s["vocab"], s["ctx"], s["dim"], s["layers"], s["heads"]),
                        lambda step: idx, _language)
    if name == "speech":
        return Workload(lambda: SpeechCTC(s["mels"], s["hidden"], s["layers"], s["vocab"]),
                        _speech_batch(device, b, s["frames"], s["mels"], s["vocab"]), _ctc,
                        fp16=device.type == "cuda")  # CPU: oneDNN has no float16 LSTM
    if name == "video3d":
        path = scratch / "clips.npy"
        if not path.exists():
            write_clips(path, n=4 * b, frames=s["frames"], size=s["size"])
        reader, y = ClipReader(path, b), torch.randint(0, 10, (b,), generator=g)
        return Workload(lambda: Video3DCNN(s["width"]),
                        lambda step: (reader.read(device), y.to(device)), _classify)
    if name == "har":
        x, y = torch.randn(b, 9, 128, generator=g), torch.randint(0, 6, (b,), generator=g)
        return Workload(FlattenMLP, lambda step: (x.to(device), y.to(device)), _classify)
    raise ValueError(f"unknown zoo model {name!r}: choose one of {', '.join(NAMES)}, mlp50m")


def _large_mlp(device: torch.device) -> Workload:
    s, g = LARGE_MLP, torch.Generator().manual_seed(0)
    x = torch.randn(s["batch"], s["width"], generator=g)
    y = torch.randint(0, s["classes"], (s["batch"],), generator=g)

    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(s["layers"]):
            layers += [nn.Linear(s["width"], s["width"]), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(s["width"], s["classes"]))

    return Workload(build, lambda step: (x.to(device), y.to(device)), _classify, fp16=False)

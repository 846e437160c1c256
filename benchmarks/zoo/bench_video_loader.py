"""The data path on video: uint8 clips streamed from memory-mapped ``.npy`` files.

    pytest benchmarks/zoo/bench_video_loader.py -s

``test_video_clips_loader``: clips/s delivered to a consumer that normalises each batch as a
training step does on the device (uint8 THWC -> float CTHW, mean/std), for
``fastddp.PrefetchLoader`` over the ``.npy`` files with ``fastddp.DistributedSampler`` (C++
threads gather the rows straight from the memory map) and for torch's ``DataLoader`` over an
equivalent map-style Dataset reading the memory map, at ``num_workers`` 0, 1, 2 and 4
(``pin_memory`` where there is an accelerator, persistent workers); the ratio is taken against
the DataLoader setting with the best median. Two bounds are measured in the same rounds: the
consumer's normalise alone on a resident batch (what no loader can beat) and PrefetchLoader
with a consumer that only touches the batch (the loader's own rate).

``test_epoch_vs_floor``: a whole epoch of each zoo model (CPU sizes, bare model, one process)
fed by PrefetchLoader with the DistributedSampler, against the same steps on the epoch's batches
already resident (and, for video, already normalised): the fraction of the compute floor reached.

Contenders alternate in rounds with a rotated order (as the zoo does); figures are medians
over the rounds, with min and max. Rows go to ``benchmarks/results/video_loader.json``.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_map_only
from torch.utils.data import DataLoader

import fastddp

from ..common import SMOKE, record
from .measure import build, new_model, step
from .models import NAMES, SIZES, workload
from .video import ClipDataset, Normaliser, normalise, write_clips, write_labels

# (clips, frames, size, batch): full is the shape, smoke finishes in seconds.
CLIPS = (16, 4, 16, 4) if SMOKE else (384, 16, 112, 8)
ROUNDS = 1 if SMOKE else 9
DL_WORKERS = (0, 1) if SMOKE else (0, 1, 2, 4)
LOADER_THREADS = 2  # the cores of the CPU machines this is measured on
MIN_SECONDS = 0.0 if SMOKE else 0.2  # each contender's share of a round
# Steps of an epoch per model: about half a second of compute on the CPU machine each, so a
# neighbour's burst on the shared cores moves one round less.
EPOCH_STEPS = {"resnet18": 24, "gpt2": 16, "speech": 32, "video3d": 32, "har": 64}
COMMAND = "pytest benchmarks/zoo/bench_video_loader.py -s"


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _rounds(contenders: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each contender once per round (rotated order); its figure for each round."""
    names = list(contenders)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            out[k].append(contenders[k]())
    return out


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One intra-op thread for the consumer, as each rank of the zoo runs (one rank per core):
    on a loaded 2-core machine a second OpenMP thread turns every op into a scheduler wait."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    n, frames, size, _ = CLIPS
    root = tmp_path_factory.mktemp("video")
    return write_clips(root / "clips.npy", n, frames, size), write_labels(root / "labels.npy", n)


def _clips_per_s(loader: Any, device: torch.device, consume: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """Whole epochs of ``loader`` for at least ``MIN_SECONDS`` (an untouched epoch of the
    fastest reader lasts about 10 ms, too short to time alone on a shared VM): each batch's
    clips go through ``consume``; clips per second."""
    n, acc = 0, torch.zeros((), device=device)
    t0 = time.perf_counter()
    while True:
        for clips, labels in loader:
            acc += consume(clips)[:, :, :1, :1, :1].sum()  # the step reads the normalised batch
            n += labels.shape[0]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= MIN_SECONDS:
            return n / elapsed


def test_video_clips_loader(clip_files: tuple[Path, Path]) -> None:
    clips_path, labels_path = clip_files
    n, frames, size, batch = CLIPS
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pin = torch.cuda.is_available()
    norm = Normaliser(device)
    touch = lambda x: x.to(device, non_blocking=True).unsqueeze(1)  # noqa: E731  (no normalise)
    sampler = fastddp.DistributedSampler(n, num_replicas=1, rank=0, shuffle=True, seed=0)
    ours = fastddp.PrefetchLoader((str(clips_path), str(labels_path)), batch_size=batch, sampler=sampler,
                                  num_workers=LOADER_THREADS, device=device if pin else None)
    ds = ClipDataset(clips_path, labels_path)
    theirs = {w: DataLoader(ds, batch_size=batch, sampler=fastddp.DistributedSampler(
                  n, num_replicas=1, rank=0, shuffle=True, seed=0), num_workers=w, pin_memory=pin,
                  persistent_workers=w > 0) for w in DL_WORKERS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the map is read-only; it is only read
        source = torch.from_numpy(np.load(clips_path, mmap_mode="r"))
    resident = next(iter(ours))
    resident = (resident[0].clone(), resident[1].clone())

    def floor() -> float:  # the normalise alone, on a resident batch, as many batches
        return _clips_per_s([resident] * (n // batch), device, norm)

    rows = torch.empty((batch, frames, size, size, 3), dtype=torch.uint8)

    def copy_1core() -> float:  # one core copying each batch's rows out of the map: the IO bound
        done, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < MIN_SECONDS or not done:
            order = torch.randperm(n)
            for i in range(0, n - batch + 1, batch):
                torch.index_select(source, 0, order[i:i + batch], out=rows)
            done += n - n % batch
        return done / elapsed

    contenders: dict[str, Callable[[], float]] = {
        "copy_1core": copy_1core,
        "fastddp": lambda: _clips_per_s(ours, device, norm),
        "fastddp_raw": lambda: _clips_per_s(ours, device, touch),
        "normalise_only": floor,
        **{f"dataloader_w{w}": (lambda dl=dl: _clips_per_s(dl, device, norm)) for w, dl in theirs.items()},
        **{f"dataloader_raw_w{w}": (lambda dl=dl: _clips_per_s(dl, device, touch)) for w, dl in theirs.items()},
    }
    for fn in contenders.values():  # warm-up: page cache, worker start-up, allocators
        fn()
    rates = _rounds(contenders, ROUNDS)
    row = {"device": device.type, "clips": n, "clip_shape": [frames, size, size, 3], "batch": batch,
           "rounds": ROUNDS, "loader_threads": LOADER_THREADS, "pin_memory": pin,
           **{f"{k}_clips_per_s": statistics.median(v) for k, v in rates.items()}, "command": COMMAND}
    for suffix, ours_key in (("", "fastddp"), ("_raw", "fastddp_raw")):
        best = max(DL_WORKERS, key=lambda w: statistics.median(rates[f"dataloader{suffix}_w{w}"]))
        dl = rates[f"dataloader{suffix}_w{best}"]
        row[f"best_dataloader{suffix}_workers"] = best
        row[f"{ours_key}_over_best_dataloader"] = _spread([a / b for a, b in zip(rates[ours_key], dl)])
        if not suffix:  # the consumer's bound: no loader delivers faster than it normalises
            row["normalise_only_over_best_dataloader"] = _spread(
                [a / b for a, b in zip(rates["normalise_only"], dl)])
        else:  # the copy's bound: the loader's threads each copying rows as fast as one core
            row["threads_copy_over_best_dataloader_raw"] = _spread(
                [LOADER_THREADS * a / b for a, b in zip(rates["copy_1core"], dl)])
    row["load_average"] = os.getloadavg()[0]  # the neighbours' share of the cores, after the run
    r, rr, bound = (row[k] for k in ("fastddp_over_best_dataloader", "fastddp_raw_over_best_dataloader",
                                     "normalise_only_over_best_dataloader"))
    print(f"\n[video-loader] {device.type} clips {n}x{frames}x{size}x{size}x3 b{batch}: clips/s fastddp "
          f"{row['fastddp_clips_per_s']:.0f} (raw {row['fastddp_raw_clips_per_s']:.0f}, normalise alone "
          f"{row['normalise_only_clips_per_s']:.0f}, one core's row copy {row['copy_1core_clips_per_s']:.0f})"
          " | DataLoader "
          + " ".join(f"w{w} {row[f'dataloader_w{w}_clips_per_s']:.0f} (raw "
                     f"{row[f'dataloader_raw_w{w}_clips_per_s']:.0f})" for w in DL_WORKERS)
          + f" | fastddp/best DataLoader {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}], raw "
          f"{rr['median']:.2f} [{rr['min']:.2f}, {rr['max']:.2f}] | normalise bound {bound['median']:.2f}, "
          f"copy bound {row['threads_copy_over_best_dataloader_raw']['median']:.2f} | load {row['load_average']:.1f}",
          flush=True)
    assert all(v > 0 for vs in rates.values() for v in vs)
    record("video_loader", f"{device.type}-clips-{frames}x{size}-b{batch}", row)


# ----------------------------------------------------------------------------- epoch vs floor
def _columns(name: str, rows: int, scratch: Path) -> tuple[list[Any], Callable[[Any], Any]]:
    """The epoch's data set for zoo model ``name`` (``rows`` samples, CPU sizes) as what
    PrefetchLoader reads (tensors, or ``.npy`` paths for the clips), and the function that turns
    a delivered batch into the workload's batch (the normalise for video, trimming for speech)."""
    s = SIZES["cpu"][name]
    g = torch.Generator().manual_seed(0)
    if name == "video3d":
        clips = write_clips(scratch / "epoch_clips.npy", rows, s["frames"], s["size"])
        return [str(clips), str(write_labels(scratch / "epoch_labels.npy", rows))], \
            lambda b: (normalise(b[0]), b[1])
    if name == "resnet18":
        return [torch.randn(rows, 3, 32, 32, generator=g), torch.randint(0, 10, (rows,), generator=g)], tuple
    if name == "gpt2":
        return [torch.randint(0, s["vocab"], (rows, s["ctx"] + 1), generator=g)], lambda b: b  # bare tensor
    if name == "har":
        return [torch.randn(rows, 9, 128, generator=g), torch.randint(0, 6, (rows,), generator=g)], tuple
    # speech: utterances padded to the longest, targets padded (CTC's (B, S) target form)
    feat_lens = torch.randint(s["frames"] // 2, s["frames"] + 1, (rows,), generator=g)
    target_lens = torch.div(feat_lens, 8, rounding_mode="floor")
    feats = torch.randn(rows, s["frames"], s["mels"], generator=g)
    targets = torch.randint(1, s["vocab"], (rows, s["frames"] // 8), generator=g)

    def speech(b: Any) -> Any:
        return b[0][:, :int(b[1].max())], b[1], b[2], b[3]
    return [feats, feat_lens, targets, target_lens], speech


@pytest.mark.parametrize("name", NAMES)
def test_epoch_vs_floor(name: str, tmp_path: Path) -> None:
    device = torch.device("cpu")
    wl = workload(name, device, tmp_path, SMOKE)
    batch = 2 if SMOKE else SIZES["cpu"][name]["batch"]
    steps = 2 if SMOKE else EPOCH_STEPS[name]
    rows = steps * batch
    data, to_batch = _columns(name, rows, tmp_path)
    sampler = fastddp.DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = fastddp.PrefetchLoader(tuple(data), batch_size=batch, sampler=sampler, drop_last=True)
    fed = build("bare", new_model(wl, device), device, "fp32")
    res = build("bare", new_model(wl, device), device, "fp32")
    # The floor runs the epoch's own batches (the sampler's order is the same every pass: no
    # set_epoch), gathered and converted beforehand.
    resident = [to_batch(tree_map_only(torch.Tensor, torch.clone, b)) for b in loader]

    def epoch_loader() -> float:
        t0 = time.perf_counter()
        for b in loader:
            step(fed, wl, to_batch(b), "fp32", device)
        return time.perf_counter() - t0

    def epoch_resident() -> float:
        t0 = time.perf_counter()
        for b in resident:
            step(res, wl, b, "fp32", device)
        return time.perf_counter() - t0

    for fn in (epoch_loader, epoch_resident):  # warm-up: oneDNN plans, allocators
        fn()
    times = _rounds({"loader": epoch_loader, "resident": epoch_resident}, ROUNDS)
    frac = _spread([r / f for f, r in zip(times["loader"], times["resident"])])
    row = {"model": name, "device": "cpu", "batch": batch, "steps": steps, "rounds": ROUNDS,
           "loader_epoch_s": statistics.median(times["loader"]),
           "resident_epoch_s": statistics.median(times["resident"]),
           "fraction_of_floor": frac, "command": COMMAND}
    print(f"\n[video-loader] epoch {name} b{batch} x{steps}: PrefetchLoader "
          f"{row['loader_epoch_s'] * 1e3:.0f} ms, resident {row['resident_epoch_s'] * 1e3:.0f} ms | "
          f"fraction of floor {frac['median']:.3f} [{frac['min']:.3f}, {frac['max']:.3f}]", flush=True)
    assert np.isfinite(frac["median"])
    record("video_loader", f"cpu-epoch-{name}", row)

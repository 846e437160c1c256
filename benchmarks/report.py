"""Collect the latest benchmark JSON results into docs/benchmarks.md tables and docs/img plots.

    python benchmarks/report.py [--results benchmarks/results] [--out docs] [--no-plots]

Each ``results/<capability>.json`` (written by ``benchmarks/common.record``) becomes a section
with one table per machine and command, headed by the machine, torch version, the date measured
and the command; the measured numbers follow, ratios first.
The narrative around the tables lives in ``docs/benchmarks.md`` between the markers
``<!-- report:begin -->`` and ``<!-- report:end -->``, which this script rewrites.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- report:begin -->", "<!-- report:end -->"
PLOTS = ("e2e_samples_per_s.png", "step_time_breakdown.png", "projected_scaling.png",
         "zoo_overhead.png")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10000:
        return f"{v:,}"
    if v is None:
        return "–"
    return str(v)


def _machine(m: dict[str, Any]) -> str:
    """One line naming where a row was measured: the GPU (with its host's cores) or the CPU."""
    torch = f"torch {m['torch']}" if m.get("torch") else "torch ?"
    if m.get("gpu"):
        return f"{m['gpu']} ({m.get('cores', '?')}-core host), {torch}"
    host = ", ".join(v for v in (m.get("cpu_model"), m.get("cpu_features")) if v)
    return f"{m.get('cores', '?')}-core {m.get('cpu', '?')} CPU{f' ({host})' if host else ''}, {torch}"


def _dates(rows: list[dict[str, Any]]) -> str:
    days = sorted({str(r["time"])[:10] for r in rows if r.get("time")})
    if not days:
        return "date not recorded"
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def _flat(r: dict[str, Any]) -> dict[str, Any]:
    """The row with the numbers of a nested record (``measured``) as ``measured.forward_s``."""
    out: dict[str, Any] = {}
    for k, v in r.items():
        if isinstance(v, dict) and k != "machine":
            out.update({f"{k}.{sk}": sv for sk, sv in v.items() if not isinstance(sv, (list, dict))})
        else:
            out[k] = v
    return out


def _groups(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rows measured on one machine by one command with the same fields, in first-seen order:
    each group is one table, so no table mixes machines and few cells are empty."""
    groups: dict[tuple[str, str, tuple[str, ...]], list[dict[str, Any]]] = {}
    for r in rows:
        fields = tuple(sorted(k for k, v in r.items() if v is not None))
        key = (json.dumps(r.get("machine", {}), sort_keys=True), r.get("command", ""), fields)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def _group_table(rows: list[dict[str, Any]]) -> list[str]:
    keys: list[str] = []
    for r in rows:
        for k in r:
            if (k not in ("name", "machine", "time", "command") and k not in keys
                    and not isinstance(r[k], (list, dict))):
                keys.append(k)
    # A text field with one value over the whole group is a property of the table, not of a row:
    # it is written under the table's heading, so the cells hold numbers and short words.
    shared = [k for k in keys if isinstance(rows[0].get(k), str)
              and all(r.get(k) == rows[0][k] for r in rows)]
    keys = [k for k in keys if k not in shared]
    order = {k: i for i, k in enumerate(keys)}
    keys.sort(key=lambda k: (not any(w in k for w in ("ratio", "speedup")), order[k]))
    info = [f"{_machine(rows[0].get('machine', {}))} · {_dates(rows)}"
            + (f" · `{rows[0]['command']}`" if rows[0].get("command") else ""),
            *(f"{k}: {rows[0][k]}" for k in shared)]
    lines = [ln + "  " for ln in info[:-1]] + info[-1:]  # two spaces: a markdown line break
    lines += ["", "| name | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for r in rows:
        lines.append(f"| {r['name']} | " + " | ".join(_fmt(r.get(k)) for k in keys) + " |")
    return lines


def table(capability: str, rows: list[dict[str, Any]]) -> str:
    """The capability's rows as one table per machine and command, each headed by the machine,
    the date measured and the command that measured it."""
    lines = [f"### {capability}"]
    for group in _groups([_flat(r) for r in rows]):
        lines += ["", *_group_table(group)]
    return "\n".join(lines) + "\n"


def _finish(plt, fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> str:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"img/{path.name}"


def _breakdown(plt, scaling: list[dict[str, Any]], ddp: list[dict[str, Any]], path: Path) -> str:
    """Step-time breakdown: left, the HAR step's measured forward / backward / optimizer time
    on one device and the all-reduce time the projection leaves exposed at the most GPUs;
    right, one DDP step under the bare model (where measured), DDPWrapper and torch DDP."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    names = [r["name"] for r in scaling]
    parts = [("forward", lambda r: r["measured"]["forward_s"]),
             ("backward", lambda r: r["measured"]["backward_s"]),
             ("optimizer", lambda r: r["measured"]["optimizer_s"]),
             ("exposed all-reduce (projected, most GPUs)",
              lambda r: r["projection"][-1]["exposed_comm_s"] if r.get("projection") else 0.0)]
    totals = [sum(get(r) for _, get in parts) for r in scaling]
    bottom = [0.0] * len(scaling)
    for label, get in parts:  # shares of the step, so a 2 ms and a 20 ms step read alike
        share = [100 * get(r) / t if t else 0.0 for r, t in zip(scaling, totals)]
        left.bar(names, share, bottom=bottom, label=label)
        bottom = [b + s for b, s in zip(bottom, share)]
    for x, t in enumerate(totals):
        left.text(x, 101, f"{t * 1e3:.2f} ms", ha="center", va="bottom", fontsize="small")
    left.set_ylim(0, 112)
    left.set_ylabel("% of the step")
    left.set_title("HAR step on one device (benchmarks/scaling.py)")
    left.tick_params(axis="x", labelrotation=15, labelsize="small")
    left.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    width = 0.27
    xs = range(len(ddp))
    for i, (key, label) in enumerate((("bare_step_ms", "bare model"), ("fastddp_step_ms", "DDPWrapper"),
                                      ("torch_step_ms", "torch DDP"))):
        right.bar([x + (i - 1) * width for x in xs], [r.get(key) or 0.0 for r in ddp], width, label=label)
    right.set_xticks(list(xs), [r["name"] for r in ddp], rotation=30, ha="right", fontsize="small")
    right.set_yscale("log")
    right.set_ylabel("ms per step")
    right.set_title("one DDP step (benchmarks/bench_ddp.py)")
    right.legend(fontsize="small")
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"img/{path.name}"


def _zoo(plt, rows: list[dict[str, Any]], path: Path) -> str:
    """Step time ratios per zoo case, one panel per device and world size: DDPWrapper over the
    bare model and over the bare model synchronised once per step, torch DDP over the bare
    model; the median over rounds with its 95 % interval (older rows: the spread) as an error
    bar, on a log axis (two ranks sharing a GPU run up to 20 times the bare step), and the
    target as a line."""
    from matplotlib import ticker

    groups = sorted({(r.get("device", "cpu"), r["backend"], r["world_size"]) for r in rows})
    fig, axes = plt.subplots(len(groups), 1, figsize=(12, 3.8 * len(groups)), squeeze=False)
    for ax, (device, backend, world) in zip(axes[:, 0], groups):
        part = [r for r in rows if (r.get("device", "cpu"), r["backend"], r["world_size"])
                == (device, backend, world)]
        _zoo_panel(ax, part)
        target = 1.02 if device == "cuda" and world == 1 else 1.05
        ax.axhline(target, color="k", linestyle="--", linewidth=1, label=f"target {target}")
        ax.set_title(f"{device}, {backend}, world {world}")
        ax.set_ylabel("step time / bare model's")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(ticker.ScalarFormatter())
        ax.tick_params(axis="y", which="minor", labelsize="x-small")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle("Model zoo (benchmarks/zoo)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"img/{path.name}"


def _zoo_panel(ax, rows: list[dict[str, Any]]) -> None:
    series = [(key, label) for key, label in (("fastddp_over_bare", "DDPWrapper / bare"),
                                              ("fastddp_over_bare_sync", "DDPWrapper / bare_sync"),
                                              ("torch_over_bare", "torch DDP / bare"))
              if all(key in r for r in rows)]
    width, xs = 0.8 / len(series), range(len(rows))
    for i, (key, label) in enumerate(series):
        med = [r[key]["median"] for r in rows]
        # the median's 95 % interval where the row has one, else the spread over the rounds
        err = [[m - r[key].get("lo", r[key]["min"]) for m, r in zip(med, rows)],
               [r[key].get("hi", r[key]["max"]) - m for m, r in zip(med, rows)]]
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in xs], med, width, yerr=err,
               capsize=2, label=label)
    ax.set_xticks(list(xs), [f"{r['model']} {r['precision']}"
                             + (" + busy neighbour" if r.get("busy_neighbour") else "")
                             + (" + keep allocator" if r.get("allocator") == "keep" else "") for r in rows],
                  rotation=35, ha="right", fontsize="small")


def plots(results: dict[str, list[dict[str, Any]]], img: Path) -> list[str]:
    """Draws the PNG plots under ``img``; returns their paths relative to the docs folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    img.mkdir(parents=True, exist_ok=True)
    e2e = results.get("e2e", [])
    if e2e:
        # One line per (device, processes) and side: CPU and GPU rows never share a line, and a
        # log axis keeps the CPU numbers readable beside the GPU ones.
        fig, ax = plt.subplots(figsize=(9, 4))
        groups = sorted({(r.get("device", "cpu"), r["nproc"]) for r in e2e})
        for device, nproc in groups:
            rows = sorted((r for r in e2e if r.get("device", "cpu") == device and r["nproc"] == nproc),
                          key=lambda r: r["batch"])
            for side, style in (("fastddp", "-"), ("torch", ":")):
                ax.plot([r["batch"] for r in rows], [r[f"{side}_samples_per_s"] for r in rows],
                        linestyle=style, marker="o", label=f"{side}, {device}, {nproc} proc")
            floor = [r for r in rows if r.get("floor_samples_per_s")]
            if floor:
                ax.plot([r["batch"] for r in floor], [r["floor_samples_per_s"] for r in floor],
                        linestyle="--", label=f"compute floor, {device}, {nproc} proc")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        made.append(_finish(plt, fig, ax, img / PLOTS[0],
                            "batch size per process", "samples/s", "HAR end to end"))
    scaling = results.get("scaling", [])
    ddp = [r for r in results.get("ddp", []) if r.get("fastddp_step_ms") and r.get("torch_step_ms")]
    if scaling or ddp:
        made.append(_breakdown(plt, scaling, ddp, img / PLOTS[1]))
    if scaling:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for r in scaling:
            ax.plot(r["gpus"], r["efficiency"], marker="o", label=r["name"])
        made.append(_finish(plt, fig, ax, img / PLOTS[2], "GPUs",
                            "projected scaling efficiency", "Projected (model, not measurement)"))
    zoo = results.get("zoo", [])
    if zoo:
        made.append(_zoo(plt, zoo, img / PLOTS[3]))
    return made


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", default=str(Path(__file__).parent / "results"))
    p.add_argument("--out", default=str(Path(__file__).parent.parent / "docs"))
    p.add_argument("--no-plots", action="store_true",
                   help="tables only: leave docs/img alone and link the plots already there")
    args = p.parse_args(argv)
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("the plots (docs/img/*.png) need matplotlib: pip install matplotlib, "
                    "or pass --no-plots for the tables alone")
    results = {f.stem: json.loads(f.read_text()) for f in sorted(Path(args.results).glob("*.json"))}
    out = Path(args.out)
    body = "\n".join(table(cap, rows) for cap, rows in results.items())
    made = ([f"img/{n}" for n in PLOTS if (out / "img" / n).exists()] if args.no_plots
            else plots(results, out / "img"))
    for path in made:
        body += f"\n![{Path(path).stem}]({path})\n"
    doc = out / "benchmarks.md"
    text = doc.read_text() if doc.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1] if END in rest else ""
    doc.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")
    print(f"wrote {doc} ({len(results)} capabilities)")


if __name__ == "__main__":
    main()

"""``--config FILE`` of ``fastddp.train``: a YAML or JSON file that sets flags by their names
at the top level (``batch_size`` or ``batch-size``) or by the keys of the classic
``configs/multi_gpu.yaml`` and ``configs/distributed.yaml`` (:data:`NESTED_KEYS`:
``training.lr``, ``distributed.backend``, ...). Any other key, a section's included (an
``evaluation.batch_size`` would otherwise set the training batch size), is refused.

A value from the file is checked as the command line would check it: its type (an integer
flag takes an integer, a switch takes true or false), its choices; two keys that set the same
flag to different values are refused. Every problem of the file is named in one error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .errors import UsageError

# Keys of the classic configs/multi_gpu.yaml and configs/distributed.yaml -> our flags.
NESTED_KEYS = {
    "training.batch_size": "batch_size",
    "training.lr": "lr",
    "training.learning_rate": "lr",
    "training.epochs": "epochs",
    "training.weight_decay": "weight_decay",
    "training.warmup_epochs": "warmup_epochs",
    "training.grad_accum_steps": "grad_accum_steps",
    "training.num_workers": "num_workers",
    "training.amp": "amp",
    "training.clip_grad": "clip_grad",
    "training.seed": "seed",
    "training.mode": "mode",
    "training.save_dir": "save_dir",
    "model.mode": "mode",
    "data.data_dir": "data_dir",
    "data.num_workers": "num_workers",
    "distributed.backend": "backend",
    "distributed.find_unused_parameters": "find_unused_parameters",
    "distributed.sync_batchnorm": "sync_batchnorm",
    "distributed.multi_gpu": "multi_gpu",
    "distributed.gpu_ids": "gpu_ids",
    "distributed.comm_dtype": "comm_dtype",
    "distributed.timeout": "timeout",
}

# String flags that a file may also give as a list (``gpu_ids: [0, 1]`` for ``--gpu-ids 0,1``).
COMMA_LISTS = {"gpu_ids"}


def _dest(key: str) -> str:
    """The flag ``key`` of a config file sets: a flag's name at the top level (``batch_size``
    or ``batch-size``) or a key of :data:`NESTED_KEYS`. Any other ``section.name`` (an
    ``evaluation.batch_size``) sets nothing, however its last part is spelled: "" then."""
    section, _, name = key.rpartition(".")
    name = name.replace("-", "_")
    if not section:
        return name
    return NESTED_KEYS.get(f"{section}.{name}", "")


def accepted_keys() -> str:
    """The keys a config file may hold, for the error that names an unknown one."""
    sections: dict[str, list[str]] = {}
    for key in NESTED_KEYS:
        section, _, name = key.partition(".")
        sections.setdefault(section, []).append(name)
    nested = ", ".join(f"{section}.{names[0]}" if len(names) == 1 else
                       f"{section}.({'|'.join(names)})" for section, names in sections.items())
    return (f"a flag's name at the top level (batch_size or batch-size; python -m "
            f"fastddp.train --help lists them), or one of the classic keys {nested}")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _unique_keys(path: str):
    """A json ``object_pairs_hook`` that refuses a key given twice in one object (json keeps
    the last one without a word)."""

    def pairs_to_dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise UsageError(f"--config {path}: key {key!r} is given twice in one mapping "
                                 f"(values {_show(out[key])} and {_show(value)}); keep one")
            out[key] = value
        return out

    return pairs_to_dict


def _unique_key_loader(yaml: Any, path: str) -> Any:
    """PyYAML's SafeLoader, refusing a key given twice in one mapping (it keeps the last)."""

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, (str, int, float, bool)):
                    continue  # SafeLoader itself refuses unhashable keys
                if key in seen:
                    raise UsageError(f"--config {path}: key {key!r} is given twice in one "
                                     f"mapping (lines {seen[key]} and "
                                     f"{key_node.start_mark.line + 1}); keep one")
                seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _read(file: Path) -> Any:
    """The parsed contents of ``file`` (YAML for .yaml/.yml, else JSON)."""
    path = str(file)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--config {path}: cannot be read as a text file ({exc}); give a YAML "
                         "or JSON file") from None
    if file.suffix not in (".yaml", ".yml"):
        try:
            return json.loads(text, object_pairs_hook=_unique_keys(path))
        except json.JSONDecodeError as exc:
            raise UsageError(f"--config {path}: invalid JSON ({exc}); fix the file (a .yaml or "
                             ".yml name reads it as YAML)") from None
    try:
        import yaml
    except ImportError:
        raise UsageError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml), "
                         "or give a .json file") from None
    try:
        return yaml.load(text, Loader=_unique_key_loader(yaml, path)) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UsageError(f"--config {path}: invalid YAML{where} ({problem}); fix the file "
                         "or check it with python -c 'import yaml,sys; "
                         "yaml.safe_load(open(sys.argv[1]))' FILE") from None


def _show(value: Any) -> str:
    """``value`` as the file spells it (``true``, ``null``, ``"2"``, ``[1]``)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _is_switch(action: argparse.Action) -> bool:
    """A flag that takes no value on the command line (store_true, --amp/--no-amp)."""
    return action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction)


def coerce(action: argparse.Action, value: Any) -> Any:
    """``value`` from a config file as the flag of ``action`` would hold it from the command
    line; ValueError (its text completes "must be ...") when it has the wrong type or is not
    one of the flag's choices."""
    if value is None:
        if action.default is None:  # the flag's own default: unset / chosen automatically
            return None
        raise ValueError(f"set (null is not a value; remove the key for the default "
                         f"{_show(action.default)})")
    if _is_switch(action):
        if isinstance(value, bool):
            return value
        raise ValueError(f"true or false, got {_show(value)}")
    kind = {int: "an integer", float: "a number"}.get(action.type, "a string")
    if isinstance(value, bool):
        raise ValueError(f"{kind}, got {_show(value)}")
    if action.type in (int, float):
        if isinstance(value, str):
            try:
                value = action.type(value)  # as argparse converts the same text
            except ValueError:
                raise ValueError(f"{kind}, got {_show(value)}") from None
        elif action.type is int and not isinstance(value, int):
            raise ValueError(f"{kind}, got {_show(value)}")
        elif not isinstance(value, (int, float)):
            raise ValueError(f"{kind}, got {_show(value)}")
        value = action.type(value)
    elif isinstance(value, list) and action.dest in COMMA_LISTS and all(
            isinstance(v, (int, str)) and not isinstance(v, bool) for v in value):
        value = ",".join(str(v) for v in value)
    elif isinstance(value, (int, float)):
        value = str(value)  # save_dir: 2024, gpu_ids: 0
    elif not isinstance(value, str):
        raise ValueError(f"a string, got {_show(value)}")
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"one of {', '.join(map(str, action.choices))}, got {_show(value)}")
    return value


def load_config(path: str, parser: argparse.ArgumentParser) -> tuple[dict[str, Any], dict[str, str]]:
    """Read a config file into ``{dest: value}``, each value checked against its flag, and
    ``{dest: key}``, the file's key that set each. Unknown keys, values of the wrong type or
    outside the choices, and two keys that set one flag to different values are one
    :class:`UsageError` naming every such key."""
    file = Path(path)
    if file.is_dir():
        raise UsageError(f"--config {path}: is a directory; give the YAML or JSON file")
    if not file.is_file():
        raise UsageError(f"--config {path}: no such file")
    data = _read(file)
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of settings at the top level")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    resolved: dict[str, Any] = {}
    source: dict[str, str] = {}
    unknown: list[str] = []
    problems: list[str] = []
    for key, value in _flatten(data).items():
        dest = _dest(key)
        action = actions.get(dest)
        if action is None:
            unknown.append(key)
            continue
        flag = action.option_strings[0]
        try:
            value = coerce(action, value)
        except ValueError as exc:
            problems.append(f"{key} ({flag}) must be {exc}")
            continue
        if dest in resolved and resolved[dest] != value:
            problems.append(f"{source[dest]} and {key} both set {flag}, to {_show(resolved[dest])} "
                            f"and {_show(value)}; keep one of them")
            continue
        resolved[dest], source[dest] = value, key
    if unknown:
        raise UsageError(f"--config {path}: unknown keys {', '.join(sorted(unknown))}; "
                         f"accepted: {accepted_keys()}")
    if problems:
        raise UsageError(f"--config {path}: " + "; ".join(problems))
    return resolved, source


def naming_config_key(exc: UsageError, args: argparse.Namespace) -> UsageError:
    """``exc`` with the config file's key that set its flag (``exc.flag``) named, when the
    value came from ``--config``."""
    key = getattr(args, "config_keys", {}).get(exc.flag[2:].replace("-", "_")) if exc.flag else None
    if key is None:
        return exc
    return UsageError(f"{exc} (set by {key} in --config {args.config})", shared=exc.shared,
                      flag=exc.flag)

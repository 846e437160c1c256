"""fastddp.train's command line: flags of main_multi_gpu.py, config files, bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from fastddp.train import UsageError, build_parser, parse_args, validate

CLASSIC_FLAGS = ["--multi-gpu", "--gpu-ids", "--mode", "--epochs", "--batch-size", "--lr",
                 "--warmup-epochs", "--weight-decay", "--num-workers", "--save-dir",
                 "--grad-accum-steps"]
OUR_FLAGS = ["--scale-lr", "--amp", "--no-amp", "--clip-grad", "--seed", "--data-dir",
             "--class-weights", "--sync-batchnorm", "--find-unused-parameters", "--comm-dtype",
             "--config", "--resume", "--log-interval", "--tensorboard", "--model", "--dataset"]


def test_help_lists_every_flag_of_main_multi_gpu() -> None:
    out = subprocess.run([sys.executable, "-m", "fastddp.train", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for flag in CLASSIC_FLAGS + OUR_FLAGS:
        assert flag in out, flag
    assert "DDP is faster" in out


def test_defaults_outside_torchrun(monkeypatch) -> None:
    for var in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    args = parse_args([])
    assert args.multi_gpu == "none" and args.mode == "flatten" and args.resume == "auto"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert parse_args([]).multi_gpu == "ddp"


def test_config_file_sets_flags_and_cli_wins(tmp_path) -> None:
    cfg = tmp_path / "multi_gpu.json"
    cfg.write_text(json.dumps({
        "training": {"batch_size": 128, "lr": 0.003, "epochs": 7},
        "distributed": {"backend": "gloo", "find_unused_parameters": True,
                        "sync_batchnorm": True},
        "mode": "conv1d",
    }))
    args = parse_args(["--config", str(cfg), "--epochs", "2"])
    assert (args.batch_size, args.lr, args.epochs, args.mode) == (128, 0.003, 2, "conv1d")
    assert args.backend == "gloo" and args.find_unused_parameters and args.sync_batchnorm


def test_config_yaml(tmp_path) -> None:
    pytest.importorskip("yaml")
    cfg = tmp_path / "distributed.yaml"
    cfg.write_text("training:\n  batch_size: 16\ndistributed:\n  backend: gloo\n")
    args = parse_args(["--config", str(cfg)])
    assert args.batch_size == 16 and args.backend == "gloo"


def test_config_value_refused_names_its_key(tmp_path) -> None:
    cfg = tmp_path / "c4.json"
    cfg.write_text(json.dumps({"training": {"lr": -1, "epochs": 2}}))
    with pytest.raises(UsageError, match=r"^--lr must be a finite number > 0, got -1(\.0)? "
                                         rf"\(set by training\.lr in --config {re.escape(str(cfg))}\)$"):
        validate(parse_args(["--config", str(cfg)]), 0)
    with pytest.raises(UsageError, match=r"^--lr must be a finite number > 0, got -2\.0$"):  # the command line's
        validate(parse_args(["--config", str(cfg), "--lr", "-2"]), 0)


def test_config_value_refused_names_its_key_where_the_message_names_the_flag_later(tmp_path) -> None:
    cfg = tmp_path / "c5.json"
    cfg.write_text(json.dumps({"training": {"mode": "resnet"}}))
    with pytest.raises(UsageError, match=r"^unknown --mode 'resnet': choose one of flatten, conv1d, "
                                         rf"lstm \(set by training\.mode in --config {re.escape(str(cfg))}\)$"):
        validate(parse_args(["--config", str(cfg)]), 0)


def test_config_unknown_keys_are_named(tmp_path) -> None:
    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"training": {"batch_sise": 3}, "colour": "red"}))
    with pytest.raises(UsageError, match=r"unknown keys colour, training\.batch_sise"):
        parse_args(["--config", str(cfg)])


def test_config_section_that_is_not_a_classic_one_is_refused(tmp_path) -> None:
    """evaluation.batch_size and logging.save-dir name no flag: neither sets --batch-size /
    --save-dir through its last part."""
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"evaluation": {"batch_size": 512}, "training": {"lr": 0.01},
                               "logging": {"save-dir": "runs/x"}}))
    with pytest.raises(UsageError, match=r"unknown keys evaluation\.batch_size, "
                                         r"logging\.save-dir; accepted: a flag's name at the "
                                         r"top level .* training\.\(batch_size\|lr\|") as info:
        parse_args(["--config", str(cfg)])
    assert "distributed.(backend|" in str(info.value) and "model.mode" in str(info.value)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"epochs": True}, r"epochs \(--epochs\) must be an integer, got true"),
        ({"training": {"epochs": 2.5}}, r"training\.epochs \(--epochs\) must be an integer, got 2\.5"),
        ({"save_interval": 1.5}, r"save_interval \(--save-interval\) must be an integer, got 1\.5"),
        ({"seed": "x"}, r'seed \(--seed\) must be an integer, got "x"'),
        ({"lr": [0.1]}, r"lr \(--lr\) must be a number, got \[0\.1\]"),
        ({"warmup_epochs": None}, r"warmup_epochs \(--warmup-epochs\) must be set \(null is not "
                                  r"a value; remove the key for the default 1\.0\)"),
        ({"tensorboard": "false"}, r'tensorboard \(--tensorboard\) must be true or false, got "false"'),
        ({"training": {"amp": "no"}}, r'training\.amp \(--amp\) must be true or false, got "no"'),
        ({"distributed": {"backend": "mpi"}},
         r'distributed\.backend \(--backend\) must be one of auto, nccl, gloo, got "mpi"'),
        ({"comm_dtype": "int8"}, r'comm_dtype \(--comm-dtype\) must be one of none, bf16, fp16'),
        ({"training": {"lr": 0.1}, "lr": 0.2},
         r"training\.lr and lr both set --lr, to 0\.1 and 0\.2; keep one of them"),
        ({"training": {"lr": 0.1, "learning_rate": 0.2}},
         r"training\.lr and training\.learning_rate both set --lr"),
    ],
    ids=["bool-int", "float-int", "float-interval", "text-int", "list-float", "null", "text-switch",
         "text-amp", "backend-choice", "comm-dtype-choice", "conflict-flat", "conflict-alias"],
)
def test_config_value_is_checked_like_the_flag(tmp_path, settings, message) -> None:
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(settings))
    with pytest.raises(UsageError, match=rf"^--config {re.escape(str(cfg))}: {message}"):
        parse_args(["--config", str(cfg)])


def test_config_values_convert_as_on_the_command_line(tmp_path) -> None:
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"lr": "1e-3", "epochs": "2", "gpu_ids": [0, 1], "amp": False,
                               "training": {"lr": 0.001}, "save_dir": 2024}))
    args = parse_args(["--config", str(cfg)])
    assert (args.lr, args.epochs, args.gpu_ids, args.amp, args.save_dir) == (0.001, 2, "0,1", False, "2024")


def test_debug_in_the_config_file_shows_the_traceback(tmp_path) -> None:
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"debug": True, "lr": -1}))
    proc = _launcher(["--config", str(cfg)])
    assert "Traceback" in proc.stderr and "UsageError: --lr must be" in proc.stderr


@pytest.mark.parametrize(
    ("argv", "cuda_count", "message"),
    [
        (["--mode", "transformer"], 0, "unknown --mode 'transformer'"),
        (["--batch-size", "0"], 0, "--batch-size must be a positive integer"),
        (["--batch-size", "-4"], 0, "--batch-size must be a positive integer"),
        (["--gpu-ids", "0,3"], 2, r"GPU\(s\) \[3\] not present"),
        (["--gpu-ids", "0"], 0, "no CUDA GPU is visible"),
        (["--multi-gpu", "dp"], 0, "dp needs at least one CUDA GPU"),
        (["--backend", "nccl"], 0, "nccl needs CUDA GPUs"),
        (["--data-dir", "/nonexistent/har"], 0, "not a readable directory"),
        (["--resume", "/nonexistent/last.pt"], 0, "no such checkpoint file"),
        (["--lr", "0"], 0, "--lr must be a finite number > 0"),
        (["--lr", "nan"], 0, "--lr must be a finite number > 0, got nan"),
        (["--weight-decay", "-0.1"], 0, r"--weight-decay must be a finite number >= 0 \(0 disables\), got -0.1"),
        (["--clip-grad", "nan"], 0, "--clip-grad must be a finite number >= 0"),
        (["--warmup-epochs", "inf"], 0, "--warmup-epochs must be a finite number >= 0"),
        (["--timeout", "0"], 0, r"--timeout must be a number of seconds >= 1 and <= 1e\+09 \(about "
                                r"31 years\), got 0$"),
        (["--timeout", "1e-12"], 0, r"--timeout must be a number of seconds >= 1 and <= 1e\+09 .*"
                                    r"got 1e-12$"),
        (["--timeout", "0.5"], 0, r"--timeout must be a number of seconds >= 1 .*got 0\.5$"),
        (["--timeout", "1e10", "--multi-gpu", "ddp"], 0, r"--timeout must be a number of seconds >= 1 "
                                                         r"and <= 1e\+09 \(about 31 years\), got 1e\+10"),
        (["--comm-dtype", "bf16"], 0, r"^--comm-dtype bf16 only applies to --multi-gpu ddp \(it sets "
                                      r"DDPWrapper's all-reduce\); this run is --multi-gpu none: drop "
                                      r"it, or start the run with torchrun"),
        (["--find-unused-parameters"], 0, r"^--find-unused-parameters only applies to --multi-gpu ddp"),
        (["--sync-batchnorm", "--multi-gpu", "dp"], 1, r"^--sync-batchnorm only applies to --multi-gpu "
                                                       r"ddp .* this run is --multi-gpu dp"),
        (["--backend", "gloo"], 0, r"^--backend gloo only applies to --multi-gpu ddp"),
        (["--timeout", "30"], 0, r"^--timeout 30\.0 only applies to --multi-gpu ddp \(it sets how long a "
                                 r"collective of the DDP ranks waits for a lost rank\)"),
        (["--amp-dtype", "fp16"], 0, r"^--amp-dtype fp16 sets the autocast dtype but AMP is off by "
                                     r"default without a GPU; add --amp to train in mixed precision, "
                                     r"or drop --amp-dtype"),
        (["--amp-dtype", "bf16", "--no-amp"], 1, r"^--amp-dtype bf16 sets the autocast dtype but "
                                                 r"--no-amp is given"),
        (["--dataset", "m:make", "--data-dir", "/tmp"], 0,
         r"^--dataset m:make and --data-dir /tmp both choose the training data; give one"),
        (["--model", "m:make", "--mode", "lstm"], 0,
         r"^--model m:make and --mode lstm both choose the model; give one"),
        (["--model", "m:make", "--mode", "flatten"], 0,  # the default, given: refused as well
         r"^--model m:make and --mode flatten both choose the model; give one"),
        (["--resume", "/tmp"], 0, r"^--resume /tmp: is a directory; give the checkpoint file in it "
                                   r"\(/tmp/last\.pt\), or --save-dir /tmp to continue the run there"),
        (["--num-workers", "-1"], 0, r"^--num-workers must be 0\.\.\d+ \(loader threads per "
                                     r"process, at most 8 per CPU core of this machine\), got -1$"),
        (["--num-workers", "10" + "0" * 20], 0, r"^--num-workers must be 0\.\.\d+ .* got 10{21}$"),
        (["--warmup-epochs", "3", "--epochs", "2"], 0,
         r"^--warmup-epochs 3 is longer than the run \(--epochs 2\): the learning rate would "
         r"still be rising when training ends; give at most --epochs$"),
        (["--gpu-ids", ",,"], 0, r"^--gpu-ids must name at least one GPU id, e\.g\. 0,1, got ',,'"),
        (["--max-nan-steps", "0"], 0, r"--max-nan-steps must be >= 1 \(1 stops at the first"),
        (["--save-interval", "-1"], 0, r"--save-interval must be >= 0 \(0: a checkpoint per epoch only\), got -1"),
    ],
)
def test_bad_input_is_one_clear_error(argv, cuda_count, message) -> None:
    args = parse_args(argv)
    with pytest.raises(UsageError, match=message):
        validate(args, cuda_count)


@pytest.mark.parametrize(("argv", "message"), [
    (["--save-dir", ""], r"--save-dir is empty \(''\); give a directory for the run's files"),
    (["--resume", " "], r"--resume is empty \(' '\); give auto, none or a checkpoint file"),
    (["--data-dir", ""], r"--data-dir is empty \(''\); give the UCI HAR directory"),
    (["--config", ""], r"--config is empty \(''\); give a YAML or JSON file"),
    (["--config", "{yaml}"], r"--save-dir is empty \(''\)"),
], ids=["save-dir", "resume", "data-dir", "config", "save-dir-from-config"])
def test_empty_path_is_one_clear_error(tmp_path, argv, message) -> None:
    """An empty path (an unset shell variable) is '.' to pathlib: the run's files went to the
    working directory, and an empty --config was skipped without a word."""
    config = tmp_path / "c.yaml"
    config.write_text('save_dir: ""\n')
    with pytest.raises(UsageError, match=message):
        validate(parse_args([a.format(yaml=config) for a in argv]), 0)


def test_more_ranks_than_gpus_with_nccl(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = parse_args(["--backend", "nccl"])
    with pytest.raises(UsageError, match=r"4 ranks on this node but only 2 GPU\(s\)"):
        validate(args, cuda_count=2)


@pytest.mark.parametrize("mode", ["none", "dp"])
def test_single_process_mode_in_a_world_of_several_is_refused(monkeypatch, mode) -> None:
    """torchrun --nproc_per_node=2 ... --multi-gpu none: each process would train alone into
    the same --save-dir."""
    for name, value in dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1").items():
        monkeypatch.setenv(name, value)
    args = parse_args(["--multi-gpu", mode])
    with pytest.raises(UsageError, match=rf"^--multi-gpu {mode} trains in one process, but this "
                                         r"is one of WORLD_SIZE=2 processes .* Use --multi-gpu "
                                         "ddp"):
        validate(args, cuda_count=1)


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
def test_error_of_a_run_on_rank_1_is_printed_by_rank_1(monkeypatch, capsys, shared) -> None:
    """An input error that only rank 1 meets is printed by rank 1 (rank 0 cannot know it);
    one that every rank raises from rank 0's verdict is printed by rank 0 alone."""
    from fastddp.train import loop, main

    def run(args):
        raise UsageError("the problem and its fix", shared=shared)

    for name, value in dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(loop, "run", run)
    assert main(["--multi-gpu", "ddp"]) == 2
    err = capsys.readouterr().err
    assert err == ("" if shared else "fastddp.train: rank 1: error: the problem and its fix\n")


@pytest.mark.parametrize("variables", [dict(LOCAL_RANK="1"), dict(RANK="1")], ids=["LOCAL_RANK", "RANK"])
def test_a_stray_rank_variable_outside_torchrun_leaves_the_error_printed(monkeypatch, capsys,
                                                                         variables) -> None:
    """A single process (not started by torchrun) whose environment holds a leftover RANK or
    LOCAL_RANK is rank 0 of its own run: its input error is printed, not left to a rank 0
    that does not exist (exit 2 without a word)."""
    from fastddp.train import loop, main

    def run(args):
        raise UsageError("the problem and its fix", shared=True)

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert main(["--lr", "-1"]) == 2
    assert capsys.readouterr().err == "fastddp.train: error: --lr must be a finite number > 0, got -1.0\n"
    monkeypatch.setattr(loop, "run", run)
    assert main([]) == 2
    assert capsys.readouterr().err == "fastddp.train: error: the problem and its fix\n"


@pytest.mark.parametrize(("variables", "message"), [
    (dict(RANK="abc"), "RANK='abc' in the environment is not a valid rank (torchrun sets it"),
    (dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="x"), "LOCAL_RANK='x' in the environment is not a valid local rank"),
    (dict(WORLD_SIZE="0", RANK="0", LOCAL_RANK="0"), "WORLD_SIZE='0' in the environment is not a valid world size"),
    (dict(WORLD_SIZE="2", RANK="2", LOCAL_RANK="0"), "RANK=2 in the environment is not below the world it is a "
                                                    "rank of (2 process(es))"),
], ids=["rank", "local_rank", "world_size", "rank_too_large"])
def test_a_malformed_launch_variable_is_one_clear_error(monkeypatch, variables, message) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    args = parse_args(["--multi-gpu", "ddp"])
    with pytest.raises(UsageError) as info:
        validate(args, cuda_count=0)
    assert str(info.value).startswith(message), str(info.value)


def test_a_leading_tilde_is_the_home_directory_where_the_shell_left_it(tmp_path, monkeypatch) -> None:
    """``--save-dir=~/runs`` (no shell expansion after ``=``) and ``save_dir: ~/runs`` in a config
    file name the home directory, not a folder called ``~`` in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = tmp_path / "run.yaml"
    config.write_text("save_dir: ~/from_config\n")
    for argv, expected in ((["--save-dir=~/runs"], "runs"), (["--config", str(config)], "from_config")):
        args = parse_args(argv)
        validate(args, cuda_count=0)
        assert args.save_dir == str(tmp_path / "home" / expected), args.save_dir


@pytest.mark.parametrize(("name", "value", "message"), [
    ("FASTDDP_BATCH_GRAD_COPIES", "banana", "FASTDDP_BATCH_GRAD_COPIES='banana' is not understood; set it to 1, 0 or auto"),
    ("FASTDDP_STALL_THRESHOLD_S", "abc", "FASTDDP_STALL_THRESHOLD_S must be a number of seconds, got 'abc'"),
], ids=["batch_copies", "stall_threshold"])
def test_a_malformed_fastddp_setting_is_one_clear_error(monkeypatch, name, value, message) -> None:
    """The wrapper's own environment settings, mistyped: one line naming the variable before
    the run starts (the wrapper's ValueError came as a traceback)."""
    monkeypatch.setenv(name, value)
    args = parse_args(["--multi-gpu", "ddp"])
    with pytest.raises(UsageError) as info:
        validate(args, cuda_count=0)
    assert str(info.value).startswith(message), str(info.value)


def test_bad_input_exits_2_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "fastddp.train", "--mode", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["fastddp.train: error: unknown --mode 'nope': choose one of flatten, conv1d, lstm"]


def test_parser_builds() -> None:
    assert build_parser().prog == "python -m fastddp.train"


def test_lost_peer_message_is_one_line_for_backend_errors_only() -> None:
    from fastddp.train import lost_peer_message

    gloo = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
                        "[127.0.0.1]:5557: Connection reset by peer. This is typically caused by a "
                        "remote worker hanging or bugs in the application.")
    line = lost_peer_message(gloo, 3)
    assert line is not None and "\n" not in line
    assert line.startswith("fastddp.train: rank 3: lost contact with the other ranks during a "
                           "collective (Read error [127.0.0.1]:5557: Connection reset by peer)")
    assert "; a peer process died, stopped responding, or the network failed" in line
    assert "; rank 1 died, stopped responding, or the network failed" in lost_peer_message(gloo, 0, world=2)
    # a long cause is shortened at a word, not cut inside one
    long = RuntimeError("Timed out after 20000 ms waiting for rank 1 (pid 4242, alive) " + "word " * 80)
    assert "(Timed out after 20000 ms waiting for rank 1 (pid 4242, alive) word word" in lost_peer_message(long, 0, 2)
    assert " word ...); rank 1 died" in lost_peer_message(long, 0, 2)
    # gloo, when a cut link goes silent (seen in the two-host link-cut test)
    silent = RuntimeError("Application timeout caused pair closure")
    assert "(Application timeout caused pair closure); rank 0 died" in lost_peer_message(silent, 1, world=2)
    assert lost_peer_message(ValueError("Connection reset by peer"), 0) is None
    assert lost_peer_message(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), 0) is None


def _launcher(argv: list[str], env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "fastddp.train", *argv], capture_output=True,
                          text=True, timeout=300, cwd=cwd,
                          env=dict(os.environ, **(env or {})))


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    return lines[0]


def _bad_yaml(tmp_path):
    pytest.importorskip("yaml")
    cfg = tmp_path / "multi_gpu.yaml"
    cfg.write_text("training:\n  batch_size: [64\n  lr: 0.001\n")
    return str(cfg)


def test_unparsable_yaml_config_is_one_line_naming_the_file(tmp_path) -> None:
    cfg = _bad_yaml(tmp_path)
    line = _one_line(_launcher(["--config", cfg]))
    assert line.startswith(f"fastddp.train: error: --config {cfg}: invalid YAML at line 3"), line
    assert "fix the file" in line


def test_unreadable_config_is_one_line(tmp_path) -> None:
    cfg = tmp_path / "run.json"
    cfg.write_bytes(b"\xff\xfe\x00binary")
    line = _one_line(_launcher(["--config", str(cfg)]))
    assert f"--config {cfg}: cannot be read as a text file" in line


def test_seed_out_of_range_is_one_line() -> None:
    line = _one_line(_launcher(["--seed", "1180591620717411303424"]))
    assert line == ("fastddp.train: error: --seed must be an integer in 0..9223372036854775807 "
                    "(2**63 - 1), got 1180591620717411303424")
    assert "--seed must be" in _one_line(_launcher(["--seed", "-1"]))


def test_missing_model_module_is_one_line_with_the_fix() -> None:
    line = _one_line(_launcher(["--model", "my_models_typo:make"]))
    assert "--model 'my_models_typo:make': cannot import 'my_models_typo'" in line
    assert "add its folder to PYTHONPATH" in line


@pytest.mark.parametrize("how", ["--debug", "FASTDDP_DEBUG=1"])
def test_debug_shows_the_traceback(tmp_path, how) -> None:
    cfg = _bad_yaml(tmp_path)
    argv, env = (["--debug"], None) if how == "--debug" else ([], {"FASTDDP_DEBUG": "1"})
    proc = _launcher(["--config", cfg, *argv], env=env)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "UsageError: --config" in proc.stderr


def test_model_factory_that_returns_no_module_is_one_clear_error(tmp_path, monkeypatch) -> None:
    from fastddp.train.models import build_model

    (tmp_path / "not_a_model.py").write_text("def make():\n    return (1, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match=r"^--model 'not_a_model:make' returned a tuple, not a "
                                         r"torch\.nn\.Module; the factory must build and return"):
        build_model("flatten", "not_a_model:make")


def test_config_that_is_a_directory_is_named_as_one(tmp_path) -> None:
    with pytest.raises(UsageError, match=rf"^--config {re.escape(str(tmp_path))}: is a directory; "
                                         "give the YAML or JSON file$"):
        parse_args(["--config", str(tmp_path)])


def test_save_dir_that_is_a_file_is_named_as_one(tmp_path) -> None:
    from fastddp.train.save_dir import check_save_dir

    file = tmp_path / "run"
    file.write_text("results of something else")
    with pytest.raises(UsageError, match=rf"^--save-dir {re.escape(str(file))}: is a file, not a "
                                         r"directory; choose a directory \(it is created if missing\)$"):
        check_save_dir(file)
    assert file.read_text() == "results of something else"


def test_key_given_twice_in_a_json_config_is_refused(tmp_path) -> None:
    cfg = tmp_path / "run.json"
    cfg.write_text('{"training": {"lr": 0.1, "lr": 0.2}}')
    with pytest.raises(UsageError, match=rf"^--config {re.escape(str(cfg))}: key 'lr' is given "
                                         r"twice in one mapping \(values 0\.1 and 0\.2\); keep one$"):
        parse_args(["--config", str(cfg)])


def test_key_given_twice_in_a_yaml_config_is_refused(tmp_path) -> None:
    pytest.importorskip("yaml")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("training:\n  lr: 0.1\n  epochs: 3\n  lr: 0.2\n")
    with pytest.raises(UsageError, match=rf"^--config {re.escape(str(cfg))}: key 'lr' is given "
                                         r"twice in one mapping \(lines 2 and 4\); keep one$"):
        parse_args(["--config", str(cfg)])


def test_directory_in_place_of_a_run_file_is_refused_at_start(tmp_path) -> None:
    """A directory named best.pt (or last.pt, metrics.csv, ...) in --save-dir would fail the
    writer after epoch 1's training: it is named before the run starts."""
    from fastddp.train.save_dir import check_save_dir

    (tmp_path / "best.pt").mkdir()
    with pytest.raises(UsageError, match=rf"^--save-dir {re.escape(str(tmp_path))}: "
                                         rf"{re.escape(str(tmp_path / 'best.pt'))} is a directory "
                                         r"where the run writes a file of that name; move it "
                                         r"away, or choose another --save-dir$"):
        check_save_dir(tmp_path)


def test_lock_file_name_taken_by_a_directory_is_refused_at_start(tmp_path) -> None:
    from fastddp.train.save_dir import check_save_dir

    (tmp_path / ".fastddp.lock").mkdir()
    with pytest.raises(UsageError, match=rf"{re.escape(str(tmp_path / '.fastddp.lock'))} is a directory "
                                         r"where the run writes a file of that name"):
        check_save_dir(tmp_path)


def test_file_in_place_of_the_tensorboard_directory_is_refused_at_start(tmp_path) -> None:
    """--tensorboard writes its events into save_dir/tensorboard/: a file there is named before
    the run writes anything, not a FileExistsError traceback after config.json."""
    from fastddp.train.save_dir import check_save_dir

    (tmp_path / "tensorboard").write_text("x")
    check_save_dir(tmp_path)  # without --tensorboard the file is nobody's business
    with pytest.raises(UsageError, match=rf"^--save-dir {re.escape(str(tmp_path))}: "
                                         rf"{re.escape(str(tmp_path / 'tensorboard'))} is a file where the "
                                         r"run writes a directory of that name; move it away"):
        check_save_dir(tmp_path, ("tensorboard",))

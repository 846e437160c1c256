"""Where a thread is, in words, from its Python stack: the summary line of a stall report
("in torch.distributed.all_gather called at eval.py:40 in evaluate") and the frames under it."""

from __future__ import annotations

import os
import sys
import traceback

import torch

_TORCH = os.path.dirname(torch.__file__) + os.sep
_FASTDDP = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_C10D = os.path.join(_TORCH, "distributed", "distributed_c10d.py")
_DATA = (os.path.join(_TORCH, "utils", "data", ""), os.path.join(_FASTDDP, "loader", ""))
_LIBRARIES = (_TORCH, _FASTDDP, os.path.dirname(os.__file__) + os.sep)  # and the standard library
_FRAMES = 8  # frames listed under the summary


def _where(frame: traceback.FrameSummary) -> str:
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


def _user_frame(frames: list[traceback.FrameSummary], before: int) -> traceback.FrameSummary | None:
    """The innermost frame outside torch and fastddp among ``frames[:before]``."""
    for frame in reversed(frames[:before]):
        if not frame.filename.startswith(_LIBRARIES):
            return frame
    return None


def summarize(frames: list[traceback.FrameSummary]) -> str:
    """One line: the torch.distributed collective, data loading or code the stack is in."""
    if not frames:
        return "no Python frame"
    for i, frame in enumerate(frames):  # outermost first: the public function of the API
        if frame.filename == _TORCH_C10D:
            user = _user_frame(frames, i)
            called = f" called at {_where(user)}" if user else ""
            return f"in torch.distributed.{frame.name}{called}"
    for i, frame in enumerate(frames):
        if frame.filename.startswith(_DATA):
            user = _user_frame(frames, i)
            called = f" called at {_where(user)}" if user else ""
            return f"loading data ({frame.name} in {os.path.basename(frame.filename)}){called}"
    user = _user_frame(frames, len(frames))
    return f"at {_where(user or frames[-1])}"


def describe_thread(thread_id: int) -> str:
    """The summary line of the thread's stack, then its innermost frames, one a line."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "the training thread has ended"
    frames = traceback.extract_stack(frame)
    lines = [summarize(frames)] + [f"  {_where(f)}" for f in reversed(frames[-_FRAMES:])]
    return "\n".join(lines)


def describe_exception(kind: type, value: BaseException, tb: object) -> str:
    """One line for an uncaught exception: its type, the first line of its message and the
    innermost frame outside torch and fastddp ("ValueError: bad batch at train.py:40 in step")."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    user = _user_frame(frames, len(frames)) or (frames[-1] if frames else None)
    message = str(value).strip().splitlines()[0][:300] if str(value).strip() else ""
    where = f" at {_where(user)}" if user else ""
    return f"{kind.__name__}{': ' + message if message else ''}{where}"

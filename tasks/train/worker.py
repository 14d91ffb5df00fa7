"""One rank of the long-lived trainer process group (started by torchrun; see tasks/train/remote.py).

Every rank builds its PolicyTrainer from the JSON file the driver wrote (this joins the process group), then rank
0 listens on a loopback control socket for the driver (the flow process), which sends `("call", method, args,
kwargs)` ... `("stop",)`. Rank 0 broadcasts each command to the other ranks, every rank runs it (so the
collectives inside line up), and rank 0 sends the result back. The model is built once and lives as long as
the group does.

    SLUICEWAY_TRAINER_INIT      JSON file of PolicyTrainer's arguments (configs as dicts; no secrets)
    SLUICEWAY_TRAINER_CONTROL   host:port rank 0 listens on (loopback; port 0: one the OS picks)
    SLUICEWAY_TRAINER_CONTROL_FILE  where rank 0 then writes the host:port it listens on (optional)
    SLUICEWAY_TRAINER_AUTHKEY   hex key the driver must present (kept out of argv, so out of `ps` and logs)
    SLUICEWAY_TRAINER_ERROR_DIR where a rank that fails writes `rank<N>.error`: its own error line first (optional)

A rank that fails records its error before it exits: torchrun then stops the others and ends its log with a
summary of exit codes that does not say why, and under load the failing rank's traceback can be far above it.
The driver reads these files (tasks/train/remote.py `first_rank_error`) and names the first failure's cause.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback
from multiprocessing.connection import Listener

import torch
import torch.distributed as dist

# What the driver may call: the trainer's public steps, nothing else.
ALLOWED = {"train_rollout", "train_sft", "gradients", "save", "load", "write_weights", "state"}


def _build(kwargs: dict):
    from sluiceway.flows.config import AlgorithmConfig, TrainingConfig
    from sluiceway.tasks.train.trainer import PolicyTrainer

    kwargs = dict(kwargs)
    kwargs["training"] = TrainingConfig.model_validate(kwargs["training"])
    kwargs["algorithm"] = AlgorithmConfig.model_validate(kwargs["algorithm"])
    return PolicyTrainer(**kwargs)


def send(conn, obj) -> None:
    """Plain pickle, not Connection.send: torch registers shared-memory reducers with multiprocessing's pickler,
    which would hand tensors over as file descriptors that a process outside this group cannot open."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn):
    return pickle.loads(conn.recv_bytes())


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def record_failure(rank: int, exc: BaseException) -> None:
    """Write `rank<N>.error` under SLUICEWAY_TRAINER_ERROR_DIR: the time (which rank failed first), the error's
    one line, then its traceback. Never raises: the rank is failing already."""
    where = os.environ.get("SLUICEWAY_TRAINER_ERROR_DIR")
    if not where:
        return
    line = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    text = json.dumps({"rank": rank, "time": time.time(), "error": line,
                       "traceback": "".join(traceback.format_exception(exc))})  # fmt: skip
    path = os.path.join(where, f"rank{rank}.error")
    if os.path.exists(path):
        return  # this rank's first failure is the one that says why
    try:
        with open(f"{path}.tmp", "w") as f:
            f.write(text)
        os.replace(f"{path}.tmp", path)  # the driver never reads half a record
    except OSError:
        pass


def serve() -> None:
    rank = int(os.environ["RANK"])
    try:
        _serve(rank)
    except BaseException as exc:
        if not isinstance(exc, SystemExit | KeyboardInterrupt):
            record_failure(rank, exc)
        raise


def _serve(rank: int) -> None:
    torch.set_num_threads(int(os.environ.get("SLUICEWAY_TRAINER_THREADS", "1")))
    with open(os.environ["SLUICEWAY_TRAINER_INIT"]) as f:
        init = json.load(f)
    trainer, failure = None, None
    try:
        trainer = _build(init)  # every rank: this joins the process group
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        record_failure(rank, exc)  # before anything else: torchrun may stop this rank when another one exits
        if rank != 0:
            raise
    if rank != 0:
        _follow(trainer)
        return
    host, port = os.environ["SLUICEWAY_TRAINER_CONTROL"].rsplit(":", 1)
    key = bytes.fromhex(os.environ.pop("SLUICEWAY_TRAINER_AUTHKEY"))
    with Listener((host, int(port)), authkey=key) as listener:
        _publish(listener.address)
        conn = listener.accept()  # one driver: stop listening once it is here
    with conn:
        if failure is not None:
            send(conn, ("error", failure))
            return
        layout = f"{dist.get_world_size()} ranks, tensor parallel {trainer.tp_size}"
        layout += ", distributed optimizer" if trainer.zero is not None else ""
        print(f"trainer group ready: {layout}", flush=True)
        send(conn, ("ok", {"world_size": dist.get_world_size()}))
        while True:
            msg = _broadcast(recv(conn))
            if msg[0] == "stop":
                break
            send(conn, _run(trainer, msg))
    dist.destroy_process_group()


def _publish(address: tuple[str, int]) -> None:
    # Port 0 lets the OS pick a port no other run holds; the driver learns it from this file.
    path = os.environ.get("SLUICEWAY_TRAINER_CONTROL_FILE")
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{address[0]}:{address[1]}")
        os.replace(tmp, path)  # the driver never reads half an address


def _follow(trainer) -> None:
    """Ranks other than 0: run whatever rank 0 broadcasts until told to stop."""
    while True:
        msg = _broadcast(None)
        if msg[0] == "stop":
            break
        _run(trainer, msg)
    dist.destroy_process_group()


def _run(trainer, msg: tuple) -> tuple[str, object]:
    _, method, args, kwargs = msg
    try:
        if method not in ALLOWED:
            raise ValueError(f"trainer method {method!r} is not callable remotely")
        return "ok", getattr(trainer, method)(*args, **kwargs)
    except Exception as exc:  # reported to the driver, which raises it there
        return "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"


if __name__ == "__main__":
    serve()
    sys.exit(0)

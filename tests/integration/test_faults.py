"""Faults, tried on purpose through the real CLI on tiny-llama (docs/reliability.md lists what each shows).

Every run here has a reward that varies (vowel share) and `--lr 1e-3`, so the weights really move and
"bit-identical to an uninterrupted run" means something: the reference run's final checkpoint (model and Adam
state) is compared tensor by tensor. Tests of a run's data (rewards, tables, checkpoints, weights) run against the
worker's shared Prefect server (`shared_prefect`); kills, disk-full and credentials keep the run's own server.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from cli_run import BATCH, SCORER, N, cli_args
from paths import DATA
from process_tags import processes_tagged

from sluiceway.storage.integrity import check_tables
from sluiceway.storage.maintenance import RUN_TABLES
from sluiceway.storage.metrics import metrics_frame
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories

STEPS = 3


def run_args(run_dir: Path, *extra: str) -> list[str]:
    return [
        "run", "--prompt-data", "env:arithmetic", "--hf-checkpoint", "tiny-llama", "--output-dir", str(run_dir),
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N), "--global-batch-size", str(BATCH * N),
        "--micro-batch-size", "8", "--rollout-max-response-len", "8", "--rollout-temperature", "1.0",
        "--lr", "1e-3", "--save-interval", "1", "--env-size", "32", "--seed", "3", "--custom-rm-path", SCORER,
        "--num-rollout", str(STEPS), *extra,
    ]  # fmt: skip


def cli(args: list[str], cache: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, SLUICEWAY_CACHE=str(cache), **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "sluiceway.flows.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def start(args: list[str], cache: Path, tag: str, env: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, SLUICEWAY_CACHE=str(cache), SLUICEWAY_TEST_TAG=tag, **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "sluiceway.flows.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def one_line_error(proc: subprocess.CompletedProcess, code: int) -> str:
    """The command failed with `code`, and said so in exactly one line on stderr, without a traceback."""
    assert proc.returncode == code, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and " INFO " not in ln and " WARNING " not in ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


def final_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "latest" / "tp0.pt", map_location="cpu", weights_only=False)


def assert_same_training(run_dir: Path, reference: Path) -> None:
    """Same final weights and Adam state as the uninterrupted run, every step's data once, metrics complete."""
    got, want = final_state(run_dir), final_state(reference)
    assert got["step"] == want["step"] == STEPS - 1
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    for pid, state in want["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][pid][key]), torch.as_tensor(value)), key
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    table = read_trajectories(store, run_dir.name)
    keys = list(zip(*(table.column(c).to_pylist() for c in ("step", "group_id", "sample_index"))))
    assert len(keys) == len(set(keys)) == STEPS * BATCH * N
    frame = metrics_frame(store, run_dir.name)
    assert list(frame["train/loss"].dropna().index) == list(range(STEPS))


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stdout.read()}"
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)


def checkpoint_step(run_dir: Path) -> int | None:
    meta = run_dir / "checkpoints" / "latest" / "meta.json"
    try:
        return yaml.safe_load(meta.read_text())["step"]
    except (OSError, TypeError, KeyError, yaml.YAMLError):
        return None


@pytest.fixture(scope="module")
def cache(tmp_path_factory, warm_cache) -> Path:
    """The module's cache: the session's warm one, so its runs and the shared two_step_run chose the same
    precision from one probe (probed apart, a loaded machine could make one bf16 and the other fp32)."""
    cache = tmp_path_factory.mktemp("module-cache") / "cache"
    shutil.copytree(warm_cache, cache)
    return cache


@pytest.fixture(scope="module")
def live_reference(tmp_path_factory, cache) -> SimpleNamespace:
    """The uninterrupted run, and what a second run and a resume on its directory were told while it ran: one run
    serves test_a_second_run_on_a_live_directory_is_refused and, as `reference`, every test that compares."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    first = start(run_args(run_dir), cache, f"fault-{uuid.uuid4().hex}")
    wait_for(lambda: (run_dir / "sluiceway-run.yaml").exists(), first, "the first run's record")
    second = cli(run_args(run_dir, "--seed", "4"), cache)
    resumed = cli(["resume", str(run_dir)], cache)  # a resume of a live run is refused the same way
    output, _ = first.communicate(timeout=600)
    return SimpleNamespace(run_dir=run_dir, pid=first.pid, returncode=first.returncode, output=output,
                           second=second, resumed=resumed)  # fmt: skip


@pytest.fixture(scope="module")
def reference(live_reference) -> Path:
    """An uninterrupted run: what every interrupted one must end up equal to."""
    assert live_reference.returncode == 0, live_reference.output
    return live_reference.run_dir


@pytest.fixture(scope="module")
def two_steps(two_step_run) -> Path:
    """A finished run of the first STEPS - 1 steps with run_args' settings, copied (copy_run) by the tests that
    extend or damage it: the session's two-step run (tests/integration/conftest.py), which is that run."""
    run_dir, _ = two_step_run
    assert STEPS - 1 == 2 and run_args(run_dir)[:-2] == cli_args(run_dir)[3:]  # the same settings but the steps
    return run_dir


def copy_run(src: Path, dst_parent: Path) -> Path:
    """A finished run in another directory (its run record pointed there), to damage without touching `src`."""
    dst = dst_parent / src.name
    shutil.copytree(src, dst)
    record = dst / "sluiceway-run.yaml"
    data = yaml.safe_load(record.read_text())
    data["config"]["storage"]["output_dir"] = str(dst)
    record.write_text(yaml.safe_dump(data, sort_keys=False))
    return dst


def kill_when(run_dir: Path, cache: Path, predicate, what: str) -> None:
    tag = f"fault-{uuid.uuid4().hex}"
    proc = start(run_args(run_dir), cache, tag)
    wait_for(lambda: predicate(run_dir), proc, what)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(1)
    assert not processes_tagged(tag), "processes of the killed run are still alive"


def test_kill_right_after_a_checkpoint_loses_no_metrics(tmp_path, cache, reference):
    run_dir = tmp_path / "run"
    kill_when(run_dir, cache, lambda d: checkpoint_step(d) is not None, "a checkpoint")
    resumed = cli(["resume", str(run_dir)], cache)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_training(run_dir, reference)


@pytest.mark.slow  # three kills at seeded random moments: about a minute on 2 cores
def test_kill_at_seeded_random_moments(tmp_path, cache, reference):
    rng = random.Random(20)
    run_dir = tmp_path / "run"
    tag = f"fault-{uuid.uuid4().hex}"
    proc = start(run_args(run_dir), cache, tag)
    for _ in range(3):
        time.sleep(rng.uniform(2.0, 9.0))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc = start(["resume", str(run_dir)], cache, tag)
    assert proc.wait(600) == 0, proc.stdout.read()
    assert_same_training(run_dir, reference)


def test_a_second_run_on_a_live_directory_is_refused(cache, live_reference):
    """The second run and the resume were started while the reference run was live (the fixture)."""
    run_dir, first = live_reference.run_dir, live_reference
    line = one_line_error(live_reference.second, 2)
    assert f"in use by `sluiceway run` (pid {first.pid} on " in line
    assert f"pid {first.pid}" in one_line_error(live_reference.resumed, 2)
    assert first.returncode == 0, first.output
    # Finished, the directory still holds that run: another config is refused, not mixed in.
    later = cli(run_args(run_dir, "--seed", "4"), cache)
    assert "holds another run (training.seed differ)" in one_line_error(later, 2)


@pytest.mark.shared_prefect
def test_an_unusable_reward_source_stops_the_run_and_resume_scores_again(tmp_path, cache, reference):
    run_dir, marker = tmp_path / "run", tmp_path / "rm-broken"
    marker.touch()
    env = {"RM_BROKEN_MARKER": str(marker)}
    scorer = str(DATA / "noise_rewards.py") + ":vowel_share_unless_broken"
    args = run_args(run_dir)
    args[args.index(SCORER)] = scorer
    failed = cli(args, cache, env)
    line = one_line_error(failed, 1)
    assert "failed to score" in line and "HTTP 401" in line and "no reward was stored" in line
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    assert read_trajectories(store, "run", 0).column("reward").null_count == BATCH * N  # no zeros stored
    marker.unlink()  # the reward source works again
    resumed = cli(["resume", str(run_dir)], cache, env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert read_trajectories(store, "run").column("reward").null_count == 0


NAN_SCORER = """
def vowel_share_but_one_nan(response, label, sample):
    if (sample["step"], sample["group_id"], sample["sample_index"]) == (1, 0, 1):
        return float("nan")
    letters = [ch for ch in response.lower() if ch.isalpha()]
    return sum(ch in "aeiou" for ch in letters) / len(letters) if letters else 0.0
"""


@pytest.mark.shared_prefect
def test_a_nan_reward_fails_its_sample_and_the_run_goes_on(tmp_path, cache):
    """A scorer returning NaN for one sample of step 1: that sample is stored failed (reward 0 with its reason), as
    a scorer that raises; no NaN reaches a table or the weights, and the run finishes (once it stopped at step 1
    with `non-finite loss nan`, and every resume the same way)."""
    scorer = tmp_path / "nan_scorer.py"
    scorer.write_text(NAN_SCORER)
    run_dir = tmp_path / "run"
    args = run_args(run_dir)
    args[args.index(SCORER)] = f"{scorer}:vowel_share_but_one_nan"
    done = cli(args, cache)
    assert done.returncode == 0, done.stdout + done.stderr
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    rows = read_trajectories(store, "run").to_pylist()
    assert len(rows) >= STEPS * BATCH * N and all(r["reward"] == r["reward"] for r in rows)  # stored, no NaN
    (failed,) = [r for r in rows if "reward_status" in (r["reward_details"] or "")]
    assert (failed["step"], failed["group_id"], failed["sample_index"], failed["reward"]) == (1, 0, 1, 0.0)
    assert json.loads(failed["reward_details"]) == {
        "reward_status": "error", "message": "the scorer returned a non-finite reward nan"
    }
    losses = metrics_frame(store, "run")["train/loss"].tolist()
    assert len(losses) == STEPS and all(v == v for v in losses)  # every step trained, its loss finite
    assert checkpoint_step(run_dir) == STEPS - 1


@pytest.mark.shared_prefect
def test_a_nan_reward_stored_by_an_older_build_is_scored_again_on_resume(tmp_path, cache, two_steps):
    """A table from before the reward check holds a NaN reward in a step still to train: a resume scores that
    sample again (the ledger says the step is scored) and trains, instead of failing with `non-finite loss`."""
    import pyarrow as pa

    from sluiceway.storage.trajectories import update_samples

    run_dir = copy_run(two_steps, tmp_path)  # a finished run of 2 steps
    store = ObjectStore.from_uri(str(run_dir / "tables"))
    # What an older build stored (the writer refuses it now, so past it), then the checkpoint moved away:
    # the resume trains steps 0 and 1 again from the stored trajectories, as after a failed step 1.
    update_samples(store, "run", 1, [(2, 3)], {"reward": pa.array([float("nan")], pa.float64())}, "older build")
    shutil.move(run_dir / "checkpoints" / "latest", tmp_path / "moved")
    resumed = cli(["resume", str(run_dir)], cache)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    rewards = read_trajectories(store, "run", 1).column("reward").to_pylist()
    assert all(r == r for r in rewards) and checkpoint_step(run_dir) == 1


def _delete_earlier_parquet(run_dir: Path) -> None:
    from deltalake import DeltaTable

    files = DeltaTable(str(run_dir / "tables" / "trajectories")).file_uris()
    os.remove(sorted(files, key=lambda f: os.path.getmtime(f.removeprefix("file://")))[0].removeprefix("file://"))


def _truncate_newest_commit(run_dir: Path) -> None:
    # The metrics table: three commits, no log checkpoint (a commit that a checkpoint covers is never read).
    log_dir = run_dir / "tables" / "metrics" / "_delta_log"
    newest = sorted(log_dir.glob("*.json"))[-1]
    newest.write_bytes(newest.read_bytes()[:40])


def _truncate_checkpoint(run_dir: Path) -> None:
    f = run_dir / "checkpoints" / "latest" / "tp0.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_checkpoint_byte(run_dir: Path) -> None:
    f = run_dir / "checkpoints" / "latest" / "tp0.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


DAMAGE = {
    "earlier parquet deleted": (_delete_earlier_parquet, "references files that are gone or damaged (1 missing"),
    "newest commit truncated": (_truncate_newest_commit, "cannot be read"),
    "checkpoint truncated": (_truncate_checkpoint, "were written (truncated?)"),
    "checkpoint corrupted": (_flip_checkpoint_byte, "does not match the sha256"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.shared_prefect
def test_damaged_state_is_one_line_never_a_silent_success(tmp_path, reference, cache, damage):
    run_dir = copy_run(reference, tmp_path)
    harm, expected = DAMAGE[damage]
    harm(run_dir)
    resumed = cli(["resume", str(run_dir)], cache)
    line = one_line_error(resumed, 1)
    assert expected in line, line


@pytest.mark.shared_prefect
def test_a_damaged_checkpoint_moved_away_retrains_to_the_same_weights(tmp_path, reference, cache):
    run_dir = copy_run(reference, tmp_path)
    _truncate_checkpoint(run_dir)
    one_line_error(cli(["resume", str(run_dir)], cache), 1)
    shutil.move(run_dir / "checkpoints" / "latest", tmp_path / "damaged")  # what the message says to do
    resumed = cli(["resume", str(run_dir)], cache)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_training(run_dir, reference)  # retrained from the stored trajectories, bit for bit


def _flip_weights_byte(model_file: Path) -> str:
    """Flip the low byte of the middle element of the middle tensor (the weight moves a little: the run still
    finishes, as it did with the issue's damaged file); the tensor's name."""
    data = bytearray(model_file.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    name = names[len(names) // 2]
    width = {"F32": 4, "BF16": 2, "F16": 2}[header[name]["dtype"]]
    start, end = header[name]["data_offsets"]
    data[8 + n + start + (end - start) // width // 2 * width] ^= 0xFF
    model_file.write_bytes(bytes(data))
    return name


@pytest.mark.shared_prefect
def test_a_damaged_weight_version_is_rebuilt_from_the_checkpoint_on_resume(tmp_path, reference, cache, two_steps):
    """The version a resume loads on its engines is checked against the checksums written with it; a damaged one
    is written again from the (verified) checkpoint with a warning, and the run ends as an undamaged one."""
    run_dir = copy_run(two_steps, tmp_path)  # a finished `--num-rollout STEPS - 1` run
    newest = sorted((run_dir / "weights").glob("v*"))[-1]
    assert newest.name == f"v{STEPS - 1:06d}"  # what the resume's engines load before step 3
    _flip_weights_byte(newest / "model.safetensors")
    record = run_dir / "sluiceway-run.yaml"  # the run extended by a step, continued with `sluiceway resume`
    data = yaml.safe_load(record.read_text())
    data["config"]["rollout"]["num_rollout"] = STEPS
    record.write_text(yaml.safe_dump(data, sort_keys=False))
    resumed = cli(["resume", str(run_dir)], cache)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_training(run_dir, reference)  # before the fix: step 3 sampled from the damaged weights
    for v in (STEPS - 1, STEPS):  # the rebuilt version and the one trained from its samples, byte for byte
        name = f"v{v:06d}/model.safetensors"
        assert (run_dir / "weights" / name).read_bytes() == (reference / "weights" / name).read_bytes(), name
    warnings = [ln for ln in resumed.stderr.splitlines() if " WARNING " in ln and "sha256" in ln]
    assert len(warnings) == 1, resumed.stderr  # one line naming the file and what it should have been
    assert f"{newest}/model.safetensors does not match the sha256 recorded when it was written" in warnings[0]
    assert f"writing v{STEPS - 1} again from the checkpoint's weights" in warnings[0]


@pytest.mark.shared_prefect
def test_a_truncated_commit_rolled_back_by_hand_resumes(tmp_path, reference, cache):
    run_dir = copy_run(reference, tmp_path)
    _truncate_newest_commit(run_dir)
    line = one_line_error(cli(["resume", str(run_dir)], cache), 1)
    commit = line.split("newest commit ", 1)[1].split(" ", 1)[0]
    shutil.move(commit, tmp_path / "damaged.json")  # what the message says to do
    resumed = cli(["resume", str(run_dir)], cache)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    check_tables(ObjectStore.from_uri(str(run_dir / "tables")), RUN_TABLES)


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return ok.returncode == 0


def test_disk_full_is_one_line_and_resume_finishes_after_space_is_freed(tmp_path, cache, reference):
    mount = tmp_path / "small"
    if not _mount_tmpfs(mount, "6m"):
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN) on this machine")
    try:
        run_dir = mount / "run"
        failed = cli(run_args(run_dir), cache)
        line = one_line_error(failed, 1)
        assert "disk full" in line and f"sluiceway resume {run_dir}" in line, line
        # Not a warning either (Prefect's 'Failed to write result', the artifacts'): test_disk_full.py tries 4 sizes.
        assert [ln for ln in failed.stderr.splitlines() if ln.strip() and " INFO " not in ln] == [line], failed.stderr
        check_tables(ObjectStore.from_uri(str(run_dir / "tables")), RUN_TABLES)  # nothing left unreadable
        subprocess.run(["mount", "-o", "remount,size=256m", str(mount)], check=True)
        resumed = cli(["resume", str(run_dir)], cache)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert_same_training(run_dir, reference)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def open_cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ")[:200]
    except OSError:
        return b""


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_credentials_reach_no_child_process_and_no_file(tmp_path, cache):
    """Markers for every credential: the flow's process has them; its children (engines, router, Prefect's server)
    and every file the run writes (logs, tables, checkpoints, Prefect's database) never do."""
    from process_tags import process_tree

    marker = f"mark{uuid.uuid4().hex}"
    secrets = {
        "AWS_ACCESS_KEY_ID": f"AK{marker}", "AWS_SECRET_ACCESS_KEY": f"SK{marker}", "AWS_SESSION_TOKEN": f"ST{marker}",
        "WANDB_API_KEY": f"WB{marker}", "MY_RM_KEY": f"RM{marker}",
    }  # fmt: skip
    run_dir = tmp_path / "run"
    proc = start(run_args(run_dir, "--rm-api-key-env", "MY_RM_KEY"), cache, f"fault-{uuid.uuid4().hex}", secrets)
    seen: dict[int, bytes] = {}
    while proc.poll() is None:
        for pid in process_tree(proc.pid)[1:]:
            env = _environ(pid)
            if env:
                seen[pid] = env + b"\0CMDLINE " + open_cmdline(pid)
        time.sleep(0.1)
    assert proc.returncode == 0, proc.stdout.read()
    assert len(seen) >= 2, "no child process was sampled"  # at least an engine and Prefect's server
    leaked = [pid for pid, env in seen.items() if marker.encode() in env]
    names = {pid: [v[:120] for v in seen[pid].split(b"\0") if v.startswith(b"CMDLINE")] for pid in leaked}
    assert not leaked, f"children with credentials in their environment: {names}"
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert marker.encode() not in path.read_bytes(), f"a credential was written to {path}"

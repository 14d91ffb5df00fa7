"""`sluiceway weights ls | diff A B | apply VERSION --to DIR | verify VERSION`: inspect and repair a weight store.

Named after what it manages: published weight versions (full copies and deltas), not training checkpoints.
`sluiceway ckpt` is an alias kept for scripts written before the rename.

`--store` is the URI the versions live under (a local path or s3://bucket/prefix; S3 credentials come from the
AWS_* environment). Asking for something the store does not have is a user mistake (exit 2); a store that cannot
reproduce a version exactly is reported in one line naming the version and tensor (exit 1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sluiceway.infra.errors import UserError


def add_parser(sub) -> None:
    ck = sub.add_parser(
        "weights", aliases=["ckpt"], help="inspect and repair a weight store (full versions and deltas; alias: ckpt)"
    )
    cmds = ck.add_subparsers(dest="weights_command", required=True, parser_class=type(ck))
    for name, help_ in (
        ("ls", "list the stored versions"),
        ("diff", "which tensors differ between two versions"),
        ("apply", "write a version as an HF model directory, from the deltas after what DIR holds where possible"),
        ("verify", "rebuild a version from its full version and check every checksum"),
    ):
        p = cmds.add_parser(name, help=help_)
        p.add_argument("--store", required=True, help="where the versions are: a local path or s3://bucket/prefix")
        if name == "diff":
            p.add_argument("a", help="a version number, vNNNNNN, or 'latest'")
            p.add_argument("b")
        elif name in ("apply", "verify"):
            p.add_argument("version", help="a version number, vNNNNNN, or 'latest'")
        if name == "apply":
            p.add_argument("--to", required=True, help="the model directory to write (replaced when complete)")
            p.add_argument("--from", dest="from_dir", default=None,
                           help="a directory holding an earlier version (default: --to, if it holds one)")  # fmt: skip


def _open(uri: str):
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.weights.store import WeightStore

    if "://" not in uri and not Path(uri).expanduser().is_dir():
        raise UserError(f"weights: --store {uri} is not a directory")
    return WeightStore(ObjectStore.from_uri(uri))


def _version(wstore, text: str) -> int:
    if text == "latest":
        latest = wstore.latest()
        if latest is None:
            raise UserError(f"weights: {wstore.uri} holds no weight versions")
        return latest
    try:
        version = int(text.removeprefix("v"))
    except ValueError:
        raise UserError(f"weights: version {text!r} is not a number, vNNNNNN or 'latest'") from None
    if version not in wstore.versions():
        raise UserError(f"weights: {wstore.uri} has no complete version {version} (see `sluiceway weights ls`)")
    return version


def run(args: argparse.Namespace) -> int:
    from sluiceway.storage.weights.errors import WeightSyncError

    wstore = _open(args.store)
    try:
        return _COMMANDS[args.weights_command](wstore, args)
    except WeightSyncError as exc:
        print(f"error: {wstore.store.redact(str(exc))}", file=sys.stderr)
        return 1


def _ls(wstore, args) -> int:
    versions = wstore.versions()
    if not versions:
        print(f"no weight versions under {wstore.uri}")
        return 0
    print(f"{'version':9s} {'kind':5s} {'base':>7s} {'full':>7s} {'tensors':>7s} {'bytes':>12s} {'of full':>8s}  "
          "created")  # fmt: skip
    for v in versions:
        m = wstore.manifest(v)
        base = f"v{m.base_version}" if m.base_version is not None else "-"
        share = f"{m.data_size / m.raw_size:.2%}" if m.raw_size else "-"
        print(f"v{v:06d}  {m.kind:5s} {base:>7s} {'v' + str(m.full_version):>7s} {len(m.tensors):7d} "
              f"{m.data_size:12d} {share:>8s}  {m.created}")  # fmt: skip
    return 0


def _diff(wstore, args) -> int:
    a, b = (wstore.manifest(_version(wstore, x)) for x in (args.a, args.b))
    changed = [k for k in b.tensors if k in a.tensors and a.tensors[k].sha256 != b.tensors[k].sha256]
    added = [k for k in b.tensors if k not in a.tensors]
    removed = [k for k in a.tensors if k not in b.tensors]
    direct = b.kind == "delta" and b.base_version == a.version  # then the delta knows element counts and bytes
    for k in changed + added:
        e = b.tensors[k]
        line = f"{'+' if k in added else '~'} {k}  {e.dtype} {e.shape}"
        if direct:
            elements = e.nbytes // _width(e.dtype)
            line += f"  {e.changed} of {elements} elements changed, {e.encoding} {e.length} bytes"
        print(line)
    for k in removed:
        print(f"- {k}")
    print(f"v{a.version} -> v{b.version}: {len(changed)} of {len(b.tensors)} tensors changed, "
          f"{len(added)} added, {len(removed)} removed")  # fmt: skip
    return 0


def _width(dtype: str) -> int:
    from sluiceway.storage.weights.safetensors_raw import DTYPE_WIDTH

    return DTYPE_WIDTH[dtype]


def _apply(wstore, args) -> int:
    from sluiceway.storage.weights.materialize import local_version, materialize

    version = _version(wstore, args.version)
    to = Path(args.to).expanduser()
    source = Path(args.from_dir).expanduser() if args.from_dir else to
    if args.from_dir and not source.is_dir():
        raise UserError(f"weights: --from {args.from_dir} is not a directory")
    held = local_version(source)
    materialize(wstore, version, source if held is not None else None, to)
    print(f"v{version} written to {to}" + (f" (receiver held v{held})" if held is not None else ""))
    return 0


def _verify(wstore, args) -> int:
    from sluiceway.storage.weights.materialize import verify

    version = _version(wstore, args.version)
    m = verify(wstore, version)
    chain = [c.version for c in wstore.chain(version)]
    print(f"v{version} ok: {len(m.tensors)} tensors and {len(m.files)} files match the manifest "
          f"(chain {' -> '.join(f'v{c}' for c in chain)})")  # fmt: skip
    return 0


_COMMANDS = {"ls": _ls, "diff": _diff, "apply": _apply, "verify": _verify}

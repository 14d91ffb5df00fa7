"""`sluiceway tinker serve --base-model NAME`: Tinker's HTTP API on loopback (flows/tinker/, docs/tinker.md);
point a Tinker program at it with TINKER_BASE_URL=http://127.0.0.1:PORT and any TINKER_API_KEY, or with one of
--api-keys-file's keys when it has one (then only those, and each key sees only what it made)."""

from __future__ import annotations

SHUTDOWN_GRACE_S = 10


def add_parser(sub) -> None:
    tk = sub.add_parser("tinker", help="serve Tinker's API (Thinking Machines' SDK) over sluiceway's trainer")
    tsub = tk.add_subparsers(dest="tinker_command", required=True)
    s = tsub.add_parser("serve", help="run the Tinker-compatible server until interrupted")
    s.add_argument("--base-model", default="tiny-llama", help="a zoo name or a local HF model directory")
    s.add_argument("--host", default="127.0.0.1",
                   help="listen address (default loopback only; another needs --api-keys-file)")  # fmt: skip
    s.add_argument("--api-keys-file", default=None,
                   help="a file of API keys, one a line: every request must carry one (X-API-Key, the SDK's "
                        "TINKER_API_KEY) and sees only the sessions, models, states and futures made with "
                        "it")  # fmt: skip
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="token positions (datums x their longest) a forward_backward holds at once: memory against "
                        "speed (default 1024)")  # fmt: skip
    s.add_argument("--work-dir", default=".sluiceway/tinker", help="where saved sampler weights are written")
    s.add_argument("--device", default="cpu", help="the trainer's device: cpu or cuda")
    s.add_argument("--store", default=None,
                   help="where requests, samples, results and saved states are kept: a local path or "
                        "s3://bucket/prefix (default WORK_DIR/store)")  # fmt: skip
    s.add_argument("--server-id", default="tinker",
                   help="this server's name on the store; a server started again with the same store and id "
                        "answers its earlier requests and loads its saved states")  # fmt: skip


def run(args) -> int:
    import logging
    from pathlib import Path

    import uvicorn

    from sluiceway.flows.tinker.access import read_keys
    from sluiceway.flows.tinker.app import build_app
    from sluiceway.flows.tinker.model import MICRO_BATCH_TOKENS
    from sluiceway.flows.tinker.server_state import ServerState
    from sluiceway.infra.errors import UserError
    from sluiceway.infra.malloc import bound_heap_growth
    from sluiceway.models.zoo import resolve_checkpoint
    from sluiceway.storage.object_store import ObjectStore
    from sluiceway.storage.run_lock import hold

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bound_heap_growth()  # before any thread: a long-lived server's arenas otherwise only grow (infra/malloc.py)
    try:
        keys = read_keys(args.api_keys_file) if args.api_keys_file else None
    except ValueError as e:
        raise UserError(str(e)) from None
    if keys is None and not is_loopback(args.host):
        raise UserError(f"--host {args.host}: without --api-keys-file anyone who reaches the port could train, read "
                        "and delete every session's models; give keys, or serve on 127.0.0.1")  # fmt: skip
    if keys is not None and not is_loopback(args.host):
        logging.getLogger("sluiceway").warning("tinker: serving beyond loopback on %s: only requests with one of "
                                               "the %d keys are answered", args.host, len(keys))  # fmt: skip
    base_dir = resolve_checkpoint(args.base_model)
    work_dir = Path(args.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    store = ObjectStore.from_uri(args.store or str(work_dir / "store"))
    # One server per (store, server id): two would both append to its journal and overwrite its states.
    with hold(work_dir, store, f"tinker-{args.server_id}", "tinker serve"):
        state = ServerState(args.base_model, Path(base_dir), work_dir, device=args.device, store=store,
                            server_id=args.server_id, keys=keys,
                            micro_batch_tokens=args.micro_batch_tokens or MICRO_BATCH_TOKENS)  # fmt: skip
        print(f"sluiceway tinker: serving {args.base_model} on http://{args.host}:{args.port} (store {store}, "
              f"server id {args.server_id})", flush=True)  # fmt: skip
        try:
            # SIGTERM: in-flight requests get SHUTDOWN_GRACE_S, not for ever (a sample can run for minutes)
            uvicorn.run(build_app(state), host=args.host, port=args.port, log_level="warning",
                        timeout_graceful_shutdown=SHUTDOWN_GRACE_S)  # fmt: skip
        finally:
            state.close()  # the engines' and runners' threads
    return 0


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

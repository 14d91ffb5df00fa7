"""The HTTP routes of Tinker's API (SDK 0.38.0's, read from its source: tinker/resources/*.py and
tinker/lib/api_future_impl.py), on Starlette. Requests are parsed with the SDK's own pydantic types; what is
not implemented answers with an error the SDK shows, naming it (a failed future where the SDK expects a future,
else a 404 that is not retried)."""

from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import tempfile
import uuid
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tinker import types

from sluiceway.flows.tinker.access import NotAuthenticated, NotFound, caller, session_of
from sluiceway.flows.tinker.adam import check_adam
from sluiceway.flows.tinker.futures import (
    PROTOBUF,
    Result,
    SequencedRunner,
    TinkerUserError,
    not_implemented,
)
from sluiceway.flows.tinker.limits import check_sample_sizes, inflate, json_object, read_body
from sluiceway.flows.tinker.server_state import (
    MODEL_ID,
    ServerState,
    check_name,
    checkpoint_record,
    now_iso,
    parse_state_path,
    sample_rows,
    str_metadata,
)
from sluiceway.flows.tinker.wire import forward_backward_output, parse_forward_backward, sample_response
from sluiceway.storage.object_store import ObjectStore

log = logging.getLogger(__name__)

POLL_WAIT_S = 10.0  # how long retrieve_future holds a pending request before try_again (the SDK waits 45 s)

# Routes the SDK calls whose answer is a future, not implemented here: their future fails, naming the call.
FUTURE_ROUTES_NOT_IMPLEMENTED = {
    "save_weights_external": "save_weights_external",
    "unload_model": "unload_model",
    "create_custom_loss": "server-side custom losses (custom_loss_server_side is off: they run on the client)",
}


def error(status: int, message: str) -> JSONResponse:
    # x-should-retry false: the SDK's HTTP client would otherwise retry some statuses before showing the error.
    return JSONResponse({"error": message, "detail": message}, status, headers={"x-should-retry": "false"})


async def parse(request: Request, model: type) -> Any:
    body = json_object(await read_body(request), request.url.path)
    return await parse_json(request, body, model)


def future_response(rid: str, model_id: str | None = None, **extra) -> JSONResponse:
    body = types.UntypedAPIFuture(request_id=rid, model_id=model_id, **extra).model_dump(mode="json", exclude_none=True)
    return JSONResponse(body)


class TinkerApi:
    """The server's routes, one method each (the paths are `build_app`'s table), over its `ServerState`."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def owner(self, request: Request) -> str | None:
        return getattr(request.state, "owner", None)

    async def authenticate(self, request: Request, call_next) -> Response:
        """Every route but the health check needs one of the server's keys, when it has keys (access.py)."""
        if request.url.path != "/api/v1/healthz":
            try:
                request.state.owner = caller(self.state.keys, request.headers)
            except NotAuthenticated as e:
                return error(401, str(e))
        return await call_next(request)

    def submit(self, model_id: str, seq_id: int | None, fn, **info) -> str:
        """Queue `fn` on the model's runner (its seq_id order) and answer its request id at once; `info` describes
        the request for its row in the journal."""
        rid = self.state.futures.new(model_id=model_id, seq_id=seq_id, **info)
        if self.state.keys is not None:  # the model's session's key (no store read without keys)
            self.state.own(rid, (self.state.session(session_of(model_id)) or {}).get("owner"))
        self.state.last_request[model_id] = _dt.datetime.now(_dt.UTC)
        with self.state.lock:
            runner = self.state.runners.get(model_id)
        if runner is None:
            self.state.futures.finish(rid, Result(error=f"unknown model_id {model_id!r} (create it first)"))
        else:
            runner.submit(seq_id, lambda: self.state.futures.run(rid, fn))
        return rid

    def failed_future(self, exc: TinkerUserError, owner: str | None = None, **info) -> JSONResponse:
        rid = self.state.futures.new(**info)
        self.state.own(rid, owner)
        self.state.futures.finish(rid, Result(error=str(exc), category="user"))
        return future_response(rid)

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def client_config(self, request: Request) -> Response:
        # zstd on: the SDK then compresses forward_backward bodies, and this server reads them (limits.inflate).
        cfg = types.ClientConfigResponse(proto_compress_fwdbwd=True)
        return JSONResponse(cfg.model_dump(mode="json"))

    async def dynamic_config(self, request: Request) -> Response:
        return JSONResponse(types.ClientDynamicConfigResponse().model_dump(mode="json"))

    async def capabilities(self, request: Request) -> Response:
        model = {"model_name": self.state.base_model, "trainable": True, "sampleable": True}
        return JSONResponse({"supported_models": [model]})

    async def create_session(self, request: Request) -> Response:
        req = await parse(request, types.CreateSessionRequest)
        sid = f"session-{uuid.uuid4().hex[:16]}"
        self.state.save_session(sid, {"tags": req.tags, "sdk_version": req.sdk_version, "owner": self.owner(request)})
        return JSONResponse(types.CreateSessionResponse(session_id=sid).model_dump(mode="json"))

    async def heartbeat(self, request: Request) -> Response:
        req = await parse(request, types.SessionHeartbeatRequest)
        self.state.check_owner(self.owner(request), req.session_id, "session")
        if self.state.session(req.session_id) is None:
            return error(404, f"unknown session {req.session_id!r}")
        if "finished" in self.state.sessions[req.session_id]:
            return error(410, f"session {req.session_id!r} has finished")  # the SDK stops its heartbeat on 410
        return JSONResponse(types.SessionHeartbeatResponse().model_dump(mode="json"))

    async def finish_session(self, request: Request) -> Response:
        """ServiceClient.close(status): the session ends (first reason wins) and its models are let go."""
        sid = request.path_params["session_id"]
        self.state.check_owner(self.owner(request), sid, "session")
        session = self.state.session(sid)
        if session is None:
            return error(404, f"unknown session {sid!r}")
        body = json_object(await read_body(request), request.url.path)
        reason = body.get("reason")
        if "finished" not in session:
            self.state.save_session(
                sid, {**session, "finished": reason.get("type") if isinstance(reason, dict) else None}
            )
        with self.state.lock:
            for model_id in [m for m in self.state.runners if m.startswith(f"{sid}:")]:
                self.state.runners.pop(model_id).stop()
                self.state.models.pop(model_id, None)
        return JSONResponse({})

    async def create_model(self, request: Request) -> Response:
        from sluiceway.flows.tinker.model import TinkerModel

        req = await parse(request, types.CreateModelRequest)
        self.state.check_owner(self.owner(request), req.session_id, "session")
        if self.state.session(req.session_id) is None:
            raise TinkerUserError(f"unknown session {req.session_id!r}")
        if not self.state.matches_base(req.base_model):
            raise TinkerUserError(
                f"base_model {req.base_model!r}: this server serves {self.state.base_model!r} (sluiceway tinker serve "
                "--base-model); one base model per server in this version"
            )
        if req.optimizer_config.type != "adamw":
            raise not_implemented(f"the optimizer {req.optimizer_config.type!r} (only adamw)")
        lora = req.lora_config
        if lora is not None and not (lora.train_mlp and lora.train_attn and lora.train_unembed):
            raise not_implemented("LoRA on part of the layers (train_mlp/train_attn/train_unembed all True only)")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"  # the id the SDK itself derives
        with self.state.lock:
            if model_id in self.state.runners:
                raise TinkerUserError(f"model {model_id!r} exists already")
            self.state.runners[model_id] = SequencedRunner(model_id)

        def build() -> Result:
            rank = 0 if lora is None else lora.rank
            m = TinkerModel(model_id, self.state.base_dir, rank, None if lora is None else lora.seed, self.state.device)
            m.micro_batch_tokens = self.state.micro_batch_tokens
            self.state.models[model_id] = m
            self.state.update_training_run(model_id, base_model=req.base_model or self.state.base_model, lora_rank=rank,
                                      user_metadata=str_metadata(req.user_metadata), created_at=now_iso())  # fmt: skip
            log.info("tinker: created %s (%s)", model_id, f"LoRA rank {rank}" if rank else "full weights")
            return Result(json=types.CreateModelResponse(model_id=model_id).model_dump(mode="json"))

        return future_response(self.submit(model_id, None, build, type="create_model"), model_id)

    async def get_info(self, request: Request) -> Response:
        req = await parse(request, types.GetInfoRequest)
        self.state.check_owner(self.owner(request), req.model_id, "model_id")
        m = self.state.model(req.model_id)
        # The tokenizer is named by the local directory, so the SDK's get_tokenizer loads it offline; model_name
        # too, because a sampling client made by save_weights_and_get_sampling_client loads from the model name.
        data = types.ModelData(arch="llama", model_name=str(self.state.base_dir), tokenizer_id=str(self.state.base_dir))
        info = types.GetInfoResponse(type="get_info", model_data=data, model_id=req.model_id,
                                     is_lora=m.lora_rank > 0, lora_rank=m.lora_rank or None,
                                     model_name=str(self.state.base_dir))  # fmt: skip
        return JSONResponse(info.model_dump(mode="json", exclude_none=True))

    async def forward_backward(self, request: Request) -> Response:
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise TinkerUserError("forward_backward takes a protobuf body (tinker>=0.25); this SDK sent JSON")
        body = inflate(await read_body(request), request.headers.get("content-encoding"))
        req = parse_forward_backward(body)
        self.state.check_owner(self.owner(request), req.model_id, "model_id")
        m = self.state.model(req.model_id)

        def run() -> Result:
            outputs, metrics = m.forward_backward(req.data, req.loss_fn, req.loss_fn_config, req.forward_only)
            return Result(proto=forward_backward_output(outputs, metrics), summary={"metrics": metrics})

        info = {"type": "forward" if req.forward_only else "forward_backward", "loss_fn": req.loss_fn,
                "loss_fn_config": req.loss_fn_config or None, "num_datums": len(req.data),
                "num_tokens": sum(len(d.tokens) for d in req.data)}  # fmt: skip
        return future_response(self.submit(req.model_id, req.seq_id, run, **info), req.model_id)

    async def optim_step(self, request: Request) -> Response:
        req = await parse(request, types.OptimStepRequest)
        self.state.check_owner(self.owner(request), req.model_id, "model_id")
        m = self.state.model(req.model_id)
        if not isinstance(req.optim_params, types.AdamParams):
            raise not_implemented(f"optimizer parameters of type {getattr(req.optim_params, 'type', '?')!r}")
        params = req.optim_params.model_dump()
        check_adam(params)  # a 400 now, before the request is queued

        def run() -> Result:
            metrics = m.optim_step(params)
            return Result(json=types.OptimStepResponse(metrics=metrics).model_dump(mode="json"),
                          summary={"metrics": metrics})  # fmt: skip

        return future_response(self.submit(req.model_id, req.seq_id, run, type="optim_step"), req.model_id)

    async def save_for_sampler(self, request: Request) -> Response:
        req = await parse(request, types.SaveWeightsForSamplerRequest)
        self.state.check_owner(self.owner(request), req.model_id, "model_id")
        m = self.state.model(req.model_id)
        if req.path is not None:
            check_name(req.path)  # it becomes part of a tinker:// path and a file name on the store

        def run() -> Result:
            path = m.save_for_sampler(self.state.work_dir / "sampler_weights" / req.model_id.replace(":", "_"))
            out: dict[str, Any] = {"type": "save_weights_for_sampler"}
            if req.path is not None:  # a named save: a tinker:// path any client may sample from
                tinker_path = f"tinker://{req.model_id}/sampler_weights/{req.path}"
                self.state.save_sampler_dir(tinker_path, path)
                self.state.update_training_run(req.model_id, last_sampler_checkpoint=checkpoint_record(
                    tinker_path, req.user_metadata))  # fmt: skip
                out["path"] = tinker_path
            else:  # save_weights_and_get_sampling_client: a sampling session on these weights
                sid = f"sampler-{uuid.uuid4().hex[:16]}"
                self.state.sampling_sessions[sid] = (path, None)
                out["sampling_session_id"] = sid
            return Result(json=out)

        return future_response(
            self.submit(req.model_id, req.seq_id, run, type="save_weights_for_sampler"), req.model_id
        )

    def need_store(self, what: str) -> ObjectStore:
        if self.state.store is None:
            raise TinkerUserError(f"{what} needs a store: start the server with --store")
        return self.state.store

    async def save_weights(self, request: Request) -> Response:
        """save_state: the trainer's checkpoint (weights and Adam's state) on the store, under
        tinker/<server_id>/weights/<model_id>/<name>/; answers its tinker://<model_id>/weights/<name> path."""
        from sluiceway.storage.tinker import state_info, upload_state

        req = await parse(request, types.SaveWeightsRequest)
        self.state.check_owner(self.owner(request), req.model_id, "model_id")
        m = self.state.model(req.model_id)
        store = self.need_store("save_state")
        name = req.path or f"state-{uuid.uuid4().hex[:12]}"
        check_name(name)

        def run() -> Result:
            if not req.overwrite and state_info(store, self.state.server_id, req.model_id, name) is not None:
                raise TinkerUserError(f"a state named {name!r} was saved already for {req.model_id}; give another "
                                      "name or overwrite=True")  # fmt: skip
            with tempfile.TemporaryDirectory(dir=self.state.work_dir) as tmp:
                local = Path(tmp) / "state"
                m.save_state(local)
                info = {"base_model": self.state.base_model, "base_dir": str(self.state.base_dir),
                        "lora_rank": m.lora_rank, "seed": m.seed, "steps": m.steps, "model_id": req.model_id,
                        "optimizer": "adamw", "user_metadata": req.user_metadata}  # fmt: skip
                upload_state(store, self.state.server_id, req.model_id, name, local, info)
            path = f"tinker://{req.model_id}/weights/{name}"
            self.state.update_training_run(req.model_id, last_checkpoint=checkpoint_record(path, req.user_metadata))
            log.info("tinker: saved %s (step %d)", path, m.steps)
            return Result(json=types.SaveWeightsResponse(path=path, type="save_weights").model_dump(mode="json"))

        return future_response(self.submit(req.model_id, req.seq_id, run, type="save_weights"), req.model_id)

    async def load_weights(self, request: Request) -> Response:
        """load_state / load_state_with_optimizer on an existing model (model_id + seq_id), or
        create_training_client_from_state(_with_optimizer): a new model made from the saved state (session_id +
        model_seq_id; its LoRA rank and base model are the checkpoint's)."""
        from sluiceway.flows.tinker.model import TinkerModel
        from sluiceway.storage.tinker import DamagedRecord, download_state, state_info

        req = await parse(request, types.LoadWeightsRequest)
        store = self.need_store("load_state")
        src_model, name = parse_state_path(req.path)
        self.state.check_owner(self.owner(request), src_model, "state")
        self.state.check_owner(self.owner(request), req.session_id or req.model_id or "", "session or model_id")
        if req.session_id is not None:  # create-via-load: the load is the new model's first request
            if self.state.session(req.session_id) is None:
                raise TinkerUserError(f"unknown session {req.session_id!r}")
            if not self.state.matches_base(req.base_model):
                raise TinkerUserError(f"base_model {req.base_model!r}: this server serves {self.state.base_model!r}")
            if req.optimizer_config is not None and req.optimizer_config.type != "adamw":
                raise not_implemented(f"the optimizer {req.optimizer_config.type!r} (only adamw)")
            model_id = f"{req.session_id}:train:{req.model_seq_id}"
            with self.state.lock:
                if model_id in self.state.runners:
                    raise TinkerUserError(f"model {model_id!r} exists already")
                self.state.runners[model_id] = SequencedRunner(model_id)
        else:
            if req.model_id is None:
                raise TinkerUserError("load_weights needs model_id or session_id")
            model_id = req.model_id
            self.state.model(model_id)

        def run() -> Result:
            try:
                return load(state_info(store, self.state.server_id, src_model, name))
            except DamagedRecord as e:  # its tinker:// path and place on the store, not a JSON error or a tmp dir
                raise TinkerUserError(str(e)) from None

        def load(info: dict | None) -> Result:
            if info is None:
                raise TinkerUserError(f"{req.path}: no state saved under this name on this server's store "
                                      f"({self.state.server_id})")  # fmt: skip
            if not (self.state.matches_base(info["base_model"]) or info.get("base_dir") == str(self.state.base_dir)):
                raise TinkerUserError(f"{req.path} was trained on {info['base_model']!r}; this server serves "
                                      f"{self.state.base_model!r}")  # fmt: skip
            m = self.state.models.get(model_id)
            if m is not None and m.lora_rank != info["lora_rank"]:
                raise TinkerUserError(f"{req.path} has LoRA rank {info['lora_rank']}; this model has {m.lora_rank}")
            with tempfile.TemporaryDirectory(dir=self.state.work_dir) as tmp:
                local = Path(tmp) / "state"
                download_state(store, self.state.server_id, src_model, name, local)
                created = m is None
                if created:
                    m = TinkerModel(
                        model_id, self.state.base_dir, info["lora_rank"], info.get("seed"), self.state.device
                    )
                    m.micro_batch_tokens = self.state.micro_batch_tokens
                m.load_state(local, req.optimizer)
            self.state.models[model_id] = m
            if created:  # a training run of its own, made from the state (as create_model makes one)
                self.state.update_training_run(model_id, base_model=req.base_model or info["base_model"],
                                          lora_rank=info["lora_rank"], user_metadata=str_metadata(req.user_metadata),
                                          created_at=now_iso(), loaded_from=req.path)  # fmt: skip
            log.info("tinker: loaded %s into %s (step %d, optimizer %s)", req.path, model_id, m.steps, req.optimizer)
            body = types.LoadWeightsResponse(path=req.path, model_id=model_id, type="load_weights")
            return Result(json=body.model_dump(mode="json", exclude_none=True))

        seq = req.seq_id if req.session_id is None else None
        return future_response(self.submit(model_id, seq, run, type="load_weights"), model_id)

    async def create_sampling_session(self, request: Request) -> Response:
        req = await parse(request, types.CreateSamplingSessionRequest)
        self.state.check_owner(self.owner(request), req.session_id, "session")
        if req.model_path is not None:
            self.state.check_owner(self.owner(request), req.model_path, "model_path")
            path = self.state.sampler_dir(req.model_path)
        elif self.state.matches_base(req.base_model):
            path = self.state.base_dir
        else:
            raise TinkerUserError(f"base_model {req.base_model!r}: this server serves {self.state.base_model!r}")
        sid = f"sampler-{uuid.uuid4().hex[:16]}"
        self.state.sampling_sessions[sid] = (path, req.model_path)
        self.state.own(sid, self.owner(request))
        return JSONResponse(types.CreateSamplingSessionResponse(sampling_session_id=sid).model_dump(mode="json"))

    async def get_sampler(self, request: Request) -> Response:
        sid = request.path_params["sampler_id"]
        self.state.check_item(self.owner(request), sid, "sampler")
        if sid not in self.state.sampling_sessions:
            return error(404, f"unknown sampler {sid!r}")
        _, model_path = self.state.sampling_sessions[sid]
        # base_model is the local directory: the SDK's SamplingClient.get_tokenizer loads it by this name.
        body = types.GetSamplerResponse(sampler_id=sid, base_model=str(self.state.base_dir), model_path=model_path)
        return JSONResponse(body.model_dump(mode="json", exclude_none=True))

    async def asample(self, request: Request) -> Response:
        body = json_object(await read_body(request), request.url.path)
        req = await parse_json(request, body, types.SampleRequest)
        check_sample_sizes(req.num_samples, req.sampling_params.max_tokens if req.sampling_params else None)
        if req.sampling_session_id is not None:
            self.state.check_item(self.owner(request), req.sampling_session_id, "sampling_session_id")
            if req.sampling_session_id not in self.state.sampling_sessions:
                raise TinkerUserError(f"unknown sampling_session_id {req.sampling_session_id!r}")
            model_dir, sampler_path = self.state.sampling_sessions[req.sampling_session_id]
        elif req.model_path is not None:
            self.state.check_owner(self.owner(request), req.model_path, "model_path")
            model_dir, sampler_path = self.state.sampler_dir(req.model_path), req.model_path
        elif self.state.matches_base(req.base_model):
            model_dir, sampler_path = self.state.base_dir, None
        else:
            raise TinkerUserError(f"base_model {req.base_model!r}: this server serves {self.state.base_model!r}")
        prompt_len = req.prompt.length if req.prompt is not None else 0
        rid = self.state.futures.new(type="asample", num_datums=req.num_samples)
        self.state.own(rid, self.owner(request))

        def run() -> Result:
            seqs, prompt_lps = self.state.samplers.sample(model_dir, body)
            where = sampler_path or (self.state.base_model if model_dir == self.state.base_dir else str(model_dir))
            rows = sample_rows(rid, body, seqs, req.sampling_session_id, where)
            summary = {"num_tokens": prompt_len + sum(len(s.tokens) for s in seqs)}
            return Result(proto=sample_response(seqs, prompt_lps), summary=summary, samples=rows)

        self.state.pool.submit(self.state.futures.run, rid, run)
        ids = [f"{rid}:{i}" for i in range(req.num_samples)]
        return future_response(rid, sample_sequence_ids=ids)

    async def retrieve_future(self, request: Request) -> Response:
        req = await parse(request, types.FutureRetrieveRequest)
        self.state.check_item(self.owner(request), req.request_id, "request_id")
        if not self.state.futures.known(req.request_id):
            # 404 is final for the SDK. With a store, a request finished before a restart is known (its result
            # was written before it was answered); one still running when the server died is not.
            return error(404, f"unknown request_id {req.request_id!r}")
        result = await asyncio.to_thread(self.state.futures.wait, req.request_id, POLL_WAIT_S)
        if result is None:
            return JSONResponse({"type": "try_again", "request_id": req.request_id, "queue_state": "active"})
        body = result.body()
        if isinstance(body, bytes):
            return Response(body, media_type=PROTOBUF)
        return JSONResponse(body)

    async def get_training_run(self, request: Request) -> Response:
        """RestClient.get_training_run(_by_tinker_path): the cookbook reads the renderer name its recipes put in
        the user_metadata of create_model back from here before it resumes or loads a checkpoint."""
        run_id = request.path_params["run_id"]
        try:
            self.state.check_owner(self.owner(request), run_id, "training run")
        except NotFound as e:
            return error(404, str(e))
        record = await asyncio.to_thread(self.state.training_run, run_id)
        if record is None:
            return error(404, f"unknown training run {run_id!r} (a model id of this server)")
        updated = _dt.datetime.fromisoformat(record["updated_at"])
        rank = int(record.get("lora_rank") or 0)
        body = types.TrainingRun(
            training_run_id=run_id,
            base_model=record.get("base_model") or self.state.base_model,
            model_owner="local",  # keys, when the server has them, are not accounts: no owner name to give
            is_lora=rank > 0,
            lora_rank=rank or None,
            last_request_time=max(updated, self.state.last_request.get(run_id, updated)),
            last_checkpoint=record.get("last_checkpoint"),
            last_sampler_checkpoint=record.get("last_sampler_checkpoint"),
            user_metadata=record.get("user_metadata"),
        )
        return JSONResponse(body.model_dump(mode="json"))

    async def delete_checkpoint(self, request: Request) -> Response:
        """RestClient.delete_checkpoint(_from_tinker_path): a saved state leaves the store, a sampler path its
        directory (the cookbook's rolling checkpoints delete the one before). A request row either way."""
        from sluiceway.storage.tinker import delete_state

        run_id, kind, name = (request.path_params[k] for k in ("run_id", "kind", "name"))
        tinker_path = f"tinker://{run_id}/{kind}/{name}"
        try:
            self.state.check_owner(self.owner(request), run_id, "training run")
        except NotFound as e:
            return error(404, str(e))

        def run() -> Result:
            if kind == "weights":
                model_id, state_name = parse_state_path(tinker_path)
                if not delete_state(self.need_store("delete_checkpoint"), self.state.server_id, model_id, state_name):
                    raise TinkerUserError(f"no checkpoint {tinker_path} on this server's store")
            elif kind != "sampler_weights" or not self.state.delete_sampler_dir(tinker_path):
                raise TinkerUserError(f"no checkpoint {tinker_path} on this server")
            record = self.state.training_run(run_id) or {}
            for key in ("last_checkpoint", "last_sampler_checkpoint"):
                if (record.get(key) or {}).get("tinker_path") == tinker_path:
                    self.state.update_training_run(run_id, **{key: None})
            log.info("tinker: deleted %s", tinker_path)
            return Result(json={})

        rid = self.state.futures.new(type="delete_checkpoint", model_id=run_id if MODEL_ID.match(run_id) else None)
        await asyncio.to_thread(self.state.futures.run, rid, run)
        result = self.state.futures.wait(rid, 0)
        if result.error is not None:
            return error(404 if result.category == "user" else 500, result.error)
        return JSONResponse({})

    def not_implemented_future(self, route: str, what: str):
        async def handler(request: Request) -> Response:
            try:
                body = json_object(await read_body(request), request.url.path)
            except TinkerUserError as e:
                return error(getattr(e, "status", 400), str(e))
            model_id, seq_id = body.get("model_id"), body.get("seq_id")
            if not isinstance(model_id, str | None) or not isinstance(seq_id, int | None):
                return error(400, f"{request.url.path}: model_id must be a string and seq_id an integer")
            mine = model_id is None or self.state.keys is None or (self.state.session(session_of(model_id)) or {}).get(
                "owner") == self.owner(request)  # fmt: skip
            if mine and model_id in self.state.runners and seq_id is not None:
                # Through the model's runner, so its seq_id counts as done and the next request does not wait.
                fail = lambda: (_ for _ in ()).throw(not_implemented(what))  # noqa: E731
                return future_response(self.submit(model_id, seq_id, fail, type=route))
            return self.failed_future(not_implemented(what), self.owner(request), type=route,
                                      model_id=model_id if mine else None, seq_id=seq_id)  # fmt: skip

        return handler

    async def fallback(self, request: Request) -> Response:
        return error(404, f"sluiceway's Tinker server does not implement {request.method} {request.url.path} yet "
                          "(docs/tinker.md lists what it does)")  # fmt: skip

    def guarded(self, fn):
        """A user's mistake raised while parsing answers 400 with its message (the SDK shows it, no retry); with a
        store it is a request row too (status error, its request_id one of its own that nobody polls)."""

        async def handler(request: Request) -> Response:
            try:
                return await fn(request)
            except TinkerUserError as e:
                if self.state.futures.journal is not None:
                    rid = self.state.futures.new(type=request.url.path.rsplit("/", 1)[-1])
                    await asyncio.to_thread(self.state.futures.finish, rid, Result(error=str(e), category="user"))
                return error(getattr(e, "status", 400), str(e))

        return handler


def build_app(state: ServerState) -> Starlette:
    api = TinkerApi(state)
    post = {
        "client/config": api.client_config,
        "client/dynamic_config": api.dynamic_config,
        "create_session": api.create_session,
        "session_heartbeat": api.heartbeat,
        "create_model": api.create_model,
        "get_info": api.get_info,
        "forward_backward": api.forward_backward,
        "optim_step": api.optim_step,
        "save_weights_for_sampler": api.save_for_sampler,
        "save_weights": api.save_weights,
        "load_weights": api.load_weights,
        "create_sampling_session": api.create_sampling_session,
        "asample": api.asample,
        "retrieve_future": api.retrieve_future,
    }
    routes = [Route(f"/api/v1/{p}", api.guarded(fn), methods=["POST"]) for p, fn in post.items()]
    routes += [Route(f"/api/v1/{p}", api.not_implemented_future(p, what), methods=["POST"])
               for p, what in FUTURE_ROUTES_NOT_IMPLEMENTED.items()]  # fmt: skip
    routes += [
        Route("/api/v1/healthz", api.healthz, methods=["GET"]),
        Route("/api/v1/get_server_capabilities", api.capabilities, methods=["GET"]),
        Route("/api/v1/samplers/{sampler_id}", api.guarded(api.get_sampler), methods=["GET"]),
        Route("/api/v1/sessions/{session_id}/finish", api.guarded(api.finish_session), methods=["POST"]),
        Route("/api/v1/training_runs/{run_id}", api.get_training_run, methods=["GET"]),
        Route("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}", api.delete_checkpoint, methods=["DELETE"]),
        Route("/{rest:path}", api.fallback, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ]
    return Starlette(routes=routes, middleware=[Middleware(BaseHTTPMiddleware, dispatch=api.authenticate)])


async def parse_json(request: Request, body: dict, model: type) -> Any:
    try:
        return model.model_validate(body)
    except Exception as e:  # noqa: BLE001
        raise TinkerUserError(f"{request.url.path}: the body is not a valid {model.__name__}: {e}") from e

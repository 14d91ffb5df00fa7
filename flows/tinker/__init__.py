"""A Tinker-compatible HTTP server (Thinking Machines' SDK, `tinker==0.38.0`) over sluiceway's trainer and engine.

`sluiceway tinker serve --base-model NAME` (flows/cli/tinker.py) starts it; a Tinker program pointed at it with
TINKER_BASE_URL runs unchanged (docs/tinker.md says what is implemented). The wire types come from the pinned
`tinker` package itself, never copied, so a change of the SDK's format fails here loudly rather than drifting:

- `futures.py`: request ids, results kept for `retrieve_future`, per-model ordering by sequence id (pure logic).
- `wire.py`: the protobuf/zstd bodies the SDK sends and the protobuf results it accepts.
- `adam.py`: the bounds of AdamParams, checked as a request comes in and as its step runs.
- `model.py`: one training client's model: forward/backward with Tinker's losses and Adam steps on PolicyTrainer.
- `sampler.py`: embedded engines serving saved sampler weights (sample, prompt log-probs).
- `app.py`: the Starlette app (routes, sessions, heartbeats) that ties them together.
"""

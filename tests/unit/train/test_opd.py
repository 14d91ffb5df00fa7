"""On-policy distillation: the advantage term by hand, the engine's input-token scoring against its own sampling
log-probs and the trainer's, and the megatron-mode teacher in the trainer (tasks/train/opd.py)."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from trainer_helpers import make_trainer

from sluiceway.models.engine import Engine, GenerateRequest, SamplingParams
from sluiceway.models.engine.server import build_app
from sluiceway.tasks.train.collation import collate
from sluiceway.tasks.train.opd import micro_batch_opd, opd_advantages
from sluiceway.tasks.train.samples import TrainSample

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def test_opd_advantages_by_hand():
    # Two samples, three positions; the last position of sample 1 is not trained (mask 0).
    adv = torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, -1.0]])
    student = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -4.0]])
    teacher = torch.tensor([[-2.0, -1.0, -0.5], [-1.0, -0.1, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    new, kl = opd_advantages(adv, student, teacher, mask, kl_coef=0.5)
    # kl = student - teacher on trained tokens: [[1, -1, 0], [-2, 0, 0 (masked: -4 - -9 = 5 not counted)]]
    assert kl.tolist() == [[1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]]
    # A' = A - 0.5 * kl: [[0.5 - 0.5, 0.5 + 0.5, 0.5], [-1 + 1, -1, -1 (untouched)]]
    assert new.tolist() == [[0.0, 1.0, 0.5], [0.0, -1.0, -1.0]]
    # Pure distillation (A = 0, coefficient 1): A' = teacher - student, the token's log-ratio.
    pure, _ = opd_advantages(torch.zeros(2, 3), student, teacher, mask, kl_coef=1.0)
    assert pure.tolist() == [[-1.0, 1.0, 0.0], [2.0, 0.0, 0.0]]


def test_micro_batch_uses_stored_teacher_logprobs_in_its_layout():
    # Prompt [5, 6] and response [7, 8]: position t predicts token t+1, so the response's log-probs sit at 1 and 2.
    s = TrainSample([5, 6], [7, 8], [1, 1], 0.25, rollout_logprobs=[-1.0, -1.0], teacher_logprobs=[-0.5, -3.0])
    mb = collate([s], pad_id=0)
    assert mb.teacher_logprobs.tolist() == [[0.0, -0.5, -3.0]]
    student = torch.tensor([[0.0, -1.5, -1.0]])
    adv, kl = micro_batch_opd(mb, student, kl_coef=2.0)
    # kl = [0, -1.5 + 0.5, -1 + 3] = [0, -1, 2];  A' = 0.25 - 2 * kl on the response: [0, 2.25, -3.75]
    assert kl.tolist() == [[0.0, -1.0, 2.0]]
    assert adv.tolist() == [[0.0, 2.25, -3.75]]
    no_teacher = collate([TrainSample([5, 6], [7], [1], 0.0, [-1.0])], pad_id=0)
    assert no_teacher.teacher_logprobs is None
    with pytest.raises(RuntimeError, match="no teacher log-probs"):
        micro_batch_opd(no_teacher, torch.zeros(1, 2), 1.0)


def test_engine_scores_given_tokens_as_it_samples_and_as_the_trainer_computes(tiny):
    path, tok = tiny
    engine = Engine(path, max_running_requests=4, max_total_len=128, seed=0)
    try:
        prompt = tok("What is 3 + 4?")["input_ids"]
        sp = SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=5, ignore_eos=True)
        out = engine.generate([GenerateRequest(prompt, sp)])[0]
        ids = prompt + out.output_ids
        scored = engine.score(ids, len(prompt))  # the response span's log-probs
        assert engine.score(ids, 0)[0] is None and len(engine.score(ids, 0)) == len(ids)
        # The same numbers the engine sampled with (temperature 1: the unscaled distribution).
        assert torch.allclose(torch.tensor(scored), torch.tensor(out.output_logprobs), atol=1e-5)
        # ... and the trainer's log-probs of the same tokens (megatron-core, fp32).
        trainer = make_trainer(path, tok)
        mb = collate([TrainSample(prompt, out.output_ids, [1] * 12, 0.0, out.output_logprobs)], tok.pad_token_id)
        with torch.no_grad():
            lp = trainer._logprobs(trainer.model, mb, temperature=1.0)[0]
        trained = lp[0, len(prompt) - 1 : len(ids) - 1]
        assert torch.allclose(trained, torch.tensor(scored), atol=1e-4), (trained, scored)
        # Over HTTP, SGLang's shape: max_new_tokens 0 generates nothing; input_token_logprobs from logprob_start_len.
        http = TestClient(build_app(engine))
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
        r = http.post("/generate", json=body | {"logprob_start_len": 0}).json()
        assert r["output_ids"] == [] and r["meta_info"]["finish_reason"]["type"] == "length"
        pairs = r["meta_info"]["input_token_logprobs"]
        assert [p[1] for p in pairs] == ids and pairs[0][0] is None
        assert torch.allclose(torch.tensor([p[0] for p in pairs[len(prompt):]]), torch.tensor(scored), atol=1e-6)
        start = http.post("/generate", json=body | {"logprob_start_len": len(prompt)}).json()
        assert [p[1] for p in start["meta_info"]["input_token_logprobs"]] == out.output_ids
        assert http.post("/generate", json=body | {"logprob_start_len": len(ids)}).status_code == 400
        assert engine.load()["scored_requests"] >= 5
    finally:
        engine.shutdown()


def test_megatron_teacher_equal_to_the_student_adds_nothing(tiny):
    path, tok = tiny
    kw = dict(use_opd=True, opd_type="megatron", opd_teacher_load=str(path), opd_kl_coef=1.0)
    trainer = make_trainer(path, tok, **kw)
    samples = [TrainSample(tok("What is 1 + 1?")["input_ids"], [10 + i, 20 + i, 30], [1, 1, 1], 0.0, [-1.0] * 3)
               for i in range(4)]  # fmt: skip
    m = trainer.train_rollout(samples, 0)
    # Teacher = student (and temperature 1): the reverse KL of every token is 0, so are the advantages: no update.
    assert abs(m["opd/reverse_kl"]) < 1e-5 and abs(m["loss"]) < 1e-6
    # A teacher with other weights: its log-probs differ, the KL is not 0 and the policy moves.
    teacher_sd = {k: v * 3 for k, v in trainer.opd.teacher_model.state_dict().items() if "embedding" in k}
    trainer.opd.teacher_model.load_state_dict(teacher_sd, strict=False)
    m2 = trainer.train_rollout(samples, 1)
    assert abs(m2["opd/reverse_kl"]) > 1e-3 and m2["grad_norm"] > 0


def test_client_keeps_the_scored_tail_and_refuses_other_tokens():
    import asyncio
    import json

    import httpx

    from sluiceway.tasks.rollout.client import EngineCallError, EngineClient

    def answer(request):  # host a: no entry for position 0 (some servers omit it); host b: other token ids
        ids = json.loads(request.content)["input_ids"]
        pairs = [[-0.5 * i, t, None] for i, t in enumerate(ids)][1:] if request.url.host == "a" else [[-1.0, 9, None]]
        return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": {"input_token_logprobs": pairs}})

    async def score(host):
        client = EngineClient(f"http://{host}", [])
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        try:
            return await client.score([5, 6, 7, 8], 2, "rid")
        finally:
            await client.aclose()

    assert asyncio.run(score("a")) == [-1.0, -1.5]  # tokens 7 and 8
    with pytest.raises(EngineCallError, match="did not score the 2 tokens from position 2"):
        asyncio.run(score("b"))

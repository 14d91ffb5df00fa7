"""Storage layer against a local directory and a real S3 server (SeaweedFS): datasets, idempotent appends,
trajectories, rewards, metrics, and reading the tables with other tools."""

from __future__ import annotations

import json

import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from storage_helpers import batch, sample_row

from sluiceway.infra.errors import UserError
from sluiceway.storage.datasets import DATASET_SCHEMA, import_prompts, import_records, load_prompts
from sluiceway.storage.metrics import append_metrics, metrics_frame, read_metrics
from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.tables import (
    append_idempotent,
    open_table,
    read_table,
    table_exists,
    table_version,
)
from sluiceway.storage.trajectories import (
    TRAJECTORIES,
    TRAJECTORY_SCHEMA,
    append_trajectories,
    existing_group_ids,
    read_trajectories,
    set_rewards,
)

# -- helpers ---------------------------------------------------------------------------------------------------


def write_jsonl(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# -- ObjectStore -----------------------------------------------------------------------------------------------


def test_local_store_is_absolute_and_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = ObjectStore.from_uri("runs/store")
    assert not store.is_s3
    assert store.root == str(tmp_path / "runs" / "store")
    assert (tmp_path / "runs" / "store").is_dir()
    assert store.table_uri("trajectories") == f"{store.root}/trajectories"
    assert store.join("ckpt", "v1/", "/a.bin") == f"{store.root}/ckpt/v1/a.bin"
    assert dict(store.storage_options) == {}
    with pytest.raises(ValueError):
        store.join("..", "etc")


def test_s3_store_settings_and_secrets_redacted(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDSECRETVALUE1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "topsecretkey/xyz")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    store = ObjectStore.from_uri("s3://bucket/some/prefix/")
    assert store.is_s3 and store.root == "s3://bucket/some/prefix"
    assert store.table_uri("metrics") == "s3://bucket/some/prefix/metrics"
    opts = store.storage_options
    assert opts["AWS_ALLOW_HTTP"] == "true" and opts["AWS_REGION"] == "us-east-1"
    assert opts["AWS_SECRET_ACCESS_KEY"] == "topsecretkey/xyz"  # deltalake gets the real value...
    for shown in (repr(store), str(store), repr(opts), str(opts), f"{store}", str([store])):
        assert "topsecretkey" not in shown and "AKIDSECRETVALUE1" not in shown  # ...nothing that prints does
    assert store.redact("denied for AKIDSECRETVALUE1 / topsecretkey/xyz") == "denied for *** / ***"
    with pytest.raises(RuntimeError) as info, store.redacting():
        raise RuntimeError("request signed with topsecretkey/xyz failed")
    assert "topsecretkey" not in str(info.value)
    # Args win over the environment.
    other = ObjectStore.from_uri("s3://b2", endpoint_url="https://s3.example.com", region="eu-west-1")
    assert other.endpoint_url == "https://s3.example.com" and "AWS_ALLOW_HTTP" not in other.storage_options
    assert other.storage_options["AWS_REGION"] == "eu-west-1"


def test_s3_store_without_credentials_is_a_user_error(monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(UserError) as info:
        ObjectStore.from_uri("s3://bucket/prefix")
    message = str(info.value)
    assert "\n" not in message and "AWS_ACCESS_KEY_ID" in message and "AWS_SECRET_ACCESS_KEY" in message


# -- datasets --------------------------------------------------------------------------------------------------


def test_import_jsonl_text_prompts_is_idempotent(store, tmp_path):
    path = write_jsonl(
        tmp_path / "arith.jsonl",
        [
            json.dumps({"input": "1 + 1 = ?", "label": 2, "metadata": {"level": 1}}),
            "",  # blank lines are skipped, not errors
            json.dumps({"input": "2 + 3 = ?", "label": "5", "extra": "ignored as in slime"}),
            json.dumps({"input": "Is 7 prime?", "label": True}),
        ],
    )
    info = import_prompts(path, store, "prompts")
    assert (info.name, info.rows, info.version, info.added) == ("prompts", 3, 0, True)
    rows = load_prompts(store, "prompts")
    assert [r["prompt"] for r in rows] == ["1 + 1 = ?", "2 + 3 = ?", "Is 7 prime?"]
    assert [r["label"] for r in rows] == ["2", "5", "true"]
    assert [r["prompt_id"] for r in rows] == ["arith:1", "arith:3", "arith:4"]  # file stem : line
    assert [r["row_index"] for r in rows] == [0, 1, 2]
    assert rows[0]["metadata"] == {"level": 1} and rows[1]["metadata"] == {}
    assert rows[0]["messages"] is None and rows[0]["source"].endswith("arith.jsonl")
    assert pa.schema(open_table(store, "prompts").schema().to_arrow()).equals(DATASET_SCHEMA)

    again = import_prompts(path, store, "prompts")  # same content: nothing added
    assert (again.rows, again.version, again.added) == (3, 0, False)
    assert read_table(store, "prompts").num_rows == 3


def test_import_jsonl_chat_messages(store, tmp_path):
    chat = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "3 + 4?"}]
    path = write_jsonl(tmp_path / "chat.json", [json.dumps({"q": chat, "answer": 7.5})])
    info = import_prompts(path, store, "chat", input_key="q", label_key="answer")
    assert info.rows == 1
    (row,) = load_prompts(store, "chat")
    assert row["prompt"] is None and row["messages"] == chat and row["label"] == "7.5"


def test_import_parquet_and_unlabelled(store, tmp_path):
    path = tmp_path / "mixed.parquet"
    pq.write_table(
        pa.table(
            {
                "prompt": ["Say hi", "Say bye"],
                "meta": ['{"src": "a"}', None],  # metadata as JSON text, as many Parquet writers do
            }
        ),
        path,
    )
    info = import_prompts(str(path), store, "p", input_key="prompt", label_key=None, metadata_key="meta")
    assert info.rows == 2
    rows = load_prompts(store, "p")
    assert [(r["prompt_id"], r["prompt"], r["label"], r["metadata"]) for r in rows] == [
        ("mixed:0", "Say hi", None, {"src": "a"}),
        ("mixed:1", "Say bye", None, {}),
    ]


def test_import_parquet_chat_messages(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "store"))
    path = tmp_path / "chat.parquet"
    msgs = [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "?"}],
    ]
    pq.write_table(pa.table({"input": msgs, "label": ["a", "b"], "metadata": [{"k": 1}, {"k": 2}]}), path)
    import_prompts(str(path), store, "c")
    rows = load_prompts(store, "c")
    assert [r["messages"] for r in rows] == msgs and [r["metadata"] for r in rows] == [{"k": 1}, {"k": 2}]


BAD_JSONL = {
    # case: (lines, the line the error must name, words the message must contain)
    "malformed json": (['{"input": "a", "label": 1}', '{"input": "b", "label": '], 2, "malformed JSON"),
    "not an object": (['{"input": "a", "label": 1}', "", '["a", 1]'], 3, "expected a JSON object"),
    "missing input key": (['{"prompt": "a", "label": 1}'], 1, "missing input key 'input'"),
    "missing label key": (['{"input": "a", "label": 1}', '{"input": "b"}'], 2, "missing label key 'label'"),
    "null label": (['{"input": "a", "label": null}'], 1, "expected a string or number"),
    "list label": (['{"input": "a", "label": [1]}'], 1, "expected a string or number"),
    "empty prompt": (['{"input": "  ", "label": 1}'], 1, "is empty"),
    "prompt is a number": (['{"input": 3, "label": 1}'], 1, "expected prompt text"),
    "empty messages": (['{"input": [], "label": 1}'], 1, "non-empty list"),
    "message not an object": (['{"input": ["hi"], "label": 1}'], 1, "message 0"),
    "message without role": (['{"input": [{"content": "hi"}], "label": 1}'], 1, "role"),
    "message content not text": (['{"input": [{"role": "user", "content": 5}], "label": 1}'], 1, "content"),
    "message extra key": (
        ['{"input": [{"role": "user", "content": "a", "x": 1}], "label": 1}'],
        1,
        "unsupported",
    ),
    "metadata not an object": (['{"input": "a", "label": 1, "metadata": [1]}'], 1, "expected an object"),
}


@pytest.mark.parametrize("case", list(BAD_JSONL))
def test_bad_jsonl_names_file_and_line(case, tmp_path):
    lines, line, words = BAD_JSONL[case]
    path = write_jsonl(tmp_path / "bad_prompts.jsonl", lines)
    store = ObjectStore.from_uri(str(tmp_path / "store"))
    with pytest.raises(UserError) as info:
        import_prompts(path, store, "d")
    message = str(info.value)
    assert "\n" not in message
    assert f"bad_prompts.jsonl:{line}:" in message and words in message
    assert not table_exists(store, "d")  # nothing half-imported


@pytest.mark.parametrize(
    "case, content, words",
    [
        ("empty file", b"", "empty file"),
        ("only blank lines", b"\n  \n\n", "empty file"),
        ("not utf-8", b'{"input": "\xff", "label": 1}\n', "UTF-8"),
    ],
)
def test_bad_file_contents(case, content, words, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError) as info:
        import_prompts(str(path), ObjectStore.from_uri(str(tmp_path / "s")), "d")
    assert "data.jsonl" in str(info.value) and words in str(info.value) and "\n" not in str(info.value)


def test_missing_file_and_bad_parquet_rows(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "store"))
    with pytest.raises(UserError, match=r"nowhere\.jsonl: prompt file not found"):
        import_prompts(str(tmp_path / "nowhere.jsonl"), store, "d")
    with pytest.raises(UserError, match=r"prompts\.csv: unsupported file type"):
        import_prompts(str(tmp_path / "prompts.csv"), store, "d")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"input": ["ok", None], "label": ["1", "2"]}), path)
    with pytest.raises(UserError) as info:
        import_prompts(str(path), store, "d")
    assert "rows.parquet: row 1:" in str(info.value) and "expected prompt text" in str(info.value)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match=r"junk\.parquet: cannot read as Parquet"):
        import_prompts(str(tmp_path / "junk.parquet"), store, "d")


def test_import_records_for_generated_datasets(store):
    records = [{"input": f"{i} + 1 = ?", "label": i + 1, "metadata": {"seed": 0}} for i in range(5)]
    info = import_records(records, store, "env-add", source="env:add?seed=0")
    assert (info.rows, info.version, info.added) == (5, 0, True)
    assert import_records(records, store, "env-add", source="env:add?seed=0").added is False
    rows = load_prompts(store, "env-add")
    assert [r["prompt_id"] for r in rows] == [f"env:add?seed=0:{i}" for i in range(5)]
    assert [r["label"] for r in rows] == [str(i + 1) for i in range(5)]
    with pytest.raises(UserError, match=r"env:x: record 1: missing label key"):
        import_records([{"input": "a", "label": 1}, {"input": "b"}], store, "bad", source="env:x")


# -- generic tables --------------------------------------------------------------------------------------------


def test_append_idempotent_suppresses_retried_writes(store):
    first = pa.table({"k": pa.array([1, 2], pa.int64()), "v": ["a", "b"]})
    assert table_version(store, "t") is None
    assert append_idempotent(store, "t", first, app_id="batch-1") is True
    assert append_idempotent(store, "t", first, app_id="batch-1") is False  # the retry adds nothing
    assert read_table(store, "t").num_rows == 2 and table_version(store, "t") == 0
    # Data is cast to the table's schema (int32 -> int64) and a missing nullable column becomes null.
    second = pa.table({"k": pa.array([3], pa.int32())})
    assert append_idempotent(store, "t", second, app_id="batch-2") is True
    assert table_version(store, "t") == 1
    table = read_table(store, "t").sort_by("k")
    assert table.column("k").to_pylist() == [1, 2, 3] and table.column("v").to_pylist() == ["a", "b", None]
    assert read_table(store, "t", version=0).num_rows == 2  # time travel
    assert read_table(store, "t", filters=[("k", ">", 1)]).num_rows == 2
    with pytest.raises(ValueError, match="unknown columns"):
        append_idempotent(store, "t", pa.table({"k": [4], "typo": [1]}), app_id="batch-3")


# -- trajectories ----------------------------------------------------------------------------------------------


def test_trajectory_roundtrip(store):
    assert read_trajectories(store, "run-a").num_rows == 0  # no table yet: empty, typed
    assert append_trajectories(store, batch(step=0), app_id="run-a/0/0") is True
    assert append_trajectories(store, batch(step=1, groups=(0,)), app_id="run-a/1/0") is True
    assert append_trajectories(store, batch(step=0), app_id="run-a/0/0") is False  # retried task
    assert append_trajectories(store, batch(step=0, run_id="run-b"), app_id="run-b/0/0") is True

    step0 = read_trajectories(store, "run-a", step=0)
    assert step0.schema.equals(TRAJECTORY_SCHEMA)
    assert step0.num_rows == 4
    keys = list(zip(step0["group_id"].to_pylist(), step0["sample_index"].to_pylist(), strict=True))
    assert keys == [(0, 0), (0, 1), (1, 0), (1, 1)]
    got = step0.slice(3, 1).to_pylist()[0]
    want = sample_row(0, 1, 1)
    want.update(metadata=json.dumps(want["metadata"]), reward=None, reward_details=None, filter_reason=None,
                teacher_logprobs=None)  # fmt: skip
    assert got == want  # token ids, log-probs, mask and timestamps come back exactly

    everything = read_trajectories(store, "run-a")
    assert everything["step"].to_pylist() == [0, 0, 0, 0, 1, 1]
    assert existing_group_ids(store, "run-a", 0) == {0, 1}
    assert existing_group_ids(store, "run-a", 1) == {0}
    assert existing_group_ids(store, "run-a", 7) == set()
    # A pyarrow table is accepted too (here: a retried step-2 batch built as a table).
    as_table = read_trajectories(store, "run-a", step=1).set_column(1, "step", pa.array([2, 2], pa.int64()))
    assert append_trajectories(store, as_table, app_id="run-a/2/0") is True
    assert existing_group_ids(store, "run-a", 2) == {0}


@pytest.mark.parametrize(
    "change, words",
    [
        ({"status": "done"}, "status 'done'"),
        ({"loss_mask": [1]}, "'loss_mask' has 1 entries"),
        ({"rollout_logprobs": [-1.0]}, "'rollout_logprobs' has 1 entries"),
        ({"step": "zero"}, "field 'step'"),
        ({"response_token_ids": [1, "a"]}, "field 'response_token_ids'"),
        ({"engine": None}, "'engine' is null"),
        ({"typo_field": 1}, "unknown fields ['typo_field']"),
        ({"reward": float("nan")}, "reward nan is not a finite number"),
        ({"reward": float("-inf")}, "reward -inf is not a finite number"),
    ],
)
def test_trajectory_rows_are_validated(change, words, tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "store"))
    rows = batch(step=0)
    rows[2].update(change)
    with pytest.raises(ValueError) as info:
        append_trajectories(store, rows, app_id="x")
    assert words in str(info.value) and "row 2" in str(info.value)
    assert not table_exists(store, TRAJECTORIES)


def test_trajectory_batch_checks(tmp_path):
    store = ObjectStore.from_uri(str(tmp_path / "store"))
    rows = batch(step=0)
    del rows[1]["finish_reason"]
    with pytest.raises(ValueError, match=r"row 1: missing fields \['finish_reason'\]"):
        append_trajectories(store, rows, app_id="x")
    with pytest.raises(ValueError, match="appears 2 times"):
        append_trajectories(store, batch(step=0) + batch(step=0, groups=(1,), samples=1), app_id="x")
    assert append_trajectories(store, [sample_row(0, 0, 0, rollout_logprobs=[])], app_id="x")  # none is fine


def test_set_rewards(store):
    append_trajectories(store, batch(step=0), app_id="a0")
    append_trajectories(store, batch(step=1), app_id="a1")
    rewards = [(0, 0, 1.0, '{"correct": true}'), (0, 1, 0.0, None), (1, 1, 0.5, None)]
    assert set_rewards(store, "run-a", 0, rewards) == 3
    version = table_version(store, TRAJECTORIES)
    step0 = read_trajectories(store, "run-a", 0)
    assert step0["reward"].to_pylist() == [1.0, 0.0, None, 0.5]
    assert step0["reward_details"].to_pylist() == ['{"correct": true}', None, None, None]
    assert read_trajectories(store, "run-a", 1)["reward"].null_count == 4  # other partitions untouched

    assert set_rewards(store, "run-a", 0, rewards) == 0  # re-applied: nothing changes, nothing committed
    assert table_version(store, TRAJECTORIES) == version
    assert set_rewards(store, "run-a", 0, [(1, 0, -1.0, None)]) == 1
    assert read_trajectories(store, "run-a", 0)["reward"].to_pylist() == [1.0, 0.0, -1.0, 0.5]
    with pytest.raises(ValueError, match="not stored"):
        set_rewards(store, "run-a", 0, [(9, 0, 1.0, None)])
    for bad in (float("nan"), float("inf")):  # never written: the reward stage makes it the sample's failure
        with pytest.raises(ValueError, match=rf"non-finite reward {bad!r} for run-a step 0 \(group 1, sample 0\)"):
            set_rewards(store, "run-a", 0, [(0, 0, 1.0, None), (1, 0, bad, None)])
    assert read_trajectories(store, "run-a", 0)["reward"].to_pylist() == [1.0, 0.0, -1.0, 0.5]


def test_trajectory_table_readable_with_polars_and_pandas(store):
    append_trajectories(store, batch(step=0), app_id="a0")
    uri, opts = store.table_uri(TRAJECTORIES), dict(store.storage_options)
    frame = pl.read_delta(uri, storage_options=opts or None)
    assert frame.height == 4 and frame.schema["response_token_ids"] == pl.List(pl.Int32)
    lazy = pl.scan_pyarrow_dataset(open_table(store, TRAJECTORIES).to_pyarrow_dataset())
    assert lazy.filter(pl.col("group_id") == 1).collect().height == 2
    df = open_table(store, TRAJECTORIES).to_pandas()
    assert isinstance(df, pd.DataFrame) and sorted(df["sample_index"]) == [0, 0, 1, 1]
    assert set(df.columns) == set(TRAJECTORY_SCHEMA.names)


# -- metrics ---------------------------------------------------------------------------------------------------


def test_metrics_roundtrip(store):
    assert append_metrics(store, "run-a", 0, {"loss": 1.5, "rollout/reward_mean": 0.25}) is True
    assert append_metrics(store, "run-a", 0, {"loss": 1.5, "rollout/reward_mean": 0.25}) is False  # retry
    # Another stage at the same step is not suppressed by the train tag.
    assert append_metrics(store, "run-a", 0, {"eval/acc": 0.5}, tag="eval") is True
    assert append_metrics(store, "run-a", 1, {"loss": float("nan")}) is True
    assert append_metrics(store, "run-b", 0, {"loss": 9.0}) is True
    long = read_metrics(store, "run-a")
    assert long.num_rows == 4 and set(long["run_id"].to_pylist()) == {"run-a"}
    assert long.schema.field("created_at").type == pa.timestamp("us", tz="UTC")
    wide = metrics_frame(store, "run-a")
    assert list(wide.index) == [0, 1] and wide.index.name == "step"
    assert sorted(wide.columns) == ["eval/acc", "loss", "rollout/reward_mean"]
    assert wide.loc[0, "loss"] == 1.5 and pd.isna(wide.loc[1, "loss"]) and pd.isna(wide.loc[1, "eval/acc"])
    assert metrics_frame(store, "run-none").empty
    with pytest.raises(ValueError, match="'loss' = 'high' is not a number"):
        append_metrics(store, "run-a", 2, {"loss": "high"})

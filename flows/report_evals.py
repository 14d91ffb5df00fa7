"""The evaluation-samples section of `sluiceway report`: per eval set and step, what the model answered."""

from __future__ import annotations

from sluiceway.storage.evals import EVALS, SETTINGS, read_evals
from sluiceway.storage.object_store import ObjectStore

EXAMPLES = 3  # answers shown per evaluation
PROMPT_CHARS, ANSWER_CHARS = 60, 80


def _cell(text: str | None, limit: int, tail: bool = False) -> str:
    """Text fit for one markdown table cell: one line, no pipes, at most `limit` characters."""
    text = " ".join((text or "").split()).replace("|", "\\|")
    if len(text) <= limit:
        return text
    # A prompt's question is at its end (after the chat template's preamble); an answer's gist at its start.
    return "…" + text[-(limit - 1) :] if tail else text[: limit - 1] + "…"


def eval_samples_section(store: ObjectStore, run_id: str) -> list[str]:
    """Markdown lines: one block per (step, eval set, sampling settings); none when the run stored no samples."""
    rows = read_evals(store, run_id).to_pylist()
    if not rows:
        return []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:  # read_evals sorts by step, set, settings, prompt, sample
        groups.setdefault((r["step"], *(r[k] for k in SETTINGS)), []).append(r)
    lines = ["", "## Evaluation samples", ""]
    for (step, name, temperature, top_p, max_new), samples in groups.items():
        mean = sum(s["reward"] for s in samples) / len(samples)
        sampling = "greedy" if temperature == 0 else f"temperature {temperature:g}, top_p {top_p:g}"
        lines += [
            f"**{name}**, step {step} ({sampling}, at most {max_new} tokens): "
            f"{len(samples)} samples, mean reward {mean:.3f}",
            "",
            "| prompt | label | answer | reward |",
            "| --- | --- | --- | ---: |",
        ]
        for s in samples[:EXAMPLES]:
            prompt, label = _cell(s["prompt"], PROMPT_CHARS, tail=True), _cell(s["label"], 20)
            lines.append(f"| {prompt} | {label} | {_cell(s['response_text'], ANSWER_CHARS)} | {s['reward']:.3f} |")
        lines.append("")
    lines.append(f"All samples: `pl.read_delta('{store.table_uri(EVALS)}').filter(pl.col('run_id') == '{run_id}')`.")
    return lines

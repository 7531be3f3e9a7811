"""A chat of several turns on a decoder artifact's ContinuousBatcher, with prefix caching and without: each turn's
prompt is the last turn's prompt, its answer and a new message of exactly P tokens, and each answer is exactly M
tokens (greedy, end-of-sequence suppressed). With prefix caching the turn's prompt finds the last prompt's cache in
the slot it left, and prefills only the last answer and the new message; without, it prefills the whole
conversation. Rounds alternate between the two; per turn, the time to its first token (from its submission), median
[p10, p90] over the rounds, and the ratio of the two, paired round by round.
"""

from __future__ import annotations

import time

from pipeline.bench.common import bench_folder, figure, host_line, identity, open_decoder, write_results
from pipeline.bench.generation import exact_prompts
from pipeline.errors import InputError
from pipeline.runtime.continuous import ContinuousBatcher

VARIANTS = ("prefix-cached", "recomputed")


def _chat(batcher, messages: list[list[int]], new_tokens: int) -> dict:
    """One chat through `batcher`: each turn's TTFT (s) and answer ids."""
    prompt, ttfts, answers = [], [], []
    for message in messages:
        prompt = prompt + (answers[-1] if answers else []) + message
        began, first, ids = time.perf_counter(), None, []
        for event in batcher.submit(prompt, max_new_tokens=new_tokens, eos=False):
            first = first or time.perf_counter()
            ids.append(event.token_id)
        ttfts.append(first - began)
        answers.append(ids)
    return {"ttft_s": ttfts, "answers": answers}


def bench_turns(artifact, out_dir=None, turns: int = 4, message_tokens: int = 128, new_tokens: int = 32, reps=5):
    """Benchmark prefix caching on `artifact` (a decoder with the shared cache layout) over a chat of `turns`
    turns; writes bench.json and bench.md to `out_dir` (default: beside the artifact's other benchmarks)."""
    artifact, manifest, model, threads, texts = open_decoder(artifact, "--turns")
    room = turns * (message_tokens + new_tokens) + 1
    if room > model.max_length:
        raise InputError(
            f"--turns {turns}: a chat of {turns} turns of {message_tokens} + {new_tokens} tokens needs {room} tokens, "
            f"but {artifact} holds {model.max_length}; ask for fewer turns"
        )
    messages = [
        list(model.encode([p], "bench")[0].ids) for p in exact_prompts(model.tokenizer, texts, message_tokens, turns)
    ]

    def batcher(name: str) -> ContinuousBatcher:  # a fresh one each chat: its first turn finds nothing cached
        return ContinuousBatcher(model, max_slots=1, capacity=room, prefix_caching=name == VARIANTS[0])

    rounds, hits = {name: [] for name in VARIANTS}, 0
    for rep in range(reps + 1):  # the first round warms up
        for name in VARIANTS:
            with batcher(name) as engine:
                if not engine.continuous:
                    raise InputError(f"--turns needs a decoder with the shared cache layout; {artifact} has another")
                chat = _chat(engine, messages if rep else messages[:2], new_tokens if rep else 2)
                hits += engine.stats.prefix_hits if rep else 0
            if rep:
                rounds[name].append(chat)
    results = {**identity(manifest, artifact.resolve(), threads), "reps": reps, "turns": turns}
    results.update({"message_tokens": message_tokens, "new_tokens": new_tokens, "prefix_hits": hits})
    results["per_turn"] = [_turn(rounds, t) for t in range(turns)]
    # Greedy: a hit must give the tokens a recompute gives, or the speed is of nothing.
    results["same_tokens"] = [r["answers"] for r in rounds[VARIANTS[0]]] == [r["answers"] for r in rounds[VARIANTS[1]]]
    out = write_results(results, markdown(results), out_dir or bench_folder(artifact.resolve(), manifest))
    results["written_to"] = str(out)
    return results


def _turn(rounds: dict, turn: int) -> dict:
    """One turn's TTFT of each variant (ms, median and p10-p90) and their ratio, paired by round."""
    figures = {}
    for name in VARIANTS:
        ttft = figure([r["ttft_s"][turn] * 1000 for r in rounds[name]])
        figures[name] = {"ttft_ms": ttft["median"], "ttft_range_ms": ttft["range"]}
    cached, recomputed = ([r["ttft_s"][turn] for r in rounds[name]] for name in VARIANTS)
    speedup = figure([b / a for a, b in zip(cached, recomputed, strict=True)])
    return {**figures, "speedup": speedup["median"], "speedup_range": speedup["range"]}


def markdown(results: dict) -> str:
    """The results as one Markdown table: each turn's TTFT with and without prefix caching."""
    lines = [
        f"# {results['model_name']} {results['version']} {results['target']}: a chat of {results['turns']} turns",
        "",
        f"{host_line(results)} Each turn adds a message of {results['message_tokens']} tokens to the conversation "
        f"and answers in {results['new_tokens']} tokens (greedy), {results['reps']} rounds alternating.",
        "",
        "| turn | prompt tokens | TTFT ms, prefix-cached | TTFT ms, recomputed | recomputed over cached |",
        "|---|---|---|---|---|",
    ]
    step = results["message_tokens"] + results["new_tokens"]
    for turn, row in enumerate(results["per_turn"]):
        cells = []
        for name in VARIANTS:
            low, high = row[name]["ttft_range_ms"]
            cells.append(f"{row[name]['ttft_ms']:.1f} [{low:.1f}, {high:.1f}]")
        low, high = row["speedup_range"]
        prompt = turn * step + results["message_tokens"]
        lines.append(
            f"| {turn + 1} | {prompt} | {cells[0]} | {cells[1]} | x{row['speedup']:.2f} [{low:.2f}, {high:.2f}] |"
        )
    same = "Both variants wrote the same tokens." if results["same_tokens"] else "**Tokens differ between variants.**"
    lines += ["", f"{same} Prefix hits: {results['prefix_hits']}."]
    return "\n".join(lines) + "\n"

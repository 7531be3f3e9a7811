"""Concurrent generation streams: a decoder artifact's ContinuousBatcher (what `pipeline serve` runs chat and text
completions through) against the same requests run one at a time (what serving did before it), at 1 and N
concurrent streams of prompts of exactly P tokens, each generating exactly M tokens greedily (end-of-sequence
suppressed). Rounds alternate between the two; per round, the aggregate decode tokens/s (every stream's tokens
after its first, over the time from the first first-token to the last token) and each stream's time to first token
(from its submission). Figures are medians [p10, p90] over the rounds; TTFT p99 is over all streams of all rounds.
For the batcher, its own counters also give the tokens a second of its decode steps alone (prefill left out) and
the share of its run time its prefill took: a burst of N prompts arriving at once must prefill them all before the
last one's first token, whatever the batching.
"""

from __future__ import annotations

import statistics
import threading
import time

from pipeline.bench.common import bench_folder, host_line, identity, open_decoder, write_results
from pipeline.bench.generation import exact_prompts
from pipeline.build.timing import percentile
from pipeline.runtime.continuous import ContinuousBatcher

VARIANTS = ("continuous", "one-at-a-time")


def _round(submit, prompts: list[str], new_tokens: int) -> dict:
    """All `prompts` submitted at once from their own threads; TTFTs (s), the aggregate decode rate and each
    stream's token ids."""
    firsts, ends, lock, tokens = [], [], threading.Lock(), [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def stream(i: int) -> None:
        start.wait()
        began = time.perf_counter()
        first, ids = None, []
        for event in submit(prompts[i], new_tokens):
            first = first or time.perf_counter()
            ids.append(event.token_id)
        tokens[i] = ids
        with lock:
            firsts.append((began, first))
            ends.append(time.perf_counter())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    decode_from = min(first for _, first in firsts)
    rate = len(prompts) * (new_tokens - 1) / (max(ends) - decode_from)
    return {"ttft_s": [first - began for began, first in firsts], "tokens_per_s": rate, "tokens": tokens}


def _submitters(model, streams: int, room: int) -> dict:
    batcher = ContinuousBatcher(model, max_slots=streams, capacity=room)
    alone = threading.Lock()

    def continuous(prompt: str, n: int):
        return batcher.submit(prompt, max_new_tokens=n, eos=False)

    def one_at_a_time(prompt: str, n: int):
        with alone:  # a request runs only when the one before it has ended, as a server without batching runs them
            yield from model.stream([prompt], max_new_tokens=n, eos=False)

    return {"continuous": continuous, "one-at-a-time": one_at_a_time}, batcher


def bench_streams(
    artifact, out_dir=None, streams=(1, 16), prompt_tokens: int = 128, new_tokens: int = 64, reps: int = 5
) -> dict:
    """Benchmark continuous batching against one request at a time on `artifact` (a decoder); writes bench.json
    and bench.md to `out_dir` (default: beside the artifact's other benchmarks)."""
    artifact, manifest, model, threads, texts = open_decoder(artifact, "--streams")
    rows = exact_prompts(model.tokenizer, texts, prompt_tokens, max(streams))
    results = {**identity(manifest, artifact.resolve(), threads), "reps": reps, "new_tokens": new_tokens}
    results.update({"prompt_tokens": prompt_tokens, "runs": {}})
    for count in streams:
        submitters, batcher = _submitters(model, count, prompt_tokens + new_tokens + 1)
        try:
            for submit in submitters.values():
                _round(submit, rows[:count], 2)  # warm-up
            rounds = {name: [] for name in VARIANTS}
            engine = []  # the batcher's own seconds in decode and prefill runs, per round
            for _ in range(reps):
                for name in VARIANTS:
                    before = batcher.stats
                    rounds[name].append(_round(submitters[name], rows[:count], new_tokens))
                    if name == "continuous":
                        engine.append(_engine_figures(before, batcher.stats))
        finally:
            batcher.close()
        results["runs"][str(count)] = {name: _summary(rounds[name]) for name in VARIANTS}
        results["runs"][str(count)]["continuous"].update(
            {key: statistics.median(e[key] for e in engine) for key in ("decode_step_tokens_per_s", "prefill_share")}
        )
        # Greedy: batched with others or alone, each stream must get the same tokens, or the speed is of nothing.
        outputs = {name: [r["tokens"] for r in rounds[name]] for name in VARIANTS}
        results["runs"][str(count)]["same_tokens"] = outputs["continuous"] == outputs["one-at-a-time"]
    out = write_results(results, markdown(results), out_dir or bench_folder(artifact.resolve(), manifest))
    results["written_to"] = str(out)
    return results


def _engine_figures(before, after) -> dict:
    """What the batcher's counters say of one round: tokens a second while decode steps ran (prefill left out), and
    the share of its run time that went to prefill."""
    decode = after.decode_seconds - before.decode_seconds
    prefill = after.prefill_seconds - before.prefill_seconds
    return {
        "decode_step_tokens_per_s": (after.decoded_tokens - before.decoded_tokens) / max(decode, 1e-9),
        "prefill_share": prefill / max(prefill + decode, 1e-9),
    }


def _summary(rounds: list[dict]) -> dict:
    rates = [r["tokens_per_s"] for r in rounds]
    ttfts = [t * 1000 for r in rounds for t in r["ttft_s"]]
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_range": [percentile(rates, 10), percentile(rates, 90)],
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
    }


def markdown(results: dict) -> str:
    """The results as one Markdown table: each stream count, each variant."""
    lines = [
        f"# {results['model_name']} {results['version']} {results['target']}: concurrent streams",
        "",
        f"{host_line(results)} Prompts of {results['prompt_tokens']} tokens, {results['new_tokens']} new tokens "
        f"each (greedy), {results['reps']} rounds alternating between the variants.",
        "",
        "| streams | variant | decode tokens/s | TTFT p50 ms | TTFT p99 ms | decode-step tokens/s | prefill share |",
        "|---|---|---|---|---|---|---|",
    ]
    for count, run in results["runs"].items():
        for name in VARIANTS:
            v = run[name]
            low, high = v["tokens_per_s_range"]
            engine = (
                f"{v['decode_step_tokens_per_s']:.1f} | {v['prefill_share']:.2f}" if "prefill_share" in v else "- | -"
            )
            lines.append(
                f"| {count} | {name} | {v['tokens_per_s']:.1f} [{low:.1f}, {high:.1f}] | {v['ttft_p50_ms']:.1f} | "
                f"{v['ttft_p99_ms']:.1f} | {engine} |"
            )
    same = all(run["same_tokens"] for run in results["runs"].values())
    lines += [
        "",
        "Every stream got the same tokens in both variants." if same else "**Tokens differ between variants.**",
    ]
    return "\n".join(lines) + "\n"

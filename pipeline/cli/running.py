"""Commands that run an artifact: generate, classify, bench."""

from __future__ import annotations

import click

from pipeline.errors import InputError, PipelineError, QuantizationError


@click.command()
@click.argument("artifact")
@click.option("--baseline", type=click.Choice(["pytorch", "none"]), default="pytorch", show_default=True)
@click.option("--cache-dir", default=None, help="stage cache holding the unoptimized and fp32 graphs")
@click.option("--out", default=None, help="folder for bench.json, bench.md, bench.png (default: beside the artifact)")
@click.option("--quick", is_flag=True, help="batch 1 and 8, sequence 16 and 128, fewer repetitions")
@click.option(
    "--profile",
    "profile",
    is_flag=True,
    help="instead: per-op time at batch 1 and 32 (sequence 128) against the host's GEMM limit (profile.json, .md)",
)
@click.option(
    "--calibration-memory",
    "calibration",
    default=None,
    metavar="N,N",
    help="instead: peak RSS of static calibration over N examples (e.g. 1000,10000)",
)
@click.option(
    "--method",
    type=click.Choice(["minmax", "entropy", "percentile"]),
    default="entropy",
    show_default=True,
    help="calibration method for --calibration-memory",
)
@click.option(
    "--genai",
    "genai",
    multiple=True,
    metavar="NAME=DIR",
    help="decoders: an onnxruntime-genai model folder to run beside the artifact (repeatable)",
)
@click.option(
    "--llama",
    "llama",
    multiple=True,
    metavar="NAME=FILE.gguf",
    help="decoders: a GGUF file of the same checkpoint to run on llama.cpp beside the artifact (repeatable)",
)
@click.option(
    "--streams",
    default=None,
    metavar="N,N",
    help="decoders, instead: continuous batching against one request at a time at N concurrent streams (e.g. 1,16)",
)
@click.option(
    "--turns",
    type=click.IntRange(2, 64),
    default=None,
    help="decoders, instead: a chat of N turns, each turn's first token with prefix caching and without",
)
def bench(artifact, baseline, cache_dir, out, quick, profile, calibration, method, genai, llama, streams, turns):
    """Benchmark ARTIFACT against PyTorch (and, for decoders, onnxruntime-genai and llama.cpp) side by side."""
    from pipeline.bench import markdown, run
    from pipeline.bench.common import check_out

    check_out(out)
    if profile:
        from pipeline.bench.profile import markdown as profile_markdown
        from pipeline.bench.profile import profile as profile_artifact

        settings = {"runs": 2, "warmups": 1, "limit_shapes": ((256, 128, 256),), "limit_runs": 2} if quick else {}
        results = profile_artifact(artifact, out, **settings)
        click.echo(profile_markdown(results))
        click.echo(f"wrote {results['written_to']}/profile.json, profile.md")
        return
    if turns:
        from pipeline.bench.turns import bench_turns
        from pipeline.bench.turns import markdown as turns_markdown

        results = bench_turns(artifact, out, turns, reps=2 if quick else 5, new_tokens=8 if quick else 32)
        click.echo(turns_markdown(results))
        click.echo(f"wrote {results['written_to']}/bench.json, bench.md")
        return
    if streams:
        from pipeline.bench.streams import bench_streams
        from pipeline.bench.streams import markdown as streams_markdown

        counts = _counts(streams, "--streams")
        results = bench_streams(artifact, out, counts, reps=2 if quick else 5, new_tokens=16 if quick else 64)
        click.echo(streams_markdown(results))
        click.echo(f"wrote {results['written_to']}/bench.json, bench.md")
        return
    if calibration:
        from pipeline.bench.calibration import calibration_lines, calibration_memory

        rows = calibration_memory(artifact, cache_dir, _counts(calibration, "--calibration-memory"), method)
        click.echo(calibration_lines(rows))
        if any(row.get("error") for row in rows):
            raise QuantizationError("a calibration run failed (its row above says why)")
        return
    bad = [g for g in genai if "=" not in g]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not NAME=DIR, e.g. genai-int4=.cache/genai/smollm2-int4")
    bad = [g for g in llama if "=" not in g or not g.endswith(".gguf")]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not NAME=FILE.gguf, e.g. llama-q8=.cache/smollm2-q8_0.gguf")
    peers = dict(g.split("=", 1) for g in (*genai, *llama))
    results = run(artifact, cache_dir, out, baseline=None if baseline == "none" else baseline, quick=quick, peers=peers)
    click.echo(markdown(results))
    written = "bench.json, bench.md, " + ("bench-prompt*.png" if "runs" in results else "bench.png")
    click.echo(f"wrote {results['written_to']}/{written}")


@click.command()
@click.argument("artifact")
@click.argument("images", nargs=-1, required=True)
@click.option("--top-k", type=click.IntRange(min=1), default=5, show_default=True, help="labels printed a picture")
def classify(artifact, images, top_k) -> None:
    """Print the most probable labels of each of IMAGES (files) by an image-classification ARTIFACT."""
    from pipeline.ops.summary import printable
    from pipeline.runtime import load

    model = load(artifact)
    if getattr(model, "task", None) != "image-classification":
        raise InputError(f"{artifact} is built for {model.task}; classify needs an image-classification artifact")
    for image, predictions in zip(images, model.classify_images(list(images), top_k=top_k), strict=True):
        labels = ", ".join(f"{printable(p.label)} {p.score:.3f}" for p in predictions)
        click.echo(f"{printable(image)}: {labels}")


@click.command()
@click.argument("artifact")
@click.argument("audio", nargs=-1, required=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None, help="tokens a 30 s window at most")
def transcribe(artifact, audio, max_new_tokens) -> None:
    """Print the text spoken in each of AUDIO (WAV files) by a speech-recognition ARTIFACT."""
    from pipeline.ops.summary import printable
    from pipeline.runtime import load

    model = load(artifact)
    if getattr(model, "task", None) != "automatic-speech-recognition":
        raise InputError(
            f"{artifact} is built for {model.task}; transcribe needs an automatic-speech-recognition artifact"
        )
    for path, text in zip(audio, model.transcribe(list(audio), max_new_tokens=max_new_tokens), strict=True):
        click.echo(f"{printable(path)}: {printable(text)}")


@click.command()
@click.argument("artifact")
@click.argument("prompts", nargs=-1, required=True)
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--temperature", type=float, default=None, help="> 0 samples; 0 is greedy (default: the checkpoint's)")
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", default=None, help="an int from 0 to 2**64 - 1; makes sampling repeatable")
@click.option("--stop", multiple=True, help="a string that ends the text (repeatable)")
@click.option("--chat", is_flag=True, help="send each prompt as one user message through the chat template")
@click.option(
    "--num-beams", type=click.IntRange(1, 16), default=None, help="text-to-text: beams (default: the config's)"
)
def generate(artifact, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, chat, num_beams) -> None:
    """Generate text from a decoder ARTIFACT for each of PROMPTS, streaming tokens as they come. With --chat, each
    prompt is a user's message, rendered with the checkpoint's chat template (as instruction-tuned models need).
    A text-to-text ARTIFACT (T5, BART, Marian) prints each prompt's output on a line, decoded greedily."""
    from pipeline.runtime import load

    settings = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "stop": list(stop),
    }
    if seed is not None and seed.isascii() and seed.strip().removeprefix("-").isdigit():
        seed = int(seed)  # anything else goes to the runtime as given, which names what it takes
    model = load(artifact)
    if getattr(model, "task", None) == "text2text-generation":
        _text2text(model, prompts, max_new_tokens, num_beams, {**settings, "seed": seed, "chat": chat or None})
        return
    if num_beams is not None:
        raise InputError("--num-beams applies to text2text-generation artifacts; a decoder samples or decodes greedily")
    if not hasattr(model, "stream"):
        raise PipelineError(
            f"{artifact} is a {model.task} artifact; generate needs a text-generation or text2text-generation one"
        )
    # One prompt at a time, so that each one's text streams out whole before the next begins. The prompt comes
    # first (dimmed on a terminal; click drops the style elsewhere), the continuation after it.
    started = set()
    inputs = {"messages": [[{"role": "user", "content": p}] for p in prompts]} if chat else {"prompts": list(prompts)}
    for event in model.stream(batch_size=1, seed=seed, **inputs, **settings):
        if event.index not in started:
            started.add(event.index)
            if len(prompts) > 1:
                click.echo(
                    ("\n" if event.index else "")
                    + click.style(f"--- prompt {event.index + 1} of {len(prompts)}", bold=True)
                )
            click.echo(click.style(prompts[event.index], dim=True), nl=chat)  # a reply starts on its own line
        click.echo(event.text, nl=False)
        if event.finish_reason:
            click.echo(f"\n[{event.finish_reason}]")


def _text2text(model, texts, max_new_tokens, num_beams, others: dict) -> None:
    """Print a text-to-text artifact's output of each text, one a line."""
    from pipeline.ops.summary import printable

    asked = sorted(k for k, v in others.items() if v not in (None, [], False) and k != "max_new_tokens")
    if asked:
        raise InputError(
            "a text2text-generation artifact decodes greedily or by beam search; "
            f"{', '.join('--' + a.replace('_', '-') for a in asked)} apply to text-generation artifacts only: leave "
            "them out"
        )
    for text in model.generate(list(texts), max_new_tokens=max_new_tokens, num_beams=num_beams):
        click.echo(printable(text))


def _counts(value: str, option: str) -> list[int]:
    """A comma-separated list of positive counts, else a click error naming the option."""
    try:
        counts = [int(n) for n in value.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        message = f"{value!r} is not a comma-separated list of positive counts, e.g. 1,16"
        raise click.BadParameter(message, param_hint=option)
    return counts

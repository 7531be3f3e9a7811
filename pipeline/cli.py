"""The command line: each command parses, calls one library function, prints. Heavy imports stay inside."""

from __future__ import annotations

import json
import sys

import click

from pipeline.errors import InputError, PipelineError, QuantizationError, TargetError
from pipeline.ops.summary import candidate_table, verdict_table


def _usage_line(err: click.UsageError) -> str:
    """click's usage error as one line: its message and where the options are listed (click prints three)."""
    where = f"`{err.ctx.command_path} --help`" if err.ctx is not None else "`pipeline --help`"
    return f"error: {err.format_message().rstrip('.')}; {where} lists the options"


class _Commands(click.Group):
    """The one place a PipelineError, or a usage error, becomes a one-line `error:` and its exit code."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as err:
            click.echo(_usage_line(err), err=True)
            sys.exit(err.exit_code)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PipelineError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(err.exit_code)
        except click.UsageError as err:  # a command's options, parsed when the group invokes it
            click.echo(_usage_line(err), err=True)
            sys.exit(err.exit_code)


@click.group(cls=_Commands)
@click.version_option(package_name="pipeline", prog_name="pipeline")
@click.option("--quiet", "-q", is_flag=True, help="no progress bars")
@click.option("--verbose", "-v", is_flag=True, help="print each search candidate's and fallback step's figures")
def main(quiet: bool, verbose: bool) -> None:
    """Export Hugging Face checkpoints to validated, versioned, hardware-targeted artifacts."""
    from pipeline.build.console import configure

    configure(quiet=quiet, verbose=verbose)


@main.command()
@click.option(
    "--model", "model", default=None, help="local Hugging Face checkpoint folder (default: packaged all-MiniLM-L6-v2)"
)
@click.option(
    "--target",
    default="native",
    show_default=True,
    help="target name (see `pipeline targets`), .toml path, or native: the target of this host's CPU",
)
@click.option("--name", default=None, help="artifact name (default: the checkpoint folder's name)")
@click.option(
    "--task",
    default=None,
    help="feature-extraction, sequence-classification, token-classification, fill-mask, question-answering or "
    "text-generation (default: what config.json's architectures names)",
)
@click.option("--artifacts-dir", default=None, help="where artifacts are published (default: ./artifacts)")
@click.option("--cache-dir", default=None, help="stage cache (default: ./.cache/stages)")
@click.option("--validation", default=None, help="held-out text for validation (default: data/validation.txt)")
@click.option("--calibration", default=None, help="calibration text (default: data/calibration.txt)")
@click.option("--models", "models_file", default=None, help="a fleet: a file of checkpoint folders, one a line")
@click.option(
    "--targets", "target_list", default=None, help="a fleet: targets, comma-separated (e.g. cpu-avx2,cpu-amx)"
)
@click.option("--cluster", default=None, help="a Ray cluster (ray://host:10001 or host:6379) to run the fleet on")
def build(
    model, target, name, task, artifacts_dir, cache_dir, validation, calibration, models_file, target_list, cluster
) -> None:
    """Build, validate and publish MODEL for TARGET (or, with --models/--targets/--cluster, a fleet of builds)."""
    from pipeline.build.inputs.targets import load_target
    from pipeline.build.table import build as run_build
    from pipeline.ops.summary import build_summary

    options = {
        "artifacts_dir": artifacts_dir,
        "cache_dir": cache_dir,
        "validation": validation,
        "calibration": calibration,
    }
    _check_build_options(locals())
    if models_file is not None or target_list is not None or cluster is not None:
        _fleet(model, target, models_file, target_list, cluster, {k: v for k, v in options.items() if v})
        return

    from pipeline.runtime.host import kernel_class

    if target == "native":
        from pipeline.build.inputs.targets import native_target

        click.echo(
            f"native: this host's kernel class is {kernel_class()}, so the target is {native_target(kernel_class())}"
        )

    def show(record) -> None:
        state = "reused" if record.reused else "built"
        if record.metrics.get("status") == "pending":
            state = "pending"
        click.echo(f"  {record.name:<11} {state:<7} {record.seconds:8.2f}s")
        if record.name == "search":
            click.echo(candidate_table(record.metrics))

    manifest = run_build(model, target, name, task, on_stage=show, **{k: v for k, v in options.items() if v})
    click.echo(build_summary(manifest, load_target(target), kernel_class()))


@main.command()
@click.argument("artifact")
@click.option("--data", default=None, help="held-out text (default: data/validation.txt)")
def validate(artifact, data) -> None:
    """Re-validate a published ARTIFACT on this host against its PyTorch source checkpoint: PASS or FAIL per
    threshold; the exit code is non-zero when any fails."""
    from pipeline.build.stages.validate import validate_artifact
    from pipeline.errors import AccuracyError

    try:
        stats = validate_artifact(artifact, data)
    except AccuracyError as err:
        if err.stats is not None:
            click.echo(verdict_table(err.stats["verdict"]))
        raise
    click.echo(verdict_table(stats["verdict"]))
    click.echo(f"PASS: {artifact} meets every threshold of its target on this host")


@main.command(name="inspect")
@click.argument("artifact")
@click.option("--json", "as_json", is_flag=True, help="print the verified description as JSON instead")
def inspect_artifact(artifact, as_json) -> None:
    """Verify ARTIFACT's hashes and print a summary: what it is, the search's table, the gate, size."""
    from pipeline.ops.summary import summary
    from pipeline.runtime import describe

    info = describe(artifact)
    click.echo(json.dumps(info, indent=1, sort_keys=True) if as_json else summary(info))


@main.command()
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
def bench(artifact, baseline, cache_dir, out, quick, profile, calibration, method, genai) -> None:
    """Benchmark ARTIFACT against PyTorch (and, for decoders, onnxruntime-genai models) side by side."""
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
    if calibration:
        from pipeline.bench.calibration import calibration_lines, calibration_memory

        try:
            counts = [int(n) for n in calibration.split(",")]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1:
            message = f"{calibration!r} is not a comma-separated list of positive counts, e.g. 1000,10000"
            raise click.BadParameter(message)
        rows = calibration_memory(artifact, cache_dir, counts, method)
        click.echo(calibration_lines(rows))
        if any(row.get("error") for row in rows):
            raise QuantizationError("a calibration run failed (its row above says why)")
        return
    bad = [g for g in genai if "=" not in g]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not NAME=DIR, e.g. genai-int4=.cache/genai/smollm2-int4")
    peers = dict(g.split("=", 1) for g in genai)
    results = run(artifact, cache_dir, out, baseline=None if baseline == "none" else baseline, quick=quick, peers=peers)
    click.echo(markdown(results))
    written = "bench.json, bench.md, " + ("bench-prompt*.png" if "runs" in results else "bench.png")
    click.echo(f"wrote {results['written_to']}/{written}")


@main.command()
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


@main.command()
@click.argument("artifact")
@click.argument("prompts", nargs=-1, required=True)
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--temperature", type=float, default=None, help="> 0 samples; 0 is greedy (default: the checkpoint's)")
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", default=None, help="an int from 0 to 2**64 - 1; makes sampling repeatable")
@click.option("--stop", multiple=True, help="a string that ends the text (repeatable)")
@click.option("--chat", is_flag=True, help="send each prompt as one user message through the chat template")
def generate(artifact, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, chat) -> None:
    """Generate text from a decoder ARTIFACT for each of PROMPTS, streaming tokens as they come. With --chat, each
    prompt is a user's message, rendered with the checkpoint's chat template (as instruction-tuned models need)."""
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
    if not hasattr(model, "stream"):
        raise PipelineError(f"{artifact} is a {model.task} artifact; generate needs a text-generation one")
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


@main.command()
@click.argument("artifact")
@click.option("--graph", "graphs", multiple=True, help="graph to build (default: every graph of the artifact)")
@click.option("--data", default=None, help="held-out text to validate the engine on (default: data/validation.txt)")
def engine(artifact, graphs, data) -> None:
    """Build ARTIFACT's TensorRT engines on this GPU host, into its engine cache, validated against its graphs."""
    from pipeline.build.stages.engine import build_artifact_engine
    from pipeline.runtime import artifact_graphs, verify_artifact

    graphs = graphs or artifact_graphs(verify_artifact(artifact))
    for graph in graphs:
        click.echo(f"{graph}: engine {build_artifact_engine(artifact, graph, data)}")


@main.command()
@click.option("--targets-dir", default=None, help="folder of target files (default: ./targets)")
def targets(targets_dir) -> None:
    """List the available targets; a broken file is named on stderr and the rest are still listed."""
    from pathlib import Path

    from pipeline.build.inputs.targets import TARGETS_DIR, available_targets, load_target

    folder = Path(targets_dir) if targets_dir else TARGETS_DIR
    if not folder.is_dir():
        raise TargetError(f"--targets-dir {folder} is not a folder; pass the folder of target .toml files")
    names = available_targets(folder)
    if not names:
        raise TargetError(f"--targets-dir {folder} holds no .toml target files; pass the folder that does")
    broken = []
    for name in names:
        try:
            spec = load_target(name, folder)
        except PipelineError as err:
            broken.append(str(err))
            continue
        state = "" if spec.supported else "  (not yet supported)"
        click.echo(f"{name:<12} {spec.description}{state}")
    for problem in broken:
        click.echo(f"error: {problem}", err=True)
    if broken:
        sys.exit(TargetError.exit_code)


def _check_build_options(given: dict) -> None:
    """Refuse, in one line, an empty option (it would fall back to a default) and options a fleet does not take
    beside those that make one."""
    from click.core import ParameterSource

    names = {k: f"--{k.replace('_', '-')}" for k in ("model", "target", "name", "task", "cluster", "calibration")}
    names |= {k: f"--{k.replace('_', '-')}" for k in ("artifacts_dir", "cache_dir", "validation")}
    names |= {"models_file": "--models", "target_list": "--targets"}
    empty = [names[k] for k in names if isinstance(given.get(k), str) and not given[k].strip()]
    if empty:
        raise InputError(f"{empty[0]} is empty; pass a value, or leave the option out for its default")
    fleet = [names[k] for k in ("models_file", "target_list", "cluster") if given.get(k) is not None]
    if not fleet:
        return
    context = click.get_current_context()
    clashing = [("--model", "--models")] if given["model"] and given["models_file"] else []
    if given["target_list"] and context.get_parameter_source("target") == ParameterSource.COMMANDLINE:
        clashing.append(("--target", "--targets"))
    clashing += [(names[k], fleet[0]) for k in ("name", "task") if given.get(k)]
    if clashing:
        one, other = clashing[0]
        raise InputError(f"{one} does not go with {other}; a fleet takes --models, --targets and --cluster")


def _fleet(model, target, models_file, target_list, cluster, options: dict) -> None:
    from pipeline.ops.fleet import fleet, fleet_table, read_models

    models = read_models(models_file) if models_file else [model] if model else []
    if not models:
        raise click.UsageError("a fleet needs --models FILE (or --model FOLDER)")
    targets = [t.strip() for t in (target_list or target).split(",") if t.strip()]
    if not targets:
        raise InputError(f"--targets {target_list!r} names no target; pass names separated by commas")
    rows = fleet(models, targets, cluster, **options)
    click.echo(fleet_table(rows))
    if any(r["status"] == "failed" for r in rows):
        sys.exit(1)


@main.command(name="host")
@click.option("--ray-resources", "ray_resources", is_flag=True, help="print the `ray start` line for this host")
@click.option("--head", default=None, help="with --ray-resources: the head's address to join (host:6379)")
def host(ray_resources, head) -> None:
    """Describe this host: its kernel class and flags, or the `ray start` line that joins it to a fleet."""
    from pipeline.runtime.host import cpu_model, kernel_class

    if ray_resources:
        from pipeline.ops.fleet import AUTH_NOTE, ray_start_line

        line = ray_start_line(head)
        click.echo(AUTH_NOTE)
        click.echo(line)
        return
    click.echo(f"{cpu_model()}: kernel class {kernel_class()}")


@main.command(name="check")
@click.argument("model")
@click.option("--target", default="native", show_default=True, help="target name, .toml path, or native")
def check_model(model, target) -> None:
    """Say in seconds what building MODEL for TARGET would do (task, family, passes, candidates), building nothing."""
    from pipeline.ops.check import check
    from pipeline.ops.summary import check_summary

    if target == "native":
        from pipeline.build.inputs.targets import native_target
        from pipeline.runtime.host import kernel_class

        target = native_target(kernel_class())
    click.echo(check_summary(check(model, target)))


@main.command(name="gc")
@click.option("--artifacts-dir", default=None, help="published artifacts (default: ./artifacts)")
@click.option("--cache-dir", default=None, help="stage cache (default: ./.cache/stages)")
@click.option(
    "--keep", type=int, default=None, help="also remove versions beyond the newest N of each model and target"
)
@click.option(
    "--min-age",
    type=float,
    default=3600.0,
    show_default=True,
    help="seconds a cache entry must be old before removal (a running build may still need a newer one)",
)
@click.option("--dry-run", is_flag=True, help="print what would be removed and the space it would free; remove nothing")
@click.option(
    "--force", is_flag=True, help="go on where --artifacts-dir holds no published artifact: every old entry goes"
)
def gc(artifacts_dir, cache_dir, keep, min_age, dry_run, force) -> None:
    """Remove stage-cache entries no published version references, and with --keep old versions; never what a
    `latest` link points to, what a running build holds, anything through a symlink, or a folder gc cannot prove
    is a cache entry. With --verbose, also print what was kept and why."""
    from pipeline.build.console import note
    from pipeline.build.table import REPO
    from pipeline.ops.gc import collect, describe

    _check_build_options({"artifacts_dir": artifacts_dir, "cache_dir": cache_dir})
    artifacts = artifacts_dir or REPO / "artifacts"
    cache = cache_dir or REPO / ".cache" / "stages"
    found = collect(artifacts, cache, keep=keep, min_age_s=min_age, dry_run=dry_run, force=force)
    for kept in found.kept:
        note(f"kept {kept.path}: {kept.reason}")
    click.echo(describe(found, dry_run))


@main.group(name="export")
def export_group() -> None:
    """Hand an artifact to a serving engine's format."""


@export_group.command(name="triton")
@click.argument("artifact")
@click.argument("out_dir")
@click.option(
    "--name", default=None, help="the graph model's name and folder: letters, digits, _ or - (default: the artifact's)"
)
@click.option(
    "--variant",
    "variants",
    multiple=True,
    type=click.Choice(["graph", "ensemble", "python"]),
    help="what to write (repeatable; default: all the artifact's kind takes)",
)
@click.option(
    "--python-env",
    default=None,
    help="Python environment (with `pipeline` installed) for the Python-backend models (default: Triton's)",
)
def export_triton(artifact, out_dir, name, variants, python_env) -> None:
    """Write a Triton Inference Server model repository for ARTIFACT into OUT_DIR, each config.pbtxt checked
    against Triton's schema."""
    from pipeline.serving.triton import repository_from_artifact

    def notify(line: str) -> None:
        click.echo(f"note: {line}")

    for path in repository_from_artifact(artifact, out_dir, name, tuple(variants) or None, python_env, notify):
        click.echo(f"wrote {path}")


@main.command()
@click.argument("artifact")
@click.option(
    "--replicas",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="replicas, each loading the artifact once",
)
@click.option("--address", default=None, help="an existing Ray cluster (ray://host:10001); default: a local one")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="HTTP port on 127.0.0.1")
@click.option(
    "--threads",
    type=click.IntRange(1, 1024),
    default=None,
    help="session threads per replica (default: CPUs // replicas)",
)
@click.option("--max-body-bytes", type=int, default=None, help="largest request body; larger gets 413 (default: 1 MiB)")
@click.option("--max-texts", type=int, default=None, help="most texts a request; more gets 400 (default: 256)")
@click.option(
    "--body-timeout",
    type=float,
    default=None,
    help="seconds a request's body may take to arrive; later gets 408 (default: 10)",
)
def serve(artifact, replicas, address, port, threads, max_body_bytes, max_texts, body_timeout) -> None:
    """Serve ARTIFACT over HTTP on 127.0.0.1 as a Ray Serve application: POST {"texts": [...]} to it. Every
    process it starts listens on loopback only (docs/serving.md: what is exposed, and how to expose it)."""
    from pipeline.serving.ray_serve import serve_forever

    serve_forever(
        artifact,
        replicas=replicas,
        address=address,
        port=port,
        threads=threads,
        max_body_bytes=max_body_bytes,
        max_texts=max_texts,
        body_timeout_s=body_timeout,
    )

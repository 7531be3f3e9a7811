"""Targets: one TOML data file per piece of hardware, parsed into frozen dataclasses.

Unknown keys and wrong types are hard errors that name the file and the key. `None` (a key left out) means
"use the default", and defaults live here, in the dataclass fields, and nowhere else.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from pipeline.build.inputs.targets.choices import CHOICES, RANGES
from pipeline.build.inputs.targets.schema import dataclass_from_table
from pipeline.errors import TargetError

TARGETS_DIR = Path(__file__).resolve().parents[4] / "targets"

NATIVE = {"amx": "cpu-amx", "avx512-vnni": "cpu-avx512", "avx512": "cpu-avx2", "avx2": "cpu-avx2"}


@dataclasses.dataclass(frozen=True)
class Optimize:
    """Graph optimization: ORT transformer fusions on top of dead-node removal and constant folding."""

    fusions: bool = True
    # 0 = the portable fusions of onnxruntime.transformers only; 1/2 also bake ORT's own graph passes in.
    level: int = 1


@dataclasses.dataclass(frozen=True)
class Quantize:
    """Int8 quantization settings. `mode = "none"` keeps the optimized fp32 graph."""

    mode: str = "none"
    per_channel: bool = True
    reduce_range: bool = False
    weight_type: str = "int8"
    activation_type: str = "uint8"
    op_types: tuple[str, ...] = ("MatMul", "Attention")
    # SmoothQuant-style migration of activation outliers into the weights; 0 turns it off.
    smooth_alpha: float = 0.0
    # Alphas to try instead, each smoothed, quantized and judged on the development split; the one nearest its
    # gate is kept (the quantize stage's metrics have a row for each).
    smooth_alphas: tuple[float, ...] = ()
    exclude_nodes: tuple[str, ...] = ()
    exclude_op_types: tuple[str, ...] = ()
    # Accuracy-aware fallback: at most this many quantizable nodes may be kept in fp32 to meet the thresholds.
    # Static mode only: the graph format, and how activation ranges are taken from the calibration text.
    format: str = "qoperator"
    calibration_method: str = "minmax"
    percentile: float = 99.999
    calibration_batch_size: int = 16
    # Static only: calibrated activation ranges are widened by this factor. The largest activation a few dozen
    # calibration examples show is short of what other text reaches, and a clipped outlier costs more accuracy
    # than a coarser step.
    range_margin: float = 1.0
    max_fp32_nodes: int = 0
    # The fallback must beat the thresholds on calibration text by this share of the gap to a perfect score
    # (0.5: cosine_min 0.99 must reach 0.995), so that it still meets them on held-out text.
    fallback_headroom: float = 0.5
    calibration_examples: int = 256
    # Static only: symmetric ranges (zero points of 0) for activations and weights, as TensorRT requires.
    symmetric: bool = False
    # weight_only: MatMul weights in `bits`-bit blocks of `block_size` (ONNX Runtime's MatMulNBits), activations
    # fp32; accuracy_level 4 multiplies in int8 (the fast kernel on x86; 8-bit has no other fast path).
    bits: int = 8
    block_size: int = 32
    accuracy_level: int = 4
    # How weight_only blocks are made: "symmetric" (a scale each), "zero_point" (a scale and an integer zero point,
    # ONNX Runtime's asymmetric blocks) or, 4-bit only, "minimum" (a scale and a float minimum each, GGUF Q4_1's
    # scheme, run as the integer kernel plus a small fp32 MatMul: pipeline/build/passes/block_minimum.py).
    blocks: str = "symmetric"
    # weight_only: the LM head's bits. A 4-bit head flips top-1 tokens the body's 4 bits do not; GGUF files commonly
    # keep the output layer wider (SmolLM2's Q4_1 file keeps it Q8_0).
    head_bits: int = 8


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Input shapes. `max_sequence_length = 0` means the model's own limit."""

    max_sequence_length: int = 0
    batch_size: int = 32
    overlong: str = "truncate"


@dataclasses.dataclass(frozen=True)
class Runtime:
    """ONNX Runtime session options the loader applies. `intra_op_threads = 0` lets ORT use every core."""

    intra_op_threads: int = 0
    inter_op_threads: int = 1
    graph_optimization_level: str = "all"
    execution_mode: str = "sequential"
    # The tune stage times these on the build host and records the fastest; empty means keep the above.
    candidate_threads: tuple[int, ...] = ()
    candidate_execution_modes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Accuracy:
    """Thresholds against the PyTorch baseline. A threshold left out is not checked, only reported.

    Scores (cosine, agreement) must be at least their threshold; differences at most theirs.
    """

    cosine_min: float | None = None
    cosine_mean: float | None = None
    top10_agreement: float | None = None
    top1_agreement: float | None = None
    max_probability_diff: float | None = None
    max_abs_diff: float | None = None
    # Decoders: the share of held-out prompts whose greedy continuation equals transformers' generate token for
    # token (1.0: every prompt). Their next-token logits are held to top1_agreement and the max_* thresholds.
    greedy_match: float | None = None
    # Decoders under quantization, judged on behaviour rather than ties: each held-out text is split at its middle
    # token and the second half is teacher-forced. teacher_top1_agreement: the share of positions where the
    # artifact's top token is PyTorch's; perplexity_ratio: the artifact's perplexity on the real text over
    # PyTorch's (at most this); greedy_prefix_agreement: the mean share of each greedy continuation reproduced
    # before the first differing token.
    teacher_top1_agreement: float | None = None
    perplexity_ratio: float | None = None
    greedy_prefix_agreement: float | None = None
    # Speech models: word error rate of the artifact's transcripts against transformers' fp32 transcripts of the
    # same held-out audio (at most this; 0.0: the same words on every clip).
    word_error_rate: float | None = None


@dataclasses.dataclass(frozen=True)
class Generation:
    """How decoder (text-generation) builds are validated and timed."""

    # Greedy tokens generated per held-out prompt and compared with transformers' generate(do_sample=False).
    new_tokens: int = 32
    # At most this many prompts are taken from the validation (and calibration) text: generation is slow.
    prompts: int = 32
    # Time to first token and decode tokens/s are measured at these batch sizes, against PyTorch generate, for the
    # report (`make bench` is the benchmark). 16 tokens: PyTorch's batch of 8 decodes Gemma 3 at about 2 steps a
    # second here, and 32 tokens cost its build 48 s of validation.
    speed_batch_sizes: tuple[int, ...] = (1, 8)
    speed_new_tokens: int = 16


@dataclasses.dataclass(frozen=True)
class TensorRT:
    """TensorRT engine settings. Precision comes from the graph (fp16 weights, or Q/DQ nodes), not builder flags,
    as TensorRT 11 requires. Profiles are (min, opt, max) batch and sequence; 0 for a sequence means the
    model's limit."""

    compute_capability: str = ""
    min_batch: int = 1
    opt_batch: int = 8
    max_batch: int = 32
    min_sequence: int = 1
    opt_sequence: int = 128
    max_sequence: int = 0
    workspace_mb: int = 4096
    builder_optimization_level: int = 3
    hardware_compatibility: str = "none"
    timing_cache: bool = True
    # Also make an int8 Q/DQ graph (model.int8.onnx), calibrated with [quantize]'s static settings made
    # symmetric int8, validated, published and built into its own engine.
    int8: bool = False


@dataclasses.dataclass(frozen=True)
class Serving:
    """How a serving engine batches this target's requests: Triton's dynamic batcher (`pipeline export triton`)
    and Ray Serve's @serve.batch (`pipeline serve`). max_batch_size 0 means the target's [shapes] batch_size."""

    max_batch_size: int = 0
    preferred_batch_sizes: tuple[int, ...] = (8, 32)
    max_queue_delay_us: int = 2000
    instances: int = 1


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One [[candidates]] row: a candidate the engine search builds with the recipe of its engine and quantize
    (pipeline.build.recipes), scores on the development split and times on the build host: an engine, a precision and
    how int8 is made ("dynamic"/"static": ONNX Runtime with the [quantize] settings and
    its fallback; "nncf": OpenVINO's post-training int8; "weight_only": MatMulNBits of `bits` bits made as
    `blocks` says, in blocks of `block_size` or else the [quantize] block size, with the [quantize] accuracy level
    and head bits). A candidate whose CPU flags the build host lacks is a row in the report, not built. `family`
    says which models it is for (encoders, or decoders); its [candidates.accuracy] thresholds, where set, replace
    the target's for this candidate, in the search and, once chosen, in validation (a quantized decoder is judged
    on perplexity and agreement, not on exact greedy ties)."""

    name: str
    engine: str
    precision: str
    quantize: str = "none"
    required_cpu_flags: tuple[str, ...] = ()
    family: str = "encoder"
    bits: int = 8
    blocks: str = "symmetric"
    # weight_only: the block size; left out, the [quantize] block_size (filled in when the target is parsed).
    # Larger blocks make fewer int32 partial sums to scale, so the same weights multiply faster.
    block_size: int | None = None
    # weight_only: where the candidate misses its gate, bisect over layers (as Polygraphy's debug precision does)
    # for the fewest "leading" or "trailing" layers kept at [quantize] head_bits with which it passes, one
    # teacher-forced pass a try ("none": no bisection).
    bisect_layers: str = "none"
    accuracy: Accuracy = Accuracy()


@dataclasses.dataclass(frozen=True)
class Target:
    """One hardware target, as read from `targets/<name>.toml`."""

    name: str
    description: str
    device: str
    engine: str
    precision: str
    required_cpu_flags: tuple[str, ...] = ()
    supported: bool = True
    unsupported_reason: str = ""
    optimize: Optimize = Optimize()
    quantize: Quantize = Quantize()
    shapes: Shapes = Shapes()
    runtime: Runtime = Runtime()
    accuracy: Accuracy = Accuracy()
    generation: Generation = Generation()
    tensorrt: TensorRT = TensorRT()
    serving: Serving = Serving()
    # The CPU kernel class the target is for: where the build host's class differs, its measurements are not the
    # target's, and the build says so.
    kernel_class: str = "any"
    candidates: tuple[Candidate, ...] = ()

    def to_dict(self) -> dict:
        """A JSON-ready copy, used in cache keys and manifests."""
        return dataclasses.asdict(self)

    @property
    def calibrates(self) -> bool:
        """Whether a build for this target learns from the calibration text: it quantizes (int8 ranges,
        smoothing, the fallback) or searches candidates (scored on its development split)."""
        return (
            self.quantize.mode != "none" or bool(self.candidates) or (self.engine == "tensorrt" and self.tensorrt.int8)
        )

    def family_candidates(self, family: str) -> tuple[Candidate, ...]:
        """The candidates for models of `family` ("encoder" or "decoder")."""
        return tuple(c for c in self.candidates if c.family == family)

    def with_candidate(self, name: str) -> Target:
        """This target as it holds the chosen candidate `name`: that candidate's thresholds replace the target's
        where it sets them."""
        candidate = next((c for c in self.candidates if c.name == name), None)
        if candidate is None:
            return self
        overrides = {k: v for k, v in dataclasses.asdict(candidate.accuracy).items() if v is not None}
        return dataclasses.replace(self, accuracy=dataclasses.replace(self.accuracy, **overrides))


def target_from_toml(path: Path) -> Target:
    """Parse one target file; every problem is a TargetError naming the file and key."""
    path = Path(path)
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TargetError(f"target file {path} does not exist") from None
    except OSError as err:  # a folder named like a target file, or one it cannot read
        raise TargetError(f"cannot read target file {path} ({err.strerror or err}); pass a .toml file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise TargetError(f"{path}: not valid TOML ({err}). Fix the syntax.") from None
    target = dataclass_from_table(Target, table, path, choices=CHOICES, ranges=RANGES)
    if target.name != path.stem:
        raise TargetError(f"{path}: name = {target.name!r} must match the file name {path.stem!r}")
    settings = [("quantize", target.quantize)] + [(f"candidates {c.name!r}", c) for c in target.candidates]
    for where, table in settings:
        if table.blocks == "minimum" and table.bits != 4:
            raise TargetError(
                f'{path}: {where} asks for blocks = "minimum" with bits = {table.bits}; float minimums are a 4-bit '
                'scheme: set bits = 4, or blocks = "symmetric" or "zero_point"'
            )
    sized = [
        c if c.block_size else dataclasses.replace(c, block_size=target.quantize.block_size) for c in target.candidates
    ]
    return dataclasses.replace(target, candidates=tuple(sized))


def available_targets(targets_dir: Path = TARGETS_DIR) -> list[str]:
    """Names of the target files in `targets_dir`."""
    return sorted(p.stem for p in Path(targets_dir).glob("*.toml") if p.is_file())


def native_target(kernel_class: str) -> str:
    """The target of a host's kernel class, for `--target native`."""
    if kernel_class not in NATIVE:
        raise TargetError(
            f"this host's CPU (kernel class {kernel_class}) has no native target: it lacks AVX2 and FMA, which every "
            "CPU target needs. Build a named target for the host you deploy to, e.g. --target cpu-avx2"
        )
    return NATIVE[kernel_class]


def load_target(name_or_path: str | Path, targets_dir: Path = TARGETS_DIR) -> Target:
    """A target by name (`cpu-avx2`) from `targets_dir`, or by path to a .toml file. `native` is the target of
    the build host's kernel class (see `native_target`)."""
    if str(name_or_path) == "native":
        from pipeline.runtime.host import kernel_class

        name_or_path = native_target(kernel_class())
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml":
        return target_from_toml(candidate)
    path = Path(targets_dir) / f"{name_or_path}.toml"
    if not path.exists():
        names = ", ".join(available_targets(targets_dir)) or "none"
        raise TargetError(
            f"unknown target {str(name_or_path)!r}; available in {targets_dir}: {names}. "
            "Pick one of those, or pass the path of a .toml target file."
        )
    return target_from_toml(path)

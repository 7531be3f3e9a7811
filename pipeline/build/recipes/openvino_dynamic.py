"""Recipe `openvino-int8-dynamic`: the plain export's weights compressed to int8 (NNCF `compress_weights`,
asymmetric, one scale and zero point an output channel), with OpenVINO's CPU plugin quantizing each MatMul's
activations to int8 as it runs, in groups of `group_size` values along each row (its `DYNAMIC_QUANTIZATION_GROUP_SIZE`;
what optimum-intel's `OVDynamicQuantizationConfig` sets). The products run in int8 as static int8 does, and no
calibration range clips a token the calibration text did not show.

all-mpnet-base-v2 on an AVX-512 host (Zen 4, 2 threads): NNCF's static int8 reached a development cosine min of
0.95 (its activations' calibrated ranges clip up to 4x on held-out tokens; a range wide enough loses resolution);
this form reached 0.9974 at groups of 128, x1.46 faster than bf16 at batch 1 and x1.44 at batch 32.
Symmetric weights reached 0.9907 at the same speed.

Larger groups are faster and coarser. The fallback tries GROUP_SIZES largest first and keeps the first with which
the development split passes: a compile and one development pass a try, on one compressed model. The IR names the
chosen group in its rt_info (`runtime_options`), which OpenVINO's compile reads where no config sets the property:
a consumer that compiles the IR without our loader (Triton's OpenVINO backend, OpenVINO Model Server,
benchmark_app) runs the validated group, not the CPU plugin's default of 32.

OpenVINO quantizes the activations only where the CPU has VNNI (its CPU plugin's source; AVX-VNNI or
AVX512-VNNI). Where the group changes nothing on the build host, the activations stayed f32 through the development
pass, and the artifact pins the group to 0 (off): a host with VNNI then runs what was validated, not int8
activations that no one checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging

import numpy as np

from pipeline.build.console import silenced
from pipeline.build.recipes.base import Built, Job, Recipe
from pipeline.build.recipes.openvino import inference_precision, plain_export, save_ir
from pipeline.runtime.backends.openvino import GROUP_RT_INFO

GROUP_SIZES = (128, 64, 32)


def int8_weights(model):
    """`model` (an OpenVINO model, not changed) with its MatMul and embedding weights compressed to int8,
    asymmetric, per output channel: data-free, seconds."""
    import nncf

    nncf.set_log_level(logging.ERROR)
    with silenced("nncf"), contextlib.redirect_stdout(io.StringIO()):  # its progress bars and tables
        return nncf.compress_weights(model.clone(), mode=nncf.CompressWeightsMode.INT8_ASYM)


def session_for(group_size: int, inference_precision: str | None) -> dict:
    """The artifact's session settings for one group size (the runtime's `compile_config` reads them)."""
    session = {"dynamic_quantization_group_size": group_size}
    if inference_precision:
        session["inference_precision"] = inference_precision
    return session


def quantizes_activations(model, feed: dict, inference_precision: str | None) -> bool:
    """Whether this host's CPU plugin quantizes the activations of `model` (int8 weights) as it runs: its outputs
    on `feed` differ between the finest group and none. (A group wider than a MatMul's input is no group at all:
    the finest is the one that applies wherever any does.)"""
    import openvino as ov

    from pipeline.runtime.backends.openvino import compile_config

    core = ov.Core()
    outputs = [
        core.compile_model(model, "CPU", compile_config(session_for(group, inference_precision)))(feed)[0]
        for group in (GROUP_SIZES[-1], 0)
    ]
    return not np.array_equal(*outputs)


def finest_passing(sessions: list[dict], passes, could_win=None) -> tuple[dict, list[dict]]:
    """The first of `sessions` (coarsest first) with which `passes(session)` holds, or the last where none does,
    with each try's record. `could_win(session)`, where given, runs after the first miss and raises to stop: the
    first session is the fastest the fallback can give."""
    tries = []
    for index, session in enumerate(sessions):
        tries.append({"group_size": session["dynamic_quantization_group_size"], "passed": passes(session)})
        if tries[-1]["passed"]:
            return session, tries
        if index == 0 and could_win is not None and len(sessions) > 1:
            could_win(session)
    return sessions[-1], tries


@dataclasses.dataclass(frozen=True)
class OpenVinoDynamicConfig:
    """OpenVINO's inference precision for what is not int8 (None: OpenVINO's default), and the activation group
    sizes the fallback tries, coarsest first."""

    inference_precision: str | None
    group_sizes: tuple[int, ...] = GROUP_SIZES


class OpenVinoDynamic(Recipe):
    """int8 weights and OpenVINO's dynamic int8 activations, at the coarsest group size that passes the
    development split."""

    name = "openvino-int8-dynamic"
    engine = "openvino"
    quantize = "dynamic"
    families = ("encoder",)
    precisions = ("int8",)
    Config = OpenVinoDynamicConfig
    fallback = True

    def config(self, candidate, target) -> OpenVinoDynamicConfig:
        """The inference precision of the float remainder (`inference_precision`)."""
        return OpenVinoDynamicConfig(inference_precision(candidate))

    def build(self, config: OpenVinoDynamicConfig, job: Job) -> Built:
        """The weight-compressed IR in `job.work`, run at the group size the fallback chose."""
        from pipeline.build.manifest import candidate_model
        from pipeline.build.recipes.openvino_int8 import development_passes, split_feeds

        job.work.mkdir(parents=True)
        compressed = int8_weights(plain_export(job))
        graph = save_ir(compressed, job, config.inference_precision).graph
        [feeds] = split_feeds(job, "development")
        passes = development_passes(job, feeds)
        longest = max(feeds, key=lambda feed: sum(np.size(value) for value in feed.values()))
        sizes = config.group_sizes if quantizes_activations(compressed, longest, config.inference_precision) else (0,)
        sessions = [session_for(size, config.inference_precision) for size in sizes]

        def could_win(session: dict) -> None:
            job.could_win(candidate_model(job.manifest, job.target, graph, "openvino", session))

        session, tries = finest_passing(sessions, lambda s: passes(compressed, s), could_win if job.could_win else None)
        fallback = {
            "group_size": session["dynamic_quantization_group_size"],
            "tries": tries,
            "int8_activations": sizes != (0,),
        }
        compressed.set_rt_info(str(fallback["group_size"]), GROUP_RT_INFO)
        save_ir(compressed, job, config.inference_precision)  # again, now naming its group for any OpenVINO consumer
        return Built(graph, "openvino", session, fallback)

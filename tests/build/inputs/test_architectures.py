"""The architecture records hold the family knowledge the stages ask for: here, the export probe's tolerance."""

import dataclasses
import math

import pytest

from pipeline.build.inputs.architectures import ARCHITECTURES
from pipeline.errors import ExportError


def test_the_export_probe_is_checked_against_the_familys_tolerance_and_refuses_nan():
    bert = ARCHITECTURES["bert"]
    bert.check_probe(9e-4, "the exported graph")  # within 1e-3
    for diff in (2e-3, math.nan, math.inf):
        with pytest.raises(ExportError, match=r"graph differs from PyTorch by .* \(allowed 0.001\)") as err:
            bert.check_probe(diff, "the exported graph")
        assert "\n" not in str(err.value)
    looser = dataclasses.replace(bert, probe_tolerance=1e-2)  # a family whose kernels round further apart
    looser.check_probe(2e-3, "the exported graph")
    with pytest.raises(ExportError, match="on a probe picture"):
        looser.check_probe(0.5, "the exported graph", "a probe picture")

import dataclasses
import re
from pathlib import Path

import pytest

from pipeline.build.inputs.targets import target_from_toml
from pipeline.build.inputs.targets.schema import dataclass_from_table
from pipeline.errors import TargetError
from tests.conftest import write_target


@dataclasses.dataclass(frozen=True)
class Inner:
    name: str
    rate: float = 0.5


@dataclasses.dataclass(frozen=True)
class Outer:
    mode: str = "a"
    sizes: tuple[int, ...] = (1,)
    items: tuple[Inner, ...] = ()


CHOICES = {("mode",): ("a", "b")}
RANGES = {("sizes",): (1, 8), ("items", "rate"): (0.0, 1.0)}


def parse(table: dict) -> Outer:
    return dataclass_from_table(Outer, table, Path("t.toml"), choices=CHOICES, ranges=RANGES)


def test_a_table_becomes_frozen_dataclasses_with_lists_as_tuples_and_defaults_kept():
    parsed = parse({"sizes": [2, 4], "items": [{"name": "x"}, {"name": "y", "rate": 1}]})
    assert parsed == Outer("a", (2, 4), (Inner("x", 0.5), Inner("y", 1.0)))
    assert isinstance(parsed.items[1].rate, float)


@pytest.mark.parametrize(
    "table, message",
    [
        ({"mdoe": "a"}, "unknown key 'mdoe' in the top level; known keys there: items, mode, sizes"),
        ({"mode": "c"}, "key 'mode': 'c' is not one of a, b"),
        ({"sizes": [2, 9]}, "key 'sizes': 9 is out of range; it must be from 1 to 8"),
        ({"sizes": [True]}, "key 'sizes': expected a list of int"),
        ({"items": [{"name": "x", "rate": 2.0}]}, "key 'items.rate': 2.0 is out of range"),
        ({"items": [{"rate": 0.1}]}, "key 'items.name' is required and missing"),
        ({"items": [{"name": "x"}, {"name": "x"}]}, "two \\[\\[items\\]\\] share a name"),
        ({"items": [{"name": "../../evil"}]}, r"key 'items.name': '../../evil' is not a valid name; a name matches"),
        ({"items": [{"name": ""}]}, r"key 'items.name': '' is not a valid name; a name matches \[a-z0-9\]"),
        ({"items": [{"name": ".hidden"}]}, "key 'items.name': '.hidden' is not a valid name"),
        ({"items": [{"name": "a/b"}]}, "key 'items.name': 'a/b' is not a valid name"),
        ({"items": [{"name": "x" * 65}]}, "is not a valid name"),
    ],
)
def test_each_problem_is_a_target_error_naming_the_file_and_key(table, message):
    with pytest.raises(TargetError, match=f"^t.toml: .*{message}"):
        parse(table)


@pytest.mark.parametrize("key", ["cosine_min", "cosine_mean"])
def test_target_file_refuses_a_negative_cosine(tmp_path, key):
    path = write_target(tmp_path, "ranged", **{f"accuracy__{key}": -0.5})
    with pytest.raises(TargetError, match=rf"^{re.escape(str(path))}: key 'accuracy.{key}': -0.5 is out of range"):
        target_from_toml(path)


@pytest.mark.parametrize("bad", ["../../evil", "", "Upper", "a b"])
def test_target_file_refuses_an_unsafe_target_or_candidate_name(tmp_path, bad):
    candidates = [{"name": bad, "engine": "onnxruntime", "precision": "fp32"}]
    path = write_target(tmp_path, "ranged", candidates=candidates)
    where = re.escape(str(path))
    with pytest.raises(TargetError, match=f"^{where}: key 'candidates.name': {re.escape(repr(bad))} is not a valid"):
        target_from_toml(path)
    path.write_text(path.read_text().replace('name = "ranged"', f"name = {bad!r}", 1))
    with pytest.raises(TargetError, match=f"^{where}: key 'name': {re.escape(repr(bad))} is not a valid name"):
        target_from_toml(path)

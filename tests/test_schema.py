import dataclasses
from pathlib import Path

import pytest

from pipeline.errors import TargetError
from pipeline.schema import dataclass_from_table


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
    ],
)
def test_each_problem_is_a_target_error_naming_the_file_and_key(table, message):
    with pytest.raises(TargetError, match=f"^t.toml: .*{message}"):
        parse(table)

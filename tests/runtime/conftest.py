"""Fixtures of the runtime's tests."""

import shutil

import pytest

from tests.runtime.backtracking import add_backtracking_split


@pytest.fixture(scope="module")
def backtracking(published, tmp_path_factory):
    """A copy of the session's artifact whose tokenizer.json has a Split pattern that backtracks without bound."""
    copy = tmp_path_factory.mktemp("backtracking") / "tiny-bert" / published.parent.name / published.name
    shutil.copytree(published, copy)
    return add_backtracking_split(copy)

"""argparse value types shared by the command-line tools."""

import argparse

import pytest

from omgs_hook.cli_types import density, integer_at_least, non_negative_number, positive_number


@pytest.mark.parametrize("parse, text, expected", [
    (integer_at_least(1), "3", 3),
    (integer_at_least(0), "0", 0),
    (density, "0.001", 0.001),
    (density, "1", 1.0),
    (positive_number, "1e-3", 1e-3),
    (non_negative_number, "0", 0.0),
    (non_negative_number, "2.5", 2.5),
])
def test_accepted_values(parse, text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize("parse, text, message", [
    (integer_at_least(1), "0", "must be >= 1"),
    (integer_at_least(1), "1.5", "expected an integer"),
    (density, "0", r"must be in \(0, 1\]"),
    (density, "x", "expected a number"),
    (positive_number, "0", "must be positive"),
    (positive_number, "-2", "must be positive"),
    (positive_number, "inf", "must be finite"),
    (non_negative_number, "-0.1", ">= 0"),
    (non_negative_number, "nan", "must be finite"),
    (non_negative_number, "fast", "expected a number"),
])
def test_rejected_values_name_the_problem(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse(text)

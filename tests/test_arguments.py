"""The command-line pieces every subcommand shares (``decodekit.arguments``): files the user names,
and the flags' defaults."""

from __future__ import annotations

import os

import pytest

from decodekit.arguments import existing_file
from decodekit.errors import InvalidParameter


def test_existing_file_refuses_what_exists_but_is_no_file(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(InvalidParameter, match=r"^drafter '.*pipe' not found$"):
        existing_file(fifo, "drafter")
    (tmp_path / "f").write_text("x")
    assert existing_file(tmp_path / "f", "drafter") == tmp_path / "f"


def test_existing_file_names_the_field_it_came_in_whether_missing_or_a_folder(tmp_path):
    with pytest.raises(InvalidParameter) as err:
        existing_file(tmp_path / "nothing", "drafter", param="drafter")
    assert err.value.param == "drafter"
    with pytest.raises(InvalidParameter) as err:
        existing_file(tmp_path, "drafter", param="drafter")
    assert err.value.param == "drafter"


def test_a_command_that_chooses_its_numerics_gets_none_by_default():
    """``serve`` chooses fast where the model and the CPU allow it: its --numerics default is None
    (to be chosen), not exact; the other commands' stays exact."""
    import argparse

    from decodekit.arguments import add_numerics_arguments

    for default in (None, "exact", "fast"):
        parser = argparse.ArgumentParser()
        add_numerics_arguments(parser, default)
        assert parser.parse_args([]).numerics == default
        assert parser.parse_args(["--numerics", "exact"]).numerics == "exact"


@pytest.mark.parametrize("text, value", [("-3e38", -3e38), ("-1E-3", -1e-3), ("-.5", -0.5), ("-2.", -2.0),
                                         ("-inf", float("-inf")), ("-7", -7.0)])
def test_a_negative_number_in_any_notation_is_a_value_not_a_flag(text, value):
    """argparse before Python 3.13 took -3e38 or -inf for a flag: "expected one argument", a line that
    named nothing wrong with the number (which the option's own check then judges)."""
    from decodekit.interfaces.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "--frequency-penalty", text])
    assert args.frequency_penalty == value
    with pytest.raises(InvalidParameter, match="expected one argument"):
        build_parser().parse_args(["generate", "hi", "--frequency-penalty", "-x"])  # a flag is still a flag

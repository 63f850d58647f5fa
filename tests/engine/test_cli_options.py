"""Options whose default is written once: the help names it, a number gives the option its type."""

import argparse

from engine.cli_options import add_option


def test_add_option_names_the_default_in_the_help_and_types_numbers():
    parser = argparse.ArgumentParser()
    add_option(parser, "--timeout-s", 600.0, "deadline for the models")
    add_option(parser, "--users", 4, "concurrent users")
    add_option(parser, "--share", 0.25, "share of bad requests")
    add_option(parser, "--out", "reports/x", "report directory", metavar="DIR")
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["timeout_s"] == "deadline for the models (default 600)"
    assert helps["users"] == "concurrent users (default 4)"
    assert helps["share"] == "share of bad requests (default 0.25)"
    assert helps["out"] == "report directory (default reports/x)"
    args = parser.parse_args(["--timeout-s", "5", "--users", "3"])
    assert (args.timeout_s, args.users, args.share, args.out) == (5.0, 3, 0.25, "reports/x")
    assert type(args.timeout_s) is float and type(args.users) is int

"""Fixed-width text tables: widths written once apply to the head and to every row."""

from engine.tables import fmt, table_lines


def test_fmt_scales_and_marks_missing_figures():
    assert fmt(None) == "-" and fmt(0.1234, ".1f", 100.0) == "12.3" and fmt(0.5, ".1%") == "50.0%"


def test_table_lines_align_cells_under_their_titles():
    columns = [("model", "<6"), ("tok/s", ">7")]
    assert table_lines(columns, [["fp32", fmt(12.34)], ["int8", fmt(None)]]) == [
        "model    tok/s",
        "--------------",
        "fp32      12.3",
        "int8         -",
    ]
    assert table_lines(columns, [["a-long-name", "1"]], indent="  ", rule=False) == [
        "  model    tok/s",
        "  a-long-name       1",
    ]

"""The generated section of a results document: rewritten, the rest kept."""

import pytest

from omgs_hook.generated_docs import END_MARKER, begin_marker, write_generated_section


def test_a_new_file_gets_title_and_markers_and_the_rest_survives_rewrites(tmp_path):
    doc = tmp_path / "sub" / "results.md"
    write_generated_section(str(doc), "table one\n", "scripts/x.py", "Results")
    text = doc.read_text()
    assert text.startswith("# Results\n") and begin_marker("scripts/x.py") in text
    doc.write_text("intro\n" + text + "discussion\n")
    write_generated_section(str(doc), "table two\n", "scripts/x.py", "Results")
    text = doc.read_text()
    assert "intro\n" in text and text.endswith(END_MARKER + "\n" + "discussion\n")
    assert "table two" in text and "table one" not in text


def test_a_file_without_markers_is_refused_and_left_alone(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text("hand-written\n")
    with pytest.raises(SystemExit, match=r"x: .* has no generated-section markers"):
        write_generated_section(str(doc), "table\n", "scripts/x.py", "Results")
    assert doc.read_text() == "hand-written\n"
    # another tool's section is not this tool's
    doc.write_text(begin_marker("scripts/y.py") + "\n" + END_MARKER + "\n")
    with pytest.raises(SystemExit, match="markers"):
        write_generated_section(str(doc), "table\n", "scripts/x.py", "Results")


def test_two_sections_of_one_document_are_rewritten_independently(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text(f"# R\n{begin_marker('scripts/x.py')}\nold x\n{END_MARKER}\nmiddle\n"
                   f"{begin_marker('scripts/x.py --model y')}\nold y\n{END_MARKER}\nend\n")
    write_generated_section(str(doc), "new y\n", "scripts/x.py --model y", "R")
    write_generated_section(str(doc), "new x\n", "scripts/x.py", "R")
    text = doc.read_text()
    assert text == (f"# R\n{begin_marker('scripts/x.py')}\nnew x\n{END_MARKER}\nmiddle\n"
                    f"{begin_marker('scripts/x.py --model y')}\nnew y\n{END_MARKER}\nend\n")

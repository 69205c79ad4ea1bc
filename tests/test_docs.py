from pathlib import Path

from attn_dispatch.commands.matrix_cmd import render_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_support_matrix_doc_is_current():
    doc = ROOT / "docs" / "support-matrix.md"
    assert doc.read_text() == render_markdown(), (
        "docs/support-matrix.md is stale: run `attn-dispatch matrix --markdown > docs/support-matrix.md`")


def test_every_check_appears_in_the_matrix():
    from attn_dispatch.constraints import TABLES

    text = render_markdown()
    for table in TABLES.values():
        for check in table.checks:
            assert f"`{check.code}`" in text and check.source

"""Text from inputs (case names, descriptions, dump file names, reasons) made safe for where
it is shown. One function per destination; the renderers call them at the point of output.

  csv_cell   a spreadsheet never evaluates a cell: a text cell starting with `=`, `+`, `-`,
             `@`, a tab or a carriage return gets a leading `'` (OWASP's rule for CSV
             injection); other control characters become `?`. Numbers are left as numbers.
  terminal   no control character reaches a terminal: C0 (but tab), DEL and C1 characters,
             escape sequences included, become `?`; newlines too unless `lines=True`.
  xml_text   characters XML 1.0 cannot hold (C0 but tab/LF/CR, surrogates, U+FFFE/U+FFFF)
             become U+FFFD, so junit.xml stays well-formed.
  rich       rich console markup (`[bold]`, `[/]`) is shown as text, never interpreted;
             control characters stripped as for `terminal`.
  mathtext   matplotlib reads `$...$` as mathtext: every `$` is escaped, so a name is drawn
             as text and never parsed (a bad macro such as `$\\macro$` would crash the figure).
"""
from __future__ import annotations

import re

_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_NL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def csv_cell(v):
    """A CSV cell that no spreadsheet evaluates and no reader splits: a leading `'` before
    a formula start, control characters but tab and newline (which the writer quotes) as
    `?` (a bare carriage return would end the row for some readers). Non-strings unchanged."""
    if not isinstance(v, str):
        return v
    if v.startswith(_FORMULA_START):
        v = "'" + v
    return _CONTROL.sub("?", v.replace("\r", "?"))


def csv_frame(df):
    """A copy of a DataFrame with every text cell through `csv_cell` (column names too)."""
    from pandas.api.types import is_numeric_dtype
    out = df.copy()
    for c in out.columns:
        if not is_numeric_dtype(out[c]):
            out[c] = out[c].map(csv_cell)
    out.columns = [csv_cell(str(c)) for c in out.columns]
    return out


def terminal(text, *, lines: bool = False) -> str:
    """`text` with every control character (escape sequences included) shown as `?`;
    newlines kept only when `lines`."""
    return (_CONTROL if lines else _CONTROL_NL).sub("?", str(text)).replace("\t", " ")


def xml_text(text) -> str:
    """`text` with every character XML 1.0 cannot hold replaced by U+FFFD."""
    return _XML_BAD.sub("\ufffd", str(text))


def xml_tree(root):
    """Every attribute, text and tail of an ElementTree element (and below) through
    `xml_text`, in place; returns `root`."""
    for el in root.iter():
        for k, v in el.attrib.items():
            el.attrib[k] = xml_text(v)
        if el.text is not None:
            el.text = xml_text(el.text)
        if el.tail is not None:
            el.tail = xml_text(el.tail)
    return root


def rich(text, *, lines: bool = False) -> str:
    """`text` for rich's console: markup escaped, control characters shown as `?`."""
    from rich.markup import escape
    return escape(terminal(text, lines=lines))


def mathtext(text) -> str:
    """`text` for a matplotlib title, label or tick: drawn literally, never parsed as mathtext."""
    return str(text).replace("$", r"\$")


def wide_console():
    """A terminal's own width; logs and CI get 170 columns instead of 80 folded ones."""
    from harness.io.console import rich_console
    c = rich_console()
    return c if c.is_terminal else rich_console(width=170)

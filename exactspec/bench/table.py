"""A plain-text or Markdown table, as every bench report prints one."""

from __future__ import annotations


def render_table(cols: list[str], body: list[list[str]], markdown: bool) -> str:
    """Columns `cols` over rows `body` (strings), aligned, or as a Markdown table."""
    if markdown:
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(c), *(len(r[i]) for r in body)) if body else len(c)
              for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)

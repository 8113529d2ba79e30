"""`--help` that reads at any width (a pipe, a Slurm log, an 80-column terminal).

Typer's rich help lays the options out as a table that squeezes every column to fit, so at 80
columns the flag names themselves were cut (`--micro_train_batch_s…`), and boolean flags showed a
`<bool>` value they do not take. Here the name column never wraps or shrinks; the type and help
columns take what width is left and wrap.
"""
from __future__ import annotations

_done = False


def _one_line(e) -> None:
    """A bad value or an unknown flag: `error: ...`, as the scripts' own checks print (exit 2 stays click's)."""
    import sys

    if type(e).__name__ != "NoArgsIsHelpError":
        print(f"error: {e.format_message()} (--help lists the flags)", file=sys.stderr)


def install() -> None:
    """Patch typer's help rendering once per process (only our scripts' apps live in it)."""
    global _done
    if _done:
        return
    _done = True
    try:
        from rich.table import Table
        from rich.text import Text
        from typer import core, rich_utils
    except ImportError:  # a typer without rich help: nothing to mend
        return
    if not hasattr(rich_utils, "Table"):
        return

    class WholeNames(Table):
        def add_row(self, *cells, **kw):
            for cell in cells:
                for part in getattr(cell, "renderables", [cell]):  # typer's help cell: Columns of Texts
                    if isinstance(part, Text):
                        part.overflow = "fold"
            super().add_row(*cells, **kw)
            self.columns[0].no_wrap = True  # the flag name: never cut
            for column in self.columns[1:]:
                column.overflow = "fold"  # a long word (a flag named in the help) breaks rather than ends in "…"

    rich_utils.Table = WholeNames
    if hasattr(rich_utils, "rich_format_error"):
        rich_utils.rich_format_error = _one_line
    shown = getattr(core.TyperOption, "display_type_rich", None)

    def display_type_rich(self, ctx):
        if self.is_flag and not self.count:
            return None  # a flag takes no value
        if self.nargs > 1:
            one = shown(self, ctx).removesuffix("...").strip("<>").split(",")
            return " ".join(f"<{t}>" for t in one) if len(one) == self.nargs else f"<{one[0]}> x{self.nargs}"
        return shown(self, ctx)

    if shown is not None:  # older typers (the GPU image's) show no type for flags anyway
        core.TyperOption.display_type_rich = display_type_rich

"""--help in sections: each option says its section where it is declared (launcher/options.py; an engine flag's in
its EngineConfig field, fp8cache/config.py), and a command made with cls=SectionedCommand lists its options
section by section, the most used first.

A command's own options join the shared ones' sections by naming one of SECTIONS; an option that names none is
listed under "Other options" (tests/launcher/test_help.py keeps `run`, `generate` and `systemd-unit` free of
such options).
"""

from __future__ import annotations

import click

# In the order --help lists them; a command shows only the sections it has options in.
SECTIONS = ("Unit", "Model", "Sampling", "KV cache", "Server", "Scheduling", "Device", "Server limits", "Logging")
OTHER = "Other options"


class SectionedOption(click.Option):
    """A click.Option with the --help section it belongs to (one of SECTIONS, or None for OTHER)."""

    def __init__(self, *args, section: str | None = None, **kwargs) -> None:
        if section is not None and section not in SECTIONS:
            raise ValueError(f"option section {section!r} is not one of {', '.join(SECTIONS)}")
        super().__init__(*args, **kwargs)
        self.section = section


def section_of(param: click.Parameter) -> str:
    return getattr(param, "section", None) or OTHER


class SectionedCommand(click.Command):
    """A click.Command whose --help lists its options under their sections (SECTIONS order, then OTHER), each
    section in the order the options are declared, the first column aligned across sections."""

    def sections(self, ctx: click.Context) -> list[tuple[str, list[tuple[str, str]]]]:
        """[(section title, [(option, help)])] as --help shows them."""
        found: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and not isinstance(param, click.Argument):
                found.setdefault(section_of(param), []).append(record)
        return [(name, found[name]) for name in (*SECTIONS, OTHER) if name in found]

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections = self.sections(ctx)
        col_max = 30  # click's: a longer option name puts its help on the next line
        width = min(col_max, max((len(name) for _, rows in sections for name, _ in rows), default=0))
        for title, rows in sections:
            with formatter.section(title):
                formatter.write_dl([(name.ljust(width), text) for name, text in rows], col_max=col_max)

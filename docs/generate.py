"""Writes the site's generated pages: the API reference (one page per subpackage, one entry per public
name) and the command-line reference (one section per command, from the argument parser).

    python docs/generate.py            # rewrite docs/reference/
    python docs/generate.py --check    # exit 1 and name the pages that are out of date

tests/test_docs.py runs the check, so a public name without a page, or a flag whose page was not
regenerated, fails the suite. mkdocs does not publish this file (mkdocs.yml, exclude_docs).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REFERENCE = DOCS / "reference"
HEADER = "<!-- written by docs/generate.py: edit the docstrings or the parser, then run it again -->\n\n"


def public_names() -> dict[str, list[tuple[str, str]]]:
    """{page: [(shown name, the object's import path for mkdocstrings)]}: each subpackage's ``__all__``,
    and the names of ``yolokit.__all__`` that no subpackage exports (at the module that defines them,
    since the top level imports them on first use)."""
    import yolokit

    pages = {"yolokit": []}
    for sub in yolokit.SUBPACKAGES:
        module = importlib.import_module(f"yolokit.{sub}")
        pages[sub] = [(f"yolokit.{sub}.{name}", f"yolokit.{sub}.{name}") for name in module.__all__]
    for name, home in sorted(yolokit._PUBLIC.items()):
        if top_level_home(name) is None:
            pages["yolokit"].append((f"yolokit.{name}", f"{home}.{name}"))
    return pages


def top_level_home(name: str) -> str | None:
    """The subpackage whose ``__all__`` holds ``yolokit.<name>`` too (its entry is there), or None."""
    import yolokit

    home = yolokit._PUBLIC[name].split(".")[1]
    return home if name in importlib.import_module(f"yolokit.{home}").__all__ else None


def api_pages() -> dict[str, str]:
    """{file name under reference/: its text}."""
    import yolokit

    pages, index = {}, [HEADER, "# API reference\n\n",
                        "Every public name, from its docstring: `yolokit.__all__` and each subpackage's `__all__`. "
                        "`import yolokit` imports no subpackage until it is used; the names of the top level are "
                        "shown at the module that defines them.\n\n", "| module | names |\n|---|---:|\n"]
    for page, names in public_names().items():
        title = "yolokit" if page == "yolokit" else f"yolokit.{page}"
        lines = [HEADER, f"# {title}\n\n"]
        if page == "yolokit":
            lines.append(f"{yolokit.__doc__.splitlines()[0]}\n\n| name | its entry |\n|---|---|\n")
            for name in sorted(yolokit._PUBLIC):
                home = top_level_home(name)
                path = f"yolokit.{home}.{name}" if home else f"{yolokit._PUBLIC[name]}.{name}"
                lines.append(f"| `yolokit.{name}` | [`{path}`][{path}] |\n")
            lines.append("\n")
        else:
            lines.append(f"::: {title}\n    options:\n      members: false\n      show_root_heading: false\n\n")
        for shown, path in names:
            lines.append(f"::: {path}\n    options:\n      heading_level: 2\n")
            if shown != path:
                lines.append("      show_root_full_path: false\n")
            lines.append("\n")
        pages[f"{page}.md"] = "".join(lines).rstrip() + "\n"
        index.append(f"| [{title}]({page}.md) | {len(names)} |\n")
    pages["index.md"] = "".join(index)
    return pages


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest}`"
    return ", ".join(f"`{s}`" for s in action.option_strings)


def _default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, (argparse._HelpAction,
                                                                           argparse._VersionAction)):
        return ""
    return f"`{action.default}`"


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def _command_section(name: str, parser: argparse.ArgumentParser, help_text: str, level: int) -> list[str]:
    lines = [f"{'#' * level} `{name}`\n\n"]
    if help_text:
        lines.append(f"{help_text[0].upper()}{help_text[1:]}.\n\n")
    if parser.description:
        lines.append(f"{parser.description}\n\n")
    actions = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    if actions:
        lines.append("| argument | default | meaning |\n|---|---|---|\n")
        for action in actions:
            choices = f" (one of {', '.join(map(str, action.choices))})" if action.choices and len(
                action.choices) <= 12 else ""
            default, meaning = _default(action), (action.help or "").replace("%%", "%")
            stated = re.search(r"\s*\(default: ([^()]*)\)$", meaning)   # TrainConfig flags say it in their help
            if stated and not default:
                default, meaning = f"`{stated.group(1)}`", meaning[:stated.start()]
            lines.append(f"| {_flags(action)} | {_cell(default)} | {_cell(meaning)}{choices} |\n")
        lines.append("\n")
    if parser.epilog:
        lines.append(f"{parser.epilog}\n\n")
    for sub in parser._actions:
        if isinstance(sub, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in sub._choices_actions}
            for child, child_parser in sub.choices.items():
                lines += _command_section(f"{name} {child}", child_parser, helps.get(child) or "", level + 1)
    return lines


def cli_page() -> str:
    from yolokit.cli import build_parser

    parser = build_parser()
    lines = [HEADER, "# Command line\n\n",
             "`yolokit COMMAND [ARGUMENTS]`, also `python -m yolokit`. Each command's `--help` prints the same. "
             "Flags of `yolokit train` are `TrainConfig` fields and take `-` or `_`.\n\n"]
    for sub in parser._actions:
        if isinstance(sub, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in sub._choices_actions}
            for name, child in sub.choices.items():
                lines += _command_section(f"yolokit {name}", child, helps.get(name) or "", 2)
    return "".join(lines).rstrip() + "\n"


def pages() -> dict[Path, str]:
    out = {REFERENCE / name: text for name, text in api_pages().items()}
    out[REFERENCE / "cli.md"] = cli_page()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="name the pages that are out of date; write nothing")
    args = parser.parse_args(argv)
    stale = [path for path, text in pages().items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(DOCS.parent)} is out of date: run python docs/generate.py")
        return 1 if stale else 0
    REFERENCE.mkdir(exist_ok=True)
    for path, text in pages().items():
        path.write_text(text)
    print(f"wrote {len(pages())} pages under {REFERENCE.relative_to(DOCS.parent)} ({len(stale)} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

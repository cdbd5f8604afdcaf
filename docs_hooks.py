"""mkdocs hook: the command-line reference, generated from the argparse parser at build time.

``reference/cli.md`` is written from ``onnx_training_ops.cli.build_parser()`` (every command,
its usage line, description and arguments), so the page cannot drift from the code.
"""

from __future__ import annotations

import argparse

from mkdocs.structure.files import File

PAGE = "reference/cli.md"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:  # argparse keeps no public list of its arguments
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
        if action.option_strings:
            value = f" {metavar}" if action.nargs != 0 else ""
            name = ", ".join(f"`{s}{value}`" for s in action.option_strings)
        else:
            name = f"`{metavar}`"
        if action.help is argparse.SUPPRESS:
            continue
        # argparse's own expansion of %(default)s, %(choices)s... (HelpFormatter._expand_help)
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        if params.get("choices") is not None:
            params["choices"] = ", ".join(map(str, params["choices"]))
        help_text = (action.help or "") % dict(params, prog=parser.prog)
        if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
            help_text += f" (one of: {', '.join(f'`{c}`' for c in action.choices)})"
        default = action.default
        if (action.option_strings and default not in (None, False, argparse.SUPPRESS) and action.nargs != 0
                and "default" not in help_text):
            help_text += f" (default: `{default}`)"
        rows.append(f"| {name} | {_cell(help_text)} |")
    if not rows:
        return []
    return ["| argument | meaning |", "| --- | --- |", *rows, ""]


def _command(parser: argparse.ArgumentParser, level: int) -> list[str]:
    lines = [f"{'#' * level} `{parser.prog}`", ""]
    if parser.description:
        lines += [parser.description.strip(), ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    lines += _arguments(parser)
    if parser.epilog:
        lines += [parser.epilog.strip(), ""]
    return lines


def cli_markdown() -> str:
    """The command-line reference page, from ``build_parser()``.

    Returns:
        The page's Markdown: the top-level usage, then one section per command.
    """
    from onnx_training_ops.cli import build_parser

    parser = build_parser()
    parser.prog = "onnx-training-ops"
    lines = [
        "# Command line",
        "",
        "Generated from the argparse parser (`onnx_training_ops.cli.build_parser`) when the site "
        "is built. Installed as `onnx-training-ops`; `python -m onnx_training_ops` is the same; "
        "the exit statuses follow the usage line below.",
        "",
        *_command(parser, 2),
    ]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # an alias (train/demo) names the same parser
                    continue
                seen.add(id(sub))
                sub.prog = f"onnx-training-ops {name}"
                if not sub.description and helps.get(name):
                    sub.description = helps[name]
                lines += _command(sub, 3)
    return "\n".join(lines) + "\n"


def on_files(files, config):
    """Add the generated command-line page to the site's files."""
    files.append(File.generated(config, PAGE, content=cli_markdown()))
    return files

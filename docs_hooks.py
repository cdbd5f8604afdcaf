"""The documentation site's build hooks.

* mkdocs hook: ``reference/cli.md`` is written from ``onnx_training_ops.cli.build_parser()``
  (every command, its usage line, description and arguments) at build time, so the page cannot
  drift from the code.
* Griffe extension :class:`ReSTRoles` (mkdocs.yml, the python handler's ``extensions``): the
  docstrings cross-reference in Sphinx's reST roles (``:class:`~onnx_training_ops.TrainingSession```,
  ``:func:`.prepare```, ``:meth:`save```), which Markdown would show as literal text. Each
  becomes a cross-reference that mkdocs-autorefs renders as a link where the site documents
  the target, and as the name in code font where it does not (an internal module).
"""

from __future__ import annotations

import argparse
import re
from html import escape

from mkdocs.structure.files import File

try:  # the docs extra installs griffe (with mkdocstrings); the CLI page needs only mkdocs
    from griffe import AliasResolutionError, Extension, NameResolutionError
except ImportError:  # pragma: no cover
    Extension = object

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


# ---- reST roles in docstrings -> autorefs cross-references ----

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)(\.*)([\w.]+)`")


def _members(obj):
    """``obj`` and everything it defines (not what it imports), depth first."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _members(member)


def _find(collection, path: str):
    try:
        found = collection[path]
        return found.canonical_path if found.is_alias else found.path
    except (KeyError, AliasResolutionError, ValueError):
        return None


def _target(obj, collection, dots: str, name: str) -> str | None:
    """The canonical path of the object a role in ``obj``'s docstring names, or None. Sphinx's
    lookup: relative names (``.x``) and bare ones are searched from ``obj`` outwards (its
    class, its module, the packages above), bare names also through ``obj``'s imports."""
    head, _, rest = name.partition(".")
    scopes = []
    scope = obj
    while scope is not None:
        scopes.append(scope.path)
        scope = scope.parent
    candidates = [f"{base}.{name}" for base in scopes] + ([] if dots else [name])
    if not dots:
        try:
            resolved = obj.resolve(head)
            candidates.insert(0, f"{resolved}.{rest}" if rest else resolved)
        except (NameResolutionError, AliasResolutionError, KeyError, ValueError):
            pass
    for candidate in candidates:
        found = _find(collection, candidate)
        if found is not None:
            return found
    return None


class ReSTRoles(Extension):
    """Rewrite the reST roles of every docstring of the package as autorefs cross-references
    (``optional``: a target the site does not document is shown as code, not an error)."""

    def on_package(self, *, pkg, loader, **kwargs) -> None:
        collection = loader.modules_collection
        for obj in _members(pkg):
            if obj.docstring is None or ":`" not in obj.docstring.value:
                continue

            def replace(match: re.Match, obj=obj) -> str:
                short, dots, name = match.groups()
                shown = name.rsplit(".", 1)[-1] if short else name
                target = _target(obj, collection, dots, name) or name
                return f'<autoref identifier="{escape(target)}" optional><code>{escape(shown)}</code></autoref>'

            obj.docstring.value = ROLE.sub(replace, obj.docstring.value)
